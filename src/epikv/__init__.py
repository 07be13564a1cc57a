"""epikv: attention-free KV cache eviction for long reasoning traces (EPIKV, arXiv:2606.26472).

The public names are imported on first use (PEP 562), so that `import epikv` and the command line's quick commands
(`epikv policies`, `--help`) do not import torch and transformers."""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING

from .errors import EpiKVError

if TYPE_CHECKING:  # what the names are, for type checkers and the API reference
    from .cache import EpiKVCache
    from .engine import Decoder, GenerationResult, Sampling, generate
    from .models import load_model
    from .policies import REGISTRY, Policy, get_policy, policy_names, register_policy
    from .press import Press, press

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {"EpiKVCache": ".cache", "Decoder": ".engine", "GenerationResult": ".engine", "Sampling": ".engine",
            "generate": ".engine", "load_model": ".models", "REGISTRY": ".policies", "Policy": ".policies",
            "get_policy": ".policies", "policy_names": ".policies", "register_policy": ".policies",
            "Press": ".press", "press": ".press"}

__all__ = ["Decoder", "EpiKVCache", "EpiKVError", "GenerationResult", "Policy", "Press", "REGISTRY", "Sampling",
           "generate", "get_policy", "load_model", "policy_names", "press", "register_policy"]


def __getattr__(name: str):
    where = _EXPORTS.get(name)
    if where is None:
        raise AttributeError(f"module 'epikv' has no attribute {name!r}")
    value = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    def __setattr__(self, name: str, value) -> None:
        # importing the submodule epikv.press binds the package's `press` to that module; the public name is the
        # function, so the binding is skipped (the function is bound on first use, as every other name)
        if isinstance(value, types.ModuleType) and _EXPORTS.get(name) == "." + name:
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
