from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from .._lazy import torch

from ..errors import EpiKVError
from .base import Observes, Policy

FORMAT = "epikv-learned/1"
SHIPPED = Path(__file__).resolve().parent.parent / "weights"  # package data: fitted weights per model shape


def feature_block(layer: int) -> int:
    """The decoder block whose output is the hidden state entering `layer`'s attention (block l - 1's output is
    block l's input); layer 0 reads block 0's output, since the embedding output is not captured."""
    return max(layer - 1, 0)


@dataclass(frozen=True)
class LearnedWeights:
    """A fitted per-layer, per-KV-head linear score: score[l, g](t) = ((h(t) - mean[l]) / std[l]) . weight[l, g]
    + bias[l, g], h(t) the hidden state entering layer l (feature_block). meta: the fit's header (format, model,
    layers, kv_heads, hidden, target, texts, tokens, ridge, ...), strings."""

    weight: torch.Tensor  # [layers, kv_heads, hidden]
    bias: torch.Tensor  # [layers, kv_heads]
    mean: torch.Tensor  # [layers, hidden]
    std: torch.Tensor  # [layers, hidden]
    meta: dict

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.weight.shape)

    def describe(self) -> str:
        l, g, d = self.shape
        return f"{self.meta.get('model', '?')} ({l} layers, {g} KV heads, hidden {d})"

    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        meta = {k: str(v) for k, v in self.meta.items()}
        meta.update(format=FORMAT, layers=str(self.shape[0]), kv_heads=str(self.shape[1]), hidden=str(self.shape[2]))
        save_file({"weight": self.weight.float().contiguous(), "bias": self.bias.float().contiguous(),
                   "mean": self.mean.float().contiguous(), "std": self.std.float().contiguous()}, str(path),
                  metadata=meta)


