from __future__ import annotations

import functools
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from .._lazy import torch

from ..errors import EpiKVError
from .base import Observes, Policy
from .view import HiddenStack

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
    layers, kv_heads, hidden, target, texts, tokens, ridge, ...), strings.

    decay_weight / decay_bias (optional, TRIM-KV's retention rate, epikv-learned-decay): a second linear map of the
    same standardised features to each layer and KV head's log retention rate per step of age, log beta[l, g](t)
    = min(0, x . decay_weight[l, g] + decay_bias[l, g]) (calibrate.decay_targets). Files written before it have
    none (has_decay False) and load as before."""

    weight: torch.Tensor  # [layers, kv_heads, hidden]
    bias: torch.Tensor  # [layers, kv_heads]
    mean: torch.Tensor  # [layers, hidden]
    std: torch.Tensor  # [layers, hidden]
    meta: dict
    decay_weight: torch.Tensor | None = None  # [layers, kv_heads, hidden]
    decay_bias: torch.Tensor | None = None  # [layers, kv_heads]

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.weight.shape)

    @property
    def has_decay(self) -> bool:
        return self.decay_weight is not None

    def describe(self) -> str:
        l, g, d = self.shape
        return f"{self.meta.get('model', '?')} ({l} layers, {g} KV heads, hidden {d})"

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"weight": self.weight, "bias": self.bias, "mean": self.mean, "std": self.std}
        if self.has_decay:
            out.update(decay_weight=self.decay_weight, decay_bias=self.decay_bias)
        return {k: v.float().contiguous() for k, v in out.items()}

    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        meta = {k: str(v) for k, v in self.meta.items()}
        meta.update(format=FORMAT, layers=str(self.shape[0]), kv_heads=str(self.shape[1]), hidden=str(self.shape[2]))
        save_file(self.tensors(), str(path), metadata=meta)


SCORE_TENSORS = {"weight", "bias", "mean", "std"}
DECAY_TENSORS = {"decay_weight", "decay_bias"}


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
    if meta.get("format") != FORMAT or set(t) not in (SCORE_TENSORS, SCORE_TENSORS | DECAY_TENSORS):
        raise EpiKVError(f"learned weights {path!r} are not an {FORMAT} file (format {meta.get('format')!r})")
    w = t["weight"]
    l, g, d = w.shape
    if (t["bias"].shape != (l, g) or t["mean"].shape != (l, d) or t["std"].shape != (l, d)
            or meta.get("layers") != str(l) or meta.get("kv_heads") != str(g) or meta.get("hidden") != str(d)
            or ("decay_weight" in t and (t["decay_weight"].shape != (l, g, d) or t["decay_bias"].shape != (l, g)))):
        raise EpiKVError(f"learned weights {path!r}: tensor shapes disagree with the header")
    return LearnedWeights(w, t["bias"], t["mean"], t["std"], meta, t.get("decay_weight"), t.get("decay_bias"))


CACHE_ENV = "EPIKV_WEIGHTS_DIR"


def cache_dir() -> Path:
    """The user's weights folder, where `epikv calibrate` writes by default and the engines look after the shipped
    folder: $EPIKV_WEIGHTS_DIR, else ~/.cache/epikv/weights."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "epikv" / "weights"


def shipped_weights() -> list[Path]:
    return sorted(SHIPPED.glob("*.safetensors"))


def cached_weights() -> list[Path]:
    """The cache folder's weights files, newest first (a model calibrated again gets its latest fit)."""
    d = cache_dir()
    if not d.is_dir():
        return []
    files = [p for p in d.glob("*.safetensors") if p.is_file()]
    return sorted(files, key=lambda p: (-p.stat().st_mtime_ns, p.name))


def accepted_fingerprints(lw: LearnedWeights) -> list[str]:
    """The fingerprints of the models a weights file fits: the one it was fitted on ('fingerprint') and those
    recorded as the same model in another engine's form ('also_fits', one a line: e.g. its GGUF conversion, whose
    stored bytes give another checksum: llamacpp/gguf_file.py)."""
    out = [lw.meta["fingerprint"]] if lw.meta.get("fingerprint") else []
    return out + [f for f in lw.meta.get("also_fits", "").splitlines() if f and f not in out]


def fitted_on(lw: LearnedWeights, fingerprint: str) -> bool:
    """Whether the weights fit the model of this fingerprint: one they record, checksum included (a model of the
    same architecture and shapes with other weights does not)."""
    return fingerprint in accepted_fingerprints(lw)


def _shape_of(fingerprint: str) -> dict:
    try:
        return json.loads(fingerprint.rsplit("|", 1)[0])
    except (ValueError, IndexError):
        return {}


def add_fingerprints(path: str | Path, fingerprints: list[str]) -> list[str]:
    """Record in a weights file that it also fits these models (another engine's form of the model it was fitted
    on). Only the safetensors header's metadata is rewritten (atomically): the tensors stay byte-identical. A
    fingerprint of another shape than the weights' is refused in one line. Returns the fingerprints added."""
    p = Path(path)
    lw = load_weights(p)
    l, g, d = lw.shape
    for f in fingerprints:
        sig = _shape_of(f)
        if (sig.get("layers"), sig.get("kv_heads"), sig.get("hidden")) != (l, g, d):
            raise EpiKVError(f"learned weights {str(p)!r} ({lw.describe()}) cannot fit a model of another shape "
                             f"({f.rsplit('|', 1)[0]})")
    have = accepted_fingerprints(lw)
    new = [f for f in dict.fromkeys(fingerprints) if f not in have]
    if not new:
        return []

    def edit(header: dict) -> bytes:
        meta = header.setdefault("__metadata__", {})
        meta["also_fits"] = "\n".join([f for f in meta.get("also_fits", "").splitlines() if f] + new)
        return b""

    _rewrite(p, edit)
    return new


def _rewrite(p: Path, edit) -> None:
    """Rewrite a safetensors file's header in place (atomically): edit(header) changes the parsed header and
    returns bytes to append after the tensor data (for tensors it added to the header, with offsets past the old
    data). The old tensor bytes are copied as they are, at their old offsets."""
    raw = p.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    extra = edit(header)
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)  # safetensors pads its header with spaces to 8 bytes
    tmp = p.with_name(f"{p.name}.tmp{os.getpid()}")
    try:
        tmp.write_bytes(struct.pack("<Q", len(hb)) + hb + raw[8 + n:] + extra)
        os.replace(tmp, p)
    finally:
        tmp.unlink(missing_ok=True)


