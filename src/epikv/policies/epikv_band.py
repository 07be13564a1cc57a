from __future__ import annotations

from dataclasses import dataclass

from .hidden import HiddenStatePolicy, default_bands


@dataclass
class EpiKVBand(HiddenStatePolicy):
    """Band-adaptive: g averaged over band A (blocks 7..13 of 32) and band B (18..25), each z-scored;
    score(t) = w_a * z_A(t) - z_B(t).

    Kolawole & Smith, arXiv:2606.26472. The authors used w_a = 1.29, tuned on test data; the default here is 1.0.
    """

    bands: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # (band A blocks, band B blocks)
    w_a: float = 1.0

    name = "epikv-band"
    paper = "arXiv:2606.26472"

    def channels(self, n_layers):
        a, b = self.bands if self.bands is not None else default_bands(n_layers)
        return [tuple(a), tuple(b)]

    def combine(self, g, stats, valid):
        z = stats.zscore(g, valid)
        return self.w_a * z[:, 0] - z[:, 1]
