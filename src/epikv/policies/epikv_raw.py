from __future__ import annotations

from dataclasses import dataclass

from .hidden import HiddenStatePolicy, default_pair


@dataclass
class EpiKVRaw(HiddenStatePolicy):
    """HS-variance: score(t) = rollmean_W(g_A)(t) - rollmean_W(g_B)(t), no z-score (the ablation the z-score fixes).

    Kolawole & Smith, arXiv:2606.26472. Same layers and eviction rule as `epikv`.
    """

    layers: tuple[int, int] | None = None

    name = "epikv-raw"
    paper = "arXiv:2606.26472"

    def channels(self, n_layers):
        a, b = self.layers if self.layers is not None else default_pair(n_layers)
        return [(a,), (b,)]

    def combine(self, g, stats, valid):
        mean, _, _ = stats.update(g, valid)
        return mean[:, 0] - mean[:, 1]
