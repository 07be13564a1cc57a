"""Serve with eviction: EPIKV (and other page-granular policies) inside transformers' continuous batching.

    from epikv.serving import ServeSpec, start_manager, serving_stats, check_serving, run_batch

`start_manager(model, spec, generation_config)` returns a started transformers ContinuousBatchingManager whose
scheduler evicts whole pages of every request over its budget; use transformers' own manager API on it.
docs/SERVING.md says how it works and what is refused.
"""

from .checks import ServeSpec, ServingUnsupported, check_serving
from .scheduler import SCHEDULER_KEY, run_batch, scheduler_class, serving_stats, start_manager

__all__ = ["SCHEDULER_KEY", "ServeSpec", "ServingUnsupported", "check_serving", "run_batch", "scheduler_class",
           "serving_stats", "start_manager"]
