"""The engines a command can run on (`--engine torch | llama.cpp`), behind one small interface: the tokenizer, the
blocks a policy reads on the model, and generate(). Options only one engine reads are refused on the other."""

from __future__ import annotations

from ..errors import EpiKVError
from .common import positive_int

# options of add_model_args / generate that only the torch engine reads, with their defaults
_TORCH_ONLY = {"device": None, "device_map": None, "dtype": None, "attn": None, "prefill_chunk": None}


THREADS_HELP = ("CPU threads: llama.cpp's (default half the cores available, as llama-cpp-python: its threads spin "
                "while they wait) or torch's (torch.set_num_threads; default torch's own, one per physical core)")
FLASH_ATTN = {"auto": None, "on": True, "off": False}  # --flash-attn as the llama.cpp engine takes it


def add_flash_attn_arg(g) -> None:
    g.add_argument("--flash-attn", choices=tuple(FLASH_ATTN), default="auto",
                   help="llama.cpp's flash attention (--engine llama.cpp; default auto: llama.cpp's choice, on for "
                        "the CPU). With it on and 2+ threads a long context's answer may depend on its batch-mates; "
                        "off (or --threads 1) makes it batch-invariant")


def add_engine_args(p, threads_help: str | None = None, flash_attn: bool = False) -> None:
    """--engine and --threads, the same on every command that takes them (and --flash-attn where the command passes
    it to llama.cpp)."""
    g = p.add_argument_group("engine")
    g.add_argument("--engine", choices=("torch", "llama.cpp"), default="torch",
                   help="torch (transformers, default) or llama.cpp (a GGUF: --model smollm2 or a local .gguf file; "
                        "runs on the CPU only)")
    g.add_argument("--threads", type=positive_int, default=None, help=threads_help or THREADS_HELP)
    if flash_attn:
        add_flash_attn_arg(g)


def make_engine(args):
    """The engine --engine names, loaded (torch-only options refused on llama.cpp before anything loads)."""
    return LlamaCppEngine(args) if args.engine == "llama.cpp" else TorchEngine(args)


def refuse_engine_options(args, options: dict, why: str) -> None:
    """Refuse, in one line, the options in `options` (name -> default) given a value other than their default."""
    given = [k for k, default in options.items() if getattr(args, k, default) != default]
    if given:
        flags = ", ".join("--" + k.replace("_", "-") for k in given)
        raise EpiKVError(f"{flags}: {why}")


class TorchEngine:
    name = "torch"

    def __init__(self, args) -> None:
        from .common import load

        refuse_engine_options(args, {"flash_attn": "auto"}, "an option of --engine llama.cpp; the torch engine's "
                                                           "attention kernel is --attn")

        if getattr(args, "threads", None):
            import torch

            torch.set_num_threads(args.threads)
        self.args = args
        self.lm = load(args)
        self.tokenizer = self.lm.tokenizer

    def layer_choice(self, policy):
        from ..engine import layer_choice

        return layer_choice(self.lm.model, policy)

    def generate(self, prompt, **kw):
        from ..engine import generate

        return generate(self.lm.model, self.lm.tokenizer, prompt, prefill_chunk=getattr(self.args, "prefill_chunk", None),
                        **kw)


class LlamaCppEngine:
    name = "llama.cpp"

    @staticmethod
    def refuse_torch_options(args) -> None:
        refuse_engine_options(args, _TORCH_ONLY, "torch engine options; --engine llama.cpp runs on the CPU with the "
                                                  "GGUF's own weights (threads: --threads)")

    def __init__(self, args) -> None:
        self.refuse_torch_options(args)
        import torch

        from ..llamacpp import load_gguf

        # the policy's tensors here are a few rows per token: one torch thread (more only hand work between threads
        # and take cores from llama.cpp's, which spin while they wait)
        torch.set_num_threads(1)
        self.args = args
        self.gm = load_gguf(args.model)
        self.tokenizer = self.gm.tokenizer

    def layer_choice(self, policy):
        from ..llamacpp import check_policy
        from ..policies.hidden import layer_note

        check_policy(policy, self.gm.depth)  # refused before any output
        if not hasattr(policy, "layers"):
            return None
        blocks = sorted(policy.observes(self.gm.depth).hidden_layers)
        return layer_note(policy.layers, self.gm.depth, blocks) if blocks else None

    def generate(self, prompt, **kw):
        from ..llamacpp import generate

        return generate(self.gm, prompt, threads=getattr(self.args, "threads", None),
                        flash_attn=FLASH_ATTN[getattr(self.args, "flash_attn", "auto")], **kw)
