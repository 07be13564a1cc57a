"""The engines a command can run on (`--engine torch | llama.cpp`), behind one small interface: the tokenizer, the
blocks a policy reads on the model, and generate(). Options only one engine reads are refused on the other."""

from __future__ import annotations

from ..errors import EpiKVError
from .common import positive_int

# options of add_model_args / generate that only the torch engine reads, with their defaults
_TORCH_ONLY = {"device": None, "device_map": None, "dtype": None, "attn": None, "prefill_chunk": None}
# options only the llama.cpp engine reads, with their defaults
_LLAMA_ONLY = {"flash_attn": "auto", "cache_type_k": "f16", "cache_type_v": "f16", "kv_memory": None}
# llama.cpp's cache type names, as epikv.llamacpp.kvtypes.CACHE_TYPES holds them (named here so that building the
# parser imports no engine; tests/test_llamacpp_quant.py checks the two agree)
CACHE_TYPE_NAMES = ("f16", "f32", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl")


THREADS_HELP = ("CPU threads: llama.cpp's (default half the cores available, as llama-cpp-python: its threads spin "
                "while they wait) or torch's (torch.set_num_threads; default torch's own, one per physical core)")
FLASH_ATTN = {"auto": None, "on": True, "off": False}  # --flash-attn as the llama.cpp engine takes it


def add_flash_attn_arg(g) -> None:
    g.add_argument("--flash-attn", choices=tuple(FLASH_ATTN), default="auto",
                   help="llama.cpp's flash attention (--engine llama.cpp; default auto: llama.cpp's choice, on for "
                        "the CPU). With it on and 2+ threads a long context's answer may depend on its batch-mates; "
                        "off (or --threads 1) makes it batch-invariant")


def cache_type(text: str) -> str:
    """An argparse type: one of llama.cpp's cache type names."""
    import argparse

    if text not in CACHE_TYPE_NAMES:
        raise argparse.ArgumentTypeError(f"unknown cache type {text!r}; llama.cpp's types: {', '.join(CACHE_TYPE_NAMES)}")
    return text


def kv_memory(text: str) -> int:
    """An argparse type: a byte size such as 48MiB."""
    import argparse

    from ..llamacpp.kvtypes import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def kv_memory_list(text: str) -> list[int]:
    """An argparse type: comma-separated byte sizes (24MiB,48MiB)."""
    return [kv_memory(x.strip()) for x in text.split(",") if x.strip()] or [kv_memory(text)]


def add_cache_type_args(g, memory: bool = True) -> None:
    """--cache-type-k / --cache-type-v (and --kv-memory where the command runs one policy at a chosen budget)."""
    names = ", ".join(CACHE_TYPE_NAMES)
    g.add_argument("--cache-type-k", type=cache_type, default="f16", metavar="TYPE",
                   help=f"llama.cpp's type for cached keys (--engine llama.cpp; default f16): {names}")
    g.add_argument("--cache-type-v", type=cache_type, default="f16", metavar="TYPE",
                   help="the same for cached values; a quantized V cache needs flash attention (switched on, and "
                        "said so, under --flash-attn auto; refused with --flash-attn off)")
    if memory:
        g.add_argument("--kv-memory", type=kv_memory, default=None, metavar="SIZE",
                       help="a sequence's KV memory (e.g. 48MiB; --engine llama.cpp): the largest --budget whose "
                            "peak (K + tau cells at the chosen types plus the policy's buffers) fits, printed; "
                            "instead of --budget")


def add_engine_args(p, threads_help: str | None = None, flash_attn: bool = False, cache_types: bool = False,
                    kv_memory: bool = False):
    """--engine and --threads, the same on every command that takes them (and --flash-attn, --cache-type-k /
    --cache-type-v and --kv-memory where the command passes them to llama.cpp)."""
    g = p.add_argument_group("engine")
    g.add_argument("--engine", choices=("torch", "llama.cpp"), default="torch",
                   help="torch (transformers, default) or llama.cpp (a GGUF: --model smollm2 or a local .gguf file; "
                        "runs on the CPU only)")
    g.add_argument("--threads", type=positive_int, default=None, help=threads_help or THREADS_HELP)
    if flash_attn:
        add_flash_attn_arg(g)
    if cache_types:
        add_cache_type_args(g, memory=kv_memory)
    return g


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

        refuse_engine_options(args, _LLAMA_ONLY, "options of --engine llama.cpp (the torch engine's attention "
                                                  "kernel is --attn, its cache's type --dtype)")

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
        # notes the command prints once the run passed its checks (the flash-attention switch, --kv-memory's pick)
        self.notes: list[str] = []
        self.type_k, self.type_v, self.flash_attn = cache_setup(self.gm, args, self.notes)

    def layer_choice(self, policy):
        from ..llamacpp.engine import check_model_policy
        from ..policies import for_model
        from ..policies.hidden import layer_note

        if policy.evicts:
            self.gm.check_evictable()  # a model that cannot evict: refused before any weights are looked for
        # refused before any output; the default (no policy named) falls back where no weights fit (one warning line)
        policy = for_model(policy, lambda p: check_model_policy(self.gm, p), tau=self.args.tau)
        if not hasattr(policy, "layers"):
            return None
        blocks = sorted(policy.observes(self.gm.depth).hidden_layers)
        return layer_note(policy.layers, self.gm.depth, blocks) if blocks else None

    def generate(self, prompt, **kw):
        from ..llamacpp import generate

        return generate(self.gm, prompt, threads=getattr(self.args, "threads", None), flash_attn=self.flash_attn,
                        type_k=self.type_k, type_v=self.type_v, **kw)

    def budget_for_memory(self, policy, tau=None, **settings) -> int | None:
        """--kv-memory: the largest budget whose planned peak fits (printed on stderr), None without it; refused
        beside an explicit --budget."""
        return memory_budget(self.gm, self.args, policy, tau, self.type_k, self.type_v, self.notes, **settings)


def cache_setup(gm, args, notes: list[str] | None = None) -> tuple[str, str, bool | None]:
    """(type_k, type_v, flash attention) of --cache-type-k / --cache-type-v / --flash-attn, refused in one line where
    llama.cpp would refuse them; the switch to flash attention a quantized V cache needs is appended to `notes`
    (printed on stderr at once without)."""
    from ..llamacpp.kvtypes import resolve_flash_attn

    k, v = getattr(args, "cache_type_k", "f16"), getattr(args, "cache_type_v", "f16")
    fa, note = resolve_flash_attn(gm, k, v, FLASH_ATTN[getattr(args, "flash_attn", "auto")])
    if note:
        _note(args, notes, note)
    return k, v, fa


def _note(args, notes: list[str] | None, text: str) -> None:
    import sys

    line = f"epikv {getattr(args, 'command', '')}: {text}"
    if notes is None:
        print(line, file=sys.stderr)
    else:
        notes.append(line)


def memory_budget(gm, args, policy, tau, type_k: str, type_v: str, notes: list[str] | None = None,
                  kv_memory: int | None = None, plan: dict | None = None, **settings) -> int | None:
    """The budget --kv-memory picks for `policy` (None without --kv-memory), said in one line (appended to `notes`,
    printed on stderr at once without)."""
    from ..llamacpp.kvtypes import budget_for_memory
    from ..policies import get_policy

    memory = kv_memory if kv_memory is not None else getattr(args, "kv_memory", None)
    if memory is None:
        return None
    if "budget" in (getattr(args, "given", None) or set()):
        raise EpiKVError("--kv-memory chooses the budget: give --kv-memory or --budget, not both")
    pol = get_policy(policy, tau=tau, **settings)
    if not pol.evicts:
        raise EpiKVError(f"--kv-memory sizes an evicting policy's budget; {pol.name} keeps every token")
    plan = budget_for_memory(gm, pol, memory, type_k, type_v, **(plan or {}))
    _note(args, notes, f"--kv-memory {memory} bytes with {type_k}/{type_v} cells: {pol.name} {plan.describe()}")
    return plan.budget
