"""Serve with eviction: EPIKV (and other page-granular policies) inside transformers' continuous batching.

    from epikv.serving import ServeSpec, start_manager, serving_stats, check_serving, run_batch

`start_manager(model, spec, generation_config)` returns a started transformers ContinuousBatchingManager whose
scheduler evicts whole pages of every request over its budget; use transformers' own manager API on it.
docs/SERVING.md says how it works and what is refused.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .checks import ServeSpec, ServingUnsupported, check_serving

if TYPE_CHECKING:
    from .scheduler import SCHEDULER_KEY, run_batch, scheduler_class, serving_stats, start_manager

_SCHEDULER = {"SCHEDULER_KEY", "run_batch", "scheduler_class", "serving_stats", "start_manager"}


def __getattr__(name: str):
    # the scheduler imports torch and transformers: loaded on first use, so `epikv serve --help` stays quick
    if name not in _SCHEDULER:
        raise AttributeError(f"module 'epikv.serving' has no attribute {name!r}")
    value = getattr(importlib.import_module(".scheduler", __name__), name)
    globals()[name] = value
    return value

__all__ = ["SCHEDULER_KEY", "ServeSpec", "ServingUnsupported", "check_serving", "run_batch", "scheduler_class",
           "serving_stats", "start_manager"]
