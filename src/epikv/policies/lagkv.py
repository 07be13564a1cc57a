from __future__ import annotations

from dataclasses import dataclass

from .._lazy import torch

from ..errors import EpiKVError
from .base import CacheView, Observes, Policy


def partition_scores(x: torch.Tensor, lag: int) -> torch.Tensor:
    """LagKV score of every token of the partitions that have a full next partition.

    x: [..., P * lag, dim] (P >= 2 partitions). Partition p is min-max normalised per channel against partition
    p + 1; score = std over channels, softmax over the partition. Returns [..., (P - 1) * lag].
    """
    *lead, m, d = x.shape
    parts = x.float().reshape(*lead, m // lag, lag, d)
    ref = parts[..., 1:, :, :]
    lo, hi = ref.amin(dim=-2, keepdim=True), ref.amax(dim=-2, keepdim=True)
    norm = (parts[..., :-1, :, :] - lo) / (hi - lo + 1e-9)
    return norm.std(dim=-1).softmax(dim=-1).reshape(*lead, -1)


@dataclass
class LagKV(Policy):
    """Original LagKV (Liang et al., arXiv:2504.04704), per layer and KV head; not EPIKV's `lag-kv` variant.

    After `n_sink` = 16 sink tokens the cache is cut into partitions of L tokens. Each partition with a full next
    partition is min-max normalised per channel against that NEXT partition; token score = softmax over the
    partition of the std over channels, on keys plus the same on values; the top `ratio` = 0.5 of each scored
    partition is kept first. The last partitions (no full successor) are always kept.
    Partition size: the paper's L = 1024 needs two full partitions, 2048 tokens past the sinks, so at K <= 1024 it
    would never score (it would be StreamingLLM). Hence `lag` = None (default) means L = min(1024, (K - n_sink) // 2):
    an eviction fires only once the cache holds at least K + tau tokens, so two full partitions always exist and
    every eviction ranks by score. An explicit `lag` (kvpress uses 128) is used as given, but refused with an error
    when 2 * lag > K + tau - n_sink (it could never score at that budget).
    Budget adaptation: the partition grid is laid over the current (compacted) cache at each eviction; when the
    budget needs more, the bottom halves go first, evenly across partitions, then the top halves; when even the
    unscored tail does not fit, its oldest tokens go first. Attention-free.
    """

    protect_prompt: bool = False
    n_sink: int = 16
    lag: int | None = None  # partition size L; None = min(1024, (K - n_sink) // 2)
    ratio: float = 0.5

    name = "lagkv"
    paper = "arXiv:2504.04704"
    granularity = "head"

    def __post_init__(self):
        super().__post_init__()
        bad_lag = self.lag is not None and (isinstance(self.lag, bool) or not isinstance(self.lag, int) or self.lag < 1)
        if bad_lag or not 0 < self.ratio <= 1:
            raise EpiKVError(f"lagkv: lag must be an integer >= 1 (or unset) and ratio in (0, 1], "
                             f"got {self.lag} and {self.ratio}")

    def partition_size(self, budget: int) -> int:
        """L at budget K: the explicit `lag`, or min(1024, (K - n_sink) // 2); refuses an L that can never score."""
        if self.lag is None:
            return max(1, min(1024, (budget - self.n_sink) // 2))
        if 2 * self.lag > budget + self.tau - self.n_sink:
            raise EpiKVError(f"lagkv: lag {self.lag} never scores at budget {budget} (two partitions of {self.lag} "
                             f"after {self.n_sink} sinks exceed K + tau = {budget + self.tau}); use lag <= "
                             f"{max(1, (budget + self.tau - self.n_sink) // 2)} or leave it unset")
        return self.lag

    def recent_window(self, budget):
        self.partition_size(budget)  # a lag that can never score is refused before any work
        return super().recent_window(budget)

    def observes(self, n_layers):
        return Observes(keys_values=True)

    def scores(self, state, view: CacheView):
        n, dev, lag = view.length, view.device, self.partition_size(view.budget)
        keys = torch.stack([k.to(dev) for k in view.keys], dim=1)  # [batch, layers, kv_heads, n, dim]
        vals = torch.stack([v.to(dev) for v in view.values], dim=1)
        idx = torch.arange(n, device=dev, dtype=torch.float32)
        pri = (3.0 + idx / n).expand(*keys.shape[:-1]).clone()  # unscored tail: kept, newest first
        for r in range(keys.shape[0]):
            start = int(view.n_pad[r] + view.n_protect[r])
            n_parts = (n - start) // lag
            if n_parts < 2:
                continue
            stop = start + n_parts * lag
            s = partition_scores(keys[r, ..., start:stop, :], lag) + partition_scores(vals[r, ..., start:stop, :], lag)
            s = s.reshape(*s.shape[:-1], n_parts - 1, lag)
            q = (s.argsort(-1).argsort(-1).float() + 1) / lag  # rank fraction in its partition, 1 = best
            q = torch.where(q > 1 - self.ratio, 1.0 + q, q)  # the top `ratio` of every partition first
            pri[r, ..., start : stop - lag] = q.reshape(*q.shape[:-2], -1)
        return pri
