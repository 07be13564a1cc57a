"""Model-free math shared by the policies: hidden-state deltas, causal rolling statistics, layer scaling.

Everything here is pure tensor code, vectorised over the batch, the layers in use and the tokens of a chunk, and
incremental: a chunk of T tokens gives exactly what T single-token calls would (the tests check it).
"""

from __future__ import annotations

from ._lazy import torch

from .errors import EpiKVError

# The paper's layers are given for a 32-block model (DeepSeek-R1-Distill-Llama-8B).
REFERENCE_DEPTH = 32


class Depth(int):
    """A model's count of decoder blocks that also carries its architecture signature (model_type, blocks, hidden
    size), so a policy's layer defaults can follow the authors' published per-model layers while policies stay
    model-free: the cache passes it wherever a policy takes `n_layers`. Arithmetic gives plain ints."""

    arch: tuple | None

    def __new__(cls, n_layers: int, arch: tuple | None = None) -> "Depth":
        obj = super().__new__(cls, n_layers)
        obj.arch = arch
        return obj


def model_depth(config, n_layers: int) -> Depth:
    """The Depth of a model from its transformers config (its text config for multimodal wrappers)."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    arch = (getattr(cfg, "model_type", None), n_layers, getattr(cfg, "hidden_size", None))
    return Depth(n_layers, arch)


# Layers A, B the authors published per model (their paper's Llama runs; every Qwen-7B grid script of their code,
# commit 121e62c); keyed by (model_type, decoder blocks, hidden size). Elsewhere A, B are scaled by depth.
PUBLISHED_PAIRS: dict[tuple, tuple[tuple[int, int], str]] = {
    ("llama", 32, 4096): ((10, 21), "the paper's layers for DeepSeek-R1-Distill-Llama-8B"),
    ("qwen2", 28, 3584): ((20, 24), "the authors' layers for DeepSeek-R1-Distill-Qwen-7B"),
}


def published_pair(n_layers: int) -> tuple[tuple[int, int], str] | None:
    """The authors' (A, B) for this model and where they come from, or None (then scale by depth)."""
    return PUBLISHED_PAIRS.get(getattr(n_layers, "arch", None))


def scale_layer(layer: int, n_layers: int) -> int:
    """Map a layer index of the 32-block reference model to a model with `n_layers` blocks."""
    return min(n_layers - 1, max(0, round(layer * n_layers / REFERENCE_DEPTH)))


def scale_band(lo: int, hi: int, n_layers: int) -> tuple[int, ...]:
    """The reference band lo..hi (inclusive) scaled to `n_layers` blocks."""
    a, b = scale_layer(lo, n_layers), scale_layer(hi, n_layers)
    return tuple(range(a, b + 1))


def check_layers(layers, n_layers: int, what: str = "layer") -> None:
    for layer in layers:
        if not isinstance(layer, int) or not 0 <= layer < n_layers:
            raise EpiKVError(f"{what} index {layer} is out of range: this model has decoder blocks 0..{n_layers - 1}")