def graft_decay(path: str | Path, source: str | Path) -> LearnedWeights:
    """Add the decay map of `source` (a weights file `epikv calibrate` fitted on the same model: the same shape and
    a fingerprint in common) to the weights file `path`, whose tensors stay byte-identical at their offsets and
    whose header keeps every field (fingerprint, also_fits, ...), gaining source's decay_* fields. The map is
    re-expressed exactly in path's standardisation (its mean and std; source's may differ in the last bits when
    the model ran on another thread count): w' = w std / std_s, b' = b + ((mean - mean_s) / std_s) . w, in float64.
    How the shipped SmolLM2 file got its map without refitting its score (benchmarks/results/learned/README.md).
    Returns path's weights as now loaded."""
    p = Path(path)
    dst, src = load_weights(p), load_weights(source)
    if not src.has_decay:
        raise EpiKVError(f"learned weights {str(source)!r} carry no decay map (fit one with `epikv calibrate`)")
    if dst.has_decay:
        raise EpiKVError(f"learned weights {str(p)!r} carry a decay map already")
    if src.shape != dst.shape or (accepted_fingerprints(dst) and not set(accepted_fingerprints(src))
                                  & set(accepted_fingerprints(dst))):
        raise EpiKVError(f"learned weights {str(source)!r} ({src.describe()}) were fitted on another model than "
                         f"{str(p)!r} ({dst.describe()})")
    ws, bs = src.decay_weight.double(), src.decay_bias.double()
    scale = (dst.std.double() / src.std.double())[:, None, :]  # [L, 1, D]
    w = (ws * scale).float().contiguous()
    b = (bs + torch.einsum("ld,lgd->lg", (dst.mean.double() - src.mean.double()) / src.std.double(), ws)).float()
    b = b.contiguous()

    def edit(header: dict) -> bytes:
        end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
        extra = b""
        for name, t in (("decay_bias", b), ("decay_weight", w)):
            data = t.numpy().tobytes()
            header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [end + len(extra),
                                                                                     end + len(extra) + len(data)]}
            extra += data
        header.setdefault("__metadata__", {}).update({k: v for k, v in src.meta.items() if k.startswith("decay_")})
        return extra

    _rewrite(p, edit)
    return load_weights(p)


