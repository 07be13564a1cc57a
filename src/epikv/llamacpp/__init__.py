"""EPIKV inside llama.cpp (`--engine llama.cpp`): GGUF models through llama-cpp-python's low-level API, the same
policies and keep rule as the torch engine, eviction by removing positions from llama.cpp's KV cache.

    from epikv.llamacpp import load_gguf, generate
    gm = load_gguf("smollm2")            # the embedded model's GGUF, or a path to any local .gguf
    res = generate(gm, "Why is the sky blue?", policy="epikv", budget=512, chat=True)

llama-cpp-python is optional (`bash scripts/install.sh --llamacpp` builds it once into a cached wheel); without it
every entry point here raises EpiKVError in one line and the rest of epikv works.
"""

from .engine import SUPPORTED, LlamaDecoder, check_policy, generate
from .lib import available, load
from .model import GGUFModel, GGUFTokenizer, load_gguf

__all__ = ["SUPPORTED", "GGUFModel", "GGUFTokenizer", "LlamaDecoder", "available", "check_policy", "generate",
           "load", "load_gguf"]