def load_weights(path: str | Path) -> LearnedWeights:
    """Read a weights file written by `epikv calibrate` (safetensors with a header), refusing anything else in one
    line."""
    p = Path(path)
    if not p.is_file():
        raise EpiKVError(f"learned weights {str(p)!r}: no such file (write one with `epikv calibrate`)")
    return _load(str(p.resolve()), p.stat().st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _load(path: str, mtime: int) -> LearnedWeights:
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            meta = dict(f.metadata() or {})
            t = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # not a safetensors file
        raise EpiKVError(f"learned weights {path!r} are unreadable: {type(e).__name__}") from None
    if meta.get("format") != FORMAT or set(t) != {"weight", "bias", "mean", "std"}:
        raise EpiKVError(f"learned weights {path!r} are not an {FORMAT} file (format {meta.get('format')!r})")
    w = t["weight"]
    l, g, d = w.shape
    if (t["bias"].shape != (l, g) or t["mean"].shape != (l, d) or t["std"].shape != (l, d)
            or meta.get("layers") != str(l) or meta.get("kv_heads") != str(g) or meta.get("hidden") != str(d)):
        raise EpiKVError(f"learned weights {path!r}: tensor shapes disagree with the header")
    return LearnedWeights(w, t["bias"], t["mean"], t["std"], meta)


def shipped_weights() -> list[Path]:
    return sorted(SHIPPED.glob("*.safetensors"))


def find_weights(path: str | None, n_layers: int, kv_heads: int | None = None, hidden: int | None = None
                 ) -> LearnedWeights:
    """The weights file given, or the shipped one fitted for a model of this shape; a shape mismatch is refused in
    one line."""
    if path is not None:
        lw = load_weights(path)
        check_shape(lw, n_layers, kv_heads, hidden)
        return lw
    found = [load_weights(p) for p in shipped_weights()]
    for lw in found:
        if lw.shape[0] == n_layers and kv_heads in (None, lw.shape[1]) and hidden in (None, lw.shape[2]):
            return lw
    have = "; ".join(lw.describe() for lw in found) or "none"
    raise EpiKVError(f"epikv-learned: no shipped weights fit a model of {n_layers} layers (shipped: {have}); fit "
                     "weights for this model with `epikv calibrate` and pass them as weights=<file>")


def check_shape(lw: LearnedWeights, n_layers: int, kv_heads: int | None, hidden: int | None) -> None:
    l, g, d = lw.shape
    if l != n_layers or kv_heads not in (None, g) or hidden not in (None, d):
        mine = f"{n_layers} layers" + (f", {kv_heads} KV heads" if kv_heads else "") + (
            f", hidden {hidden}" if hidden else "")
        raise EpiKVError(f"epikv-learned: the weights were fitted on {lw.describe()}, this model has {mine}: fit "
                         "weights for it with `epikv calibrate`")


def check_fingerprint(lw: LearnedWeights, fingerprint: str) -> None:
    """Refuse, in one line, weights fitted on another model: the fingerprint in their header (architecture, shapes
    and a checksum of some weights: epikv/fingerprint.py) against the model's. Weights written before fingerprints
    carry none and are checked by shape alone (check_shape)."""
    have = lw.meta.get("fingerprint")
    if not have or have == fingerprint or fingerprint.endswith("|unknown"):  # unknown: offloaded, shape check only
        return
    same_shape = have.rsplit("|", 1)[0] == fingerprint.rsplit("|", 1)[0]
    why = ("the same architecture and shapes but other weights (a fine-tune or another checkpoint)" if same_shape
           else "another architecture or shape")
    raise EpiKVError(f"epikv-learned: the weights {lw.describe()} were fitted on another model: this one has {why} "
                     f"(fingerprint {fingerprint.rsplit('|', 1)[1]}, the weights' {have.rsplit('|', 1)[1]}); fit "
                     "weights for it with `epikv calibrate`")


def linear_scores(lw: LearnedWeights, hidden: dict[int, torch.Tensor], n_layers: int) -> torch.Tensor:
    """score [batch, layers, kv_heads, T] from the captured block outputs hidden[block] [batch, T, dim]."""
    out = []
    for l in range(n_layers):
        h = hidden[feature_block(l)].float()  # [batch, T, dim]
        dev = h.device
        x = (h - lw.mean[l].to(dev)) / lw.std[l].to(dev)
        out.append(torch.einsum("btd,gd->bgt", x, lw.weight[l].to(dev)) + lw.bias[l].to(dev)[None, :, None])
    home = out[0].device
    return torch.stack([o.to(home) for o in out], dim=1)  # [batch, layers, kv_heads, T]


@dataclass
class LearnedScore(Policy):
    """epikv-learned: a linear score of the hidden state entering each layer, one per KV head, fitted offline.

    KVzap (arXiv:2601.07891) and TRIM-KV (arXiv:2512.03324): a per-layer map from the hidden state entering attention
    to a per-KV-head importance, trained against an attention-based target from full-cache runs of the same model.
    Here the map is linear (Ridge, closed form), fitted by `epikv calibrate` (epikv/calibrate.py: KVzap's target, the
    log of the largest attention a token receives from later queries times the norm of its output-projected value,
    or the log of the mean attention it receives). Each token is scored once, on arrival, from block (l - 1)'s
    output for layer l (block 0's for layer 0); the score is frozen. Keeps the prompt, the newest min(128, K/4)
    tokens and the top-scoring rest per layer and KV head. Reads no attention. `weights`: a file from `epikv
    calibrate`; None = the shipped weights fitted for a model of this shape (SmolLM2-135M).
    """

    weights: str | None = None

    name = "epikv-learned"
    paper = "arXiv:2601.07891 (KVzap), arXiv:2512.03324 (TRIM-KV)"
    granularity = "head"

    def observes(self, n_layers):
        return Observes(hidden_layers=tuple(sorted({feature_block(l) for l in range(n_layers)})))

    def init_state(self, batch, n_layers, device):
        return {"_lw": find_weights(self.weights, n_layers), "_n": n_layers}

    def check_model(self, fingerprint: str, n_layers: int) -> None:
        """Called by an engine that can fingerprint its model (epikv/fingerprint.py): refuse weights fitted on
        another one."""
        check_fingerprint(find_weights(self.weights, n_layers), fingerprint)

    def raw_scores(self, state, obs) -> torch.Tensor:
        lw, n = state["_lw"], state["_n"]
        h0 = obs.hidden[feature_block(0)]
        check_shape(lw, n, obs.kv_heads or None, h0.shape[-1])
        return linear_scores(lw, obs.hidden, n)  # [batch, layers, kv_heads, T]

    def on_tokens(self, state, obs):
        return {"score": self.raw_scores(state, obs)}

    def scores(self, state, view):
        return view.token_data["score"]


@dataclass
class LearnedMean(LearnedScore):
    """epikv-learned-mean: epikv-learned reduced to one score per token (the mean over layers and KV heads of its
    per-head scores, all in the target's log scale), for engines whose cells are shared by every layer and head
    (llama.cpp, the paged server). Same weights, same arrival scoring; the default keep rule (and page rule)."""

    name = "epikv-learned-mean"
    granularity = "token"

    def on_tokens(self, state, obs):
        return {"score": self.raw_scores(state, obs).mean(dim=(1, 2))}  # [batch, T]