def _known(fingerprint: str | None) -> bool:
    return bool(fingerprint) and not fingerprint.endswith("|unknown")  # unknown: offloaded, shape check only


def find_weights(path: str | None, n_layers: int, kv_heads: int | None = None, hidden: int | None = None,
                 fingerprint: str | None = None) -> LearnedWeights:
    """The weights file given (checked against the model's shape and, when known, its fingerprint), or else the
    file whose recorded fingerprints include the model's, from the shipped folder first, then the cache folder
    (cache_dir(), newest first); a file written before fingerprints (none recorded) of the model's shape after
    those. Without a fingerprint (an engine that does not take one) the first file of the model's shape. Nothing
    that fits is refused in one line."""
    if path is not None:
        lw = load_weights(path)
        check_shape(lw, n_layers, kv_heads, hidden)
        if _known(fingerprint):
            check_fingerprint(lw, fingerprint)
        return lw
    found = [load_weights(p) for p in shipped_weights()]
    for p in cached_weights():
        try:
            found.append(load_weights(p))
        except EpiKVError:  # a stray or half-written file in the user's folder is passed over, not fatal
            continue
    fits = [lw for lw in found if lw.shape[0] == n_layers and kv_heads in (None, lw.shape[1])
            and hidden in (None, lw.shape[2])]
    if not _known(fingerprint):
        if fits:
            return fits[0]
    else:
        for lw in fits:
            if fitted_on(lw, fingerprint):
                return lw
        for lw in fits:
            if not accepted_fingerprints(lw):
                return lw
        if fits:  # same shape, fitted on another model: say which (a fine-tune or another checkpoint)
            check_fingerprint(fits[0], fingerprint)
    have = "; ".join(lw.describe() for lw in found) or "none"
    mine = f"{n_layers} layers" + (f", fingerprint {fingerprint.rsplit('|', 1)[1]}" if _known(fingerprint) else "")
    raise EpiKVError(f"epikv-learned: no weights fit this model ({mine}) in the shipped folder or {cache_dir()} "
                     f"(found: {have}); fit them with `epikv calibrate --model MODEL` (it writes to that folder) or "
                     "name a file with --weights")


def check_shape(lw: LearnedWeights, n_layers: int, kv_heads: int | None, hidden: int | None) -> None:
    l, g, d = lw.shape
    if l != n_layers or kv_heads not in (None, g) or hidden not in (None, d):
        mine = f"{n_layers} layers" + (f", {kv_heads} KV heads" if kv_heads else "") + (
            f", hidden {hidden}" if hidden else "")
        raise EpiKVError(f"epikv-learned: the weights were fitted on {lw.describe()}, this model has {mine}: fit "
                         "weights for it with `epikv calibrate`")


def check_fingerprint(lw: LearnedWeights, fingerprint: str) -> None:
    """Refuse, in one line, weights fitted on another model: the fingerprints in their header (architecture, shapes
    and a checksum of some weights: epikv/fingerprint.py, llamacpp/gguf_file.py) against the model's. Weights
    written before fingerprints carry none and are checked by shape alone (check_shape)."""
    have = accepted_fingerprints(lw)
    if not have or not _known(fingerprint) or fitted_on(lw, fingerprint):
        return
    same_shape = any(h.rsplit("|", 1)[0] == fingerprint.rsplit("|", 1)[0] for h in have)
    why = ("the same architecture and shapes but other weights (a fine-tune or another checkpoint)" if same_shape
           else "another architecture or shape")
    theirs = ", ".join(h.rsplit("|", 1)[1] for h in have)
    raise EpiKVError(f"epikv-learned: the weights {lw.describe()} were fitted on another model: this one has {why} "
                     f"(fingerprint {fingerprint.rsplit('|', 1)[1]}, the weights' {theirs}); fit "
                     "weights for it with `epikv calibrate`")


