"""Retention benchmark: what a policy's compressed cache loses on a real reasoning trace, measured on a CPU.

Stream prompt + reasoning (+ answer) through the model in chunks of tau tokens, evicting as the policy says, and
compare every next-token distribution with the full cache's (EVALUATION.md section 2).
"""

from .metrics import Reference
from .runner import TraceItem, load_traces, prepare_traces, reference_pass, policy_pass, run_retention

__all__ = ["Reference", "TraceItem", "load_traces", "prepare_traces", "reference_pass", "policy_pass",
           "run_retention"]
