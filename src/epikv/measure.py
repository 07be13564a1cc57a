"""Per-run memory figures (a process's high-water mark, ru_maxrss, cannot be reset, so later runs would inherit it).

- `kv_bytes_per_token(model)`: bytes one cached token takes over all layers (keys + values); times a run's peak
  stored tokens it is the run's KV-cache peak, exact and the same on every device.
- `RunPeak`: the peak memory of one run. CUDA: the allocator's peak after a reset (`cuda_max_allocated`). CPU: the
  process's resident memory sampled every few milliseconds during the run (`process_rss_sampled`: the run's own
  peak, model weights included; a spike shorter than the sampling period can be missed); None where /proc is absent.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

CUDA_KIND = "cuda_max_allocated"
CPU_KIND = "process_rss_sampled"


def kv_bytes_per_token(model) -> int:
    """Key + value bytes of one token in every layer, for one sequence."""
    cfg = model.config
    cfg = getattr(cfg, "text_config", None) or cfg
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    elem = next(model.parameters()).element_size()
    return 2 * cfg.num_hidden_layers * kv_heads * head_dim * elem


def _rss_bytes() -> int | None:
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class RunPeak:
    """with RunPeak(device) as m: ...   then m.bytes (int or None) and m.kind."""

    def __init__(self, device=None, period: float = 0.01):
        import torch

        self.cuda = device is not None and torch.device(device).type == "cuda"
        self.device, self.period = device, period
        self.bytes: int | None = None
        self.kind = CUDA_KIND if self.cuda else CPU_KIND
        self._stop = threading.Event()
        self._thread = None

    def __enter__(self):
        if self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats(self.device)
            return self
        self.bytes = _rss_bytes()
        if self.bytes is not None:
            self._thread = threading.Thread(target=self._sample, name="rss-sampler", daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.period):
            now = _rss_bytes()
            if now is not None and now > self.bytes:
                self.bytes = now

    def __exit__(self, *exc):
        if self.cuda:
            import torch

            self.bytes = int(torch.cuda.max_memory_allocated(self.device))
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            now = _rss_bytes()
            if now is not None:
                self.bytes = max(self.bytes, now)
