from __future__ import annotations

from dataclasses import dataclass

from .hidden import HiddenStatePolicy, default_pair


@dataclass
class EpiKVBandA(HiddenStatePolicy):
    """Band A only: score(t) = z_A(t), A = block 10 of 32 (scaled).

    Kolawole & Smith, arXiv:2606.26472; in the authors' band ablation it beat A-B at K=1024 (70% vs 62%).
    """

    layers: tuple[int] | None = None  # (A,)

    name = "epikv-a"
    paper = "arXiv:2606.26472"

    def channels(self, n_layers):
        (a,) = self.layers if self.layers is not None else default_pair(n_layers)[:1]
        return [(a,)]

    def combine(self, g, stats, valid):
        return stats.zscore(g, valid)[:, 0]
