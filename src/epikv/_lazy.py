"""A module imported on first attribute access, so that `epikv policies` and `epikv --help` print without importing
torch (seconds on a small machine). Used by the policies and signals, whose tensor code runs only when called."""

from __future__ import annotations

import importlib
import types


class LazyModule(types.ModuleType):
    """Stands for module `name` until an attribute is read; then imports it and takes its namespace, so later reads
    are plain attribute lookups (no per-call cost in the tensor code)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.__dict__["_lazy_target"] = name

    def __getattr__(self, attr: str):
        real = importlib.import_module(self.__dict__["_lazy_target"])
        self.__dict__.update({k: v for k, v in vars(real).items() if k not in ("__name__", "__spec__")})
        return getattr(real, attr)


torch = LazyModule("torch")
F = LazyModule("torch.nn.functional")