class HiddenDelta:
    """g_l(t) = ||h_l(t) - h_l(t-1)||_2 per sequence and layer, across chunk boundaries.

    Keeps only the newest hidden state of each layer in use (the last prompt token's after prefill, so the first
    generated token is compared with it). Left padding: a token's g is valid only when it and its predecessor are
    real tokens.
    """

    def __init__(self) -> None:
        self.prev: torch.Tensor | None = None  # [batch, layers, dim]
        self.has_prev: torch.Tensor | None = None  # [batch] bool

    def update(self, hidden: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: [batch, layers, T, dim]; valid: [batch, T] bool (real tokens form a suffix of each row).

        Returns g [batch, layers, T] (float32) and g_valid [batch, T].
        """
        h = hidden.float()
        batch, n_lay, _, dim = h.shape
        if self.prev is None:
            self.prev = h.new_zeros(batch, n_lay, dim)
            self.has_prev = torch.zeros(batch, dtype=torch.bool, device=h.device)
        full = torch.cat([self.prev.unsqueeze(2), h], dim=2)  # [batch, layers, T + 1, dim]
        g = (full[:, :, 1:] - full[:, :, :-1]).norm(dim=-1)  # [batch, layers, T]
        prev_valid = torch.cat([self.has_prev.unsqueeze(1), valid[:, :-1]], dim=1)
        g_valid = valid & prev_valid
        last_valid = valid[:, -1]
        self.prev = torch.where(last_valid[:, None, None], h[:, :, -1], self.prev)
        self.has_prev = self.has_prev | last_valid
        return g, g_valid


class RollingStats:
    """Causal rolling mean / population std over the trailing window of `window` valid values, newest included.

    State is the last window-1 values per (sequence, channel): O(window) memory whatever the trace length.
    """

    def __init__(self, window: int, eps: float = 1e-6) -> None:
        if window < 1:
            raise EpiKVError(f"window must be at least 1, got {window}")
        self.window, self.eps = window, eps
        self.hist: torch.Tensor | None = None  # [batch, channels, window - 1], right-aligned
        self.hist_valid: torch.Tensor | None = None  # [batch, window - 1]

    def update(self, x: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [batch, channels, T]; valid: [batch, T]. Returns mean, std, count, each [batch, channels, T]."""
        batch, chans, _ = x.shape
        w1 = self.window - 1
        if self.hist is None:
            self.hist = x.new_zeros(batch, chans, w1)
            self.hist_valid = torch.zeros(batch, w1, dtype=torch.bool, device=x.device)
        xs = torch.cat([self.hist, x], dim=-1)  # [batch, channels, w1 + T]
        ms = torch.cat([self.hist_valid, valid], dim=-1)  # [batch, w1 + T]
        win = xs.unfold(-1, self.window, 1)  # [batch, channels, T, window]
        mwin = ms.unfold(-1, self.window, 1).unsqueeze(1).to(x.dtype)  # [batch, 1, T, window]
        count = mwin.sum(-1)
        denom = count.clamp(min=1)
        mean = (win * mwin).sum(-1) / denom
        var = (((win - mean.unsqueeze(-1)) * mwin) ** 2).sum(-1) / denom
        if w1 > 0:
            self.hist, self.hist_valid = xs[..., -w1:], ms[..., -w1:]
        return mean, var.sqrt(), count.expand_as(mean)

    def zscore(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """z = (x - mean) / (std + eps) over the trailing window; 0 while fewer than 2 values exist, 0 when invalid."""
        mean, std, count = self.update(x, valid)
        z = (x - mean) / (std + self.eps)
        return torch.where((count >= 2) & valid.unsqueeze(1), z, torch.zeros_like(z))


def lag_normalised_spread(x: torch.Tensor, lag: int) -> torch.Tensor:
    """EPIKV's Lag-KV signal: per-token std over channels after min-max normalising each chunk of `lag` tokens
    against the previous chunk (chunk 0 raw), averaged over heads.

    x: [batch, heads, n, dim] (keys or values already averaged over layers). Returns [batch, n].
    """
    batch, heads, n, dim = x.shape
    x = x.float()
    n_chunks = -(-n // lag)
    pad = n_chunks * lag - n
    xp = torch.nn.functional.pad(x, (0, 0, 0, pad))  # [batch, heads, n_chunks * lag, dim]
    chunks = xp.view(batch, heads, n_chunks, lag, dim)
    # Reference extrema per chunk over its real tokens (the padded tail of the last chunk is never a reference).
    lo = chunks.amin(dim=3)  # [batch, heads, n_chunks, dim]
    hi = chunks.amax(dim=3)
    out = chunks.clone()
    if n_chunks > 1:
        ref_lo, ref_hi = lo[:, :, :-1].unsqueeze(3), hi[:, :, :-1].unsqueeze(3)
        out[:, :, 1:] = (chunks[:, :, 1:] - ref_lo) / (ref_hi - ref_lo + 1e-9)
    spread = out.std(dim=-1)  # [batch, heads, n_chunks, lag], torch default (sample) std
    return spread.reshape(batch, heads, -1)[..., :n].mean(dim=1)
