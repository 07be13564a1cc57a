"""Performance benchmarks: decode speed per policy (`speed`), the single-pass memory wall (`memory`), plots.

Everything is measured through `epikv.engine.Decoder`, on whatever device the model sits on; the CPU path reads
process peak memory in a child process per point, the CUDA path reads torch.cuda statistics.
"""

from .memory import run_memory
from .speed import SpeedConfig, run_budget

__all__ = ["SpeedConfig", "run_budget", "run_memory"]
