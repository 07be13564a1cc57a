from __future__ import annotations

from dataclasses import dataclass

from .hidden import HiddenStatePolicy, default_pair


@dataclass
class EpiKVFlat(HiddenStatePolicy):
    """EpiKV-Flat, the headline method: score(t) = z_A(t) - z_B(t).

    Kolawole & Smith, "Epiphany-Aware KV Cache Eviction Without the Attention Matrix", arXiv:2606.26472.
    g_l(t) = ||h_l(t) - h_l(t-1)||_2, z-scored causally over the trailing `window` values and frozen when the token
    is generated. A = block 10 and B = block 21 of 32 (scaled with depth; override with `layers`). Keeps the prompt,
    the newest min(128, K/4) tokens and the top-scoring rest. Never reads attention weights.
    """

    layers: tuple[int, int] | None = None  # (A, B) decoder blocks; None = (10, 21) scaled to the model's depth

    name = "epikv"
    paper = "arXiv:2606.26472"

    def channels(self, n_layers):
        a, b = self.layers if self.layers is not None else default_pair(n_layers)
        return [(a,), (b,)]

    def combine(self, g, stats, valid):
        z = stats.zscore(g, valid)  # [batch, 2, T]
        return z[:, 0] - z[:, 1]