def _maps(lw: LearnedWeights, decay: bool, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """The score map with the standardisation folded in, on `dev`: weight / std [layers, g, dim] and bias - weight .
    (mean / std) [layers, g, 1], so that score = h . weight' + bias' (equal to ((h - mean) / std) . weight + bias up
    to float rounding); with decay the score and decay maps side by side ([layers, 2g, ...]). Built once per
    weights object and device (the object is frozen), not at every scoring."""
    cache = lw.__dict__.setdefault("_maps", {})
    key = (decay, str(dev))
    if key not in cache:
        w, b = lw.weight, lw.bias  # [layers, g, dim], [layers, g]
        if decay:
            w, b = torch.cat([w, lw.decay_weight], 1), torch.cat([b, lw.decay_bias], 1)
        w = w.double() / lw.std.double()[:, None]  # in float64, then rounded once
        b = b.double() - torch.einsum("lgd,ld->lg", w, lw.mean.double())
        cache[key] = (w.float().to(dev).contiguous(), b.float().to(dev)[:, :, None].contiguous())
    return cache[key]


@functools.lru_cache(maxsize=None)
def _feature_blocks(n_layers: int) -> tuple[int, ...]:
    """feature_block of every layer, once per depth (a tuple: the cached value is shared by every caller)."""
    return tuple(feature_block(l) for l in range(n_layers))


def linear_scores(lw: LearnedWeights, hidden: dict[int, torch.Tensor], n_layers: int, decay: bool = False):
    """score [batch, layers, kv_heads, T] from the captured block outputs hidden[block] [batch, T, dim]; with decay
    (weights with a decay map) also each layer and KV head's log retention rate min(0, x . decay_weight + decay_bias),
    same shape, from the same standardised features in the same product: (score, log_beta). Every layer in one
    batched product, layer-major, the standardisation folded into the weights (_maps): llama.cpp scores each
    step's token, and a loop over layers, or an einsum that permutes its operands, cost more than a tenth of its
    decode."""
    g = lw.shape[1]
    dev = hidden[feature_block(0)].device
    # [batch, layers, T, dim]: the hidden state entering each layer (blocks on other devices come to the first's)
    blocks = _feature_blocks(n_layers)
    if isinstance(hidden, HiddenStack):  # llama.cpp's one capture buffer: one gather
        h = hidden.layers(blocks)
    else:
        h = torch.stack([hidden[b].to(dev) for b in blocks], dim=1)
    bsz, n, t, d = h.shape
    h = h.transpose(0, 1).reshape(n, bsz * t, d).float()  # [layers, batch * T, dim] (a view at batch 1)
    w, b = _maps(lw, decay, dev)  # [layers, (2) g, dim], [layers, (2) g, 1]
    res = torch.baddbmm(b, w, h.transpose(1, 2))  # [layers, (2) g, batch * T]
    res = res.view(n, -1, bsz, t).permute(2, 0, 1, 3)  # [batch, layers, (2) g, T]
    if not decay:
        return res
    return res[:, :, :g], res[:, :, g:].clamp(max=0.0)


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
    calibrate`; None = the file whose recorded fingerprint is the model's, from the shipped weights (SmolLM2-135M,
    its transformers form and its embedded GGUF) and the cache folder ($EPIKV_WEIGHTS_DIR, ~/.cache/epikv/weights).
    """

    tau: int = 16  # the interval every measurement of the family ran at (docs/choosing.md): the family ships at it
    weights: str | None = None

    name = "epikv-learned"
    paper = "arXiv:2601.07891 (KVzap), arXiv:2512.03324 (TRIM-KV)"
    granularity = "head"

    def observes(self, n_layers):
        return Observes(hidden_layers=tuple(sorted({feature_block(l) for l in range(n_layers)})))

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.weights is not None:
            load_weights(self.weights)  # a missing or foreign file is refused when the policy is made

    def init_state(self, batch, n_layers, device):
        checked = getattr(self, "_checked", None)  # the file check_model chose for this model
        lw = checked[1] if checked is not None and checked[0] == int(n_layers) else find_weights(self.weights,
                                                                                                 n_layers)
        return {"_lw": lw, "_n": n_layers}

    def check_model(self, fingerprint: str, n_layers: int) -> None:
        """Called by every engine before it runs the policy, with its model's fingerprint (epikv/fingerprint.py,
        llamacpp/gguf_file.py): choose the weights fitted on this model (or check the named file against it),
        refusing in one line weights fitted on another; init_state then uses the file chosen."""
        self._checked = (int(n_layers), find_weights(self.weights, n_layers, fingerprint=fingerprint))

    def raw_scores(self, state, obs, decay: bool = False):
        lw, n = state["_lw"], state["_n"]
        h0 = obs.hidden[feature_block(0)]
        check_shape(lw, n, obs.kv_heads or None, h0.shape[-1])
        return linear_scores(lw, obs.hidden, n, decay)  # [batch, layers, kv_heads, T] (and log_beta with decay)

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

