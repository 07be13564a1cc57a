"""`epikv calibrate`: fit epikv-learned's per-layer, per-KV-head linear score (policies/learned.py) on a model's own
full-cache eager runs. Part of the transformers engine (it runs the model); the targets and the Ridge fit are pure
tensor functions below.

For each text (at most `max_tokens` tokens) one eager forward gives, per layer l: the hidden state entering it
(feature_block(l)'s output, [T, dim]), the attention weights A [heads, T, T] and the values V [kv_heads, T, hd].
Targets, per KV head g (the query heads sharing it, GQA) and token i, over the later queries j > i:

- "kvzap" (KVzap, arXiv:2601.07891): log max_{j > i, q in g} A[q, j, i] * ||W_o[:, q] V[g, i]||, W_o[:, q] the
  output projection's columns of query head q: how much token i's value ever moves a later token's output.
- "mean": log mean_{j > i, q in g} A[q, j, i], the attention the token receives from the future on average.

Tokens without a later query (the last) and the first token (the attention sink, kept by every policy with the
prompt) are left out.

Beside the score, one pass also fits the decay map of epikv-learned-decay (TRIM-KV, arXiv:2512.03324: a token's
importance decays as its own retention rate beta_i raised to its age): per layer l and KV head g, a linear map of the
same features to log beta_i <= 0, the rate per step of age. Target (decay_targets): for each token the least-squares
slope of log(attention it receives at lag d) against d, over its later queries at lags d = 1 .. `horizon` (default
256), clipped to <= 0; the attention at lag d is the mean over g's query heads of A[q, i + d, i], times the i + d + 1
keys that query sees (attention relative to uniform, so the 1 / (j + 1) every key's share falls by as the context
grows, common to all tokens at one query, is not taken for a decay), floored at 1e-6 of uniform. Only tokens with
at least MIN_LAGS later queries enter it. Then Ridge of that slope on the features, as for the score. Per layer and
KV head rather than pooled over layers: the score is per layer and KV head, and the policy averages both in the log
scale, so its priority is the mean over layers and heads of each head's own decayed log score; and the layers do
not share one rate (on a SmolLM2 text the median slope is -0.004 per step in layer 0 and -0.016 in layer 10), so a
pooled map would fit one slope to targets that differ by layer. The decay rows are a subset of the score's; the
map is stored in the score's standardisation (fit_decay), so one set of standardised features feeds both.

Both fits are Ridge on standardised features, closed form in float64 from running sums (so a run is resumable: the
sums of the whole texts done, and their ids, are saved to `<out>.partial.pt` every `save_every` seconds and on
interrupt, atomically, and a rerun continues to the same sums an uninterrupted run reaches; both score targets and
the decay map are summed in one pass, so a second target costs no second run). The checkpoint holds tensors, strings and
numbers only and is read with `torch.load(weights_only=True)`, then checked, before any of it is used.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .errors import EpiKVError
from .fingerprint import model_fingerprint, model_signature
from .interrupts import interrupts_held
from .policies.learned import LearnedWeights, feature_block

TARGETS = ("kvzap", "mean")
DECAY = "decay"  # the decay map's target in its RidgeSums
HORIZON = 256  # later queries a token's decay is fitted over (lags 1 .. HORIZON)
MIN_LAGS = 16  # a token with fewer later queries gives no decay target: its slope would be noise
REL_FLOOR = 1e-6  # attention relative to uniform floored here before the log: an ignored token is not -inf


def attention_targets(attn: torch.Tensor, values: torch.Tensor, o_weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """Both targets of one layer. attn: [heads, T, T] softmax weights (query j, key i); values: [kv_heads, T, hd];
    o_weight: [hidden, heads * hd] (o_proj.weight). Returns name -> [kv_heads, T - 1] for tokens 0 .. T-2 (those
    with a later query); callers drop token 0 themselves."""
    h, t, _ = attn.shape
    g, _, hd = values.shape
    a = attn.float()
    future = torch.ones(t, t, dtype=torch.bool, device=a.device).tril(-1)  # [j, i]: j > i
    a = a.masked_fill(~future, 0.0)  # [heads, j, i]
    wo = o_weight.float().view(o_weight.shape[0], h, hd)  # [hidden, heads, hd]
    v = values.float().repeat_interleave(h // g, dim=0)  # [heads, T, hd]: the KV head of each query head
    gram = torch.einsum("dqe,dqf->qef", wo, wo)  # [heads, hd, hd]: W_o[:, q]^T W_o[:, q]
    onorm = torch.einsum("qte,qef,qtf->qt", v, gram, v).clamp(min=0).sqrt()  # [heads, T]: ||W_o[:, q] v_i||
    amax = a.amax(dim=1)  # [heads, T]: max over later queries
    kv = (amax * onorm).view(g, h // g, t).amax(1)  # [kv_heads, T]
    n_future = torch.arange(t - 1, -1, -1, device=a.device).float()  # later queries of token i: T - 1 - i
    mean = (a.sum(dim=1).view(g, h // g, t).sum(1) / (h // g)) / n_future.clamp(min=1)  # [kv_heads, T]
    tiny = 1e-12
    return {"kvzap": kv[:, :-1].clamp(min=tiny).log(), "mean": mean[:, :-1].clamp(min=tiny).log()}


def lag_attention(attn: torch.Tensor, kv_heads: int, horizon: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention each token receives at each lag, relative to uniform, in log: (y [kv_heads, T, horizon],
    valid [T, horizon]), y[g, i, d - 1] = log max(REL_FLOOR, (i + d + 1) * mean_{q in g} A[q, i + d, i]) and valid
    where query i + d exists. attn: [heads, T, T] softmax weights (query j, key i)."""
    h, t, _ = attn.shape
    a = attn.float().view(kv_heads, h // kv_heads, t, t).mean(1)  # [g, j, i]
    rel = a * torch.arange(1, t + 1, dtype=a.dtype, device=a.device)[None, :, None]  # query j sees j + 1 keys
    lag = torch.arange(1, horizon + 1, device=a.device)
    j = torch.arange(t, device=a.device)[:, None] + lag[None, :]  # [i, d]: the query at lag d of token i
    valid = j < t
    by_lag = rel.transpose(1, 2).gather(2, j.clamp(max=t - 1).expand(kv_heads, t, horizon))  # [g, i, d]
    return by_lag.clamp(min=REL_FLOOR).log(), valid


def lag_slopes(y: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Least-squares slope of y against the lag d = 1 .. H over the valid lags: y [..., T, H], valid [T, H] ->
    [..., T] (0 where fewer than 2 lags are valid), in float64: cov(d, y) / var(d) over each token's lags."""
    d = torch.arange(1, y.shape[-1] + 1, dtype=torch.float64, device=y.device)
    m = valid.double()
    n, sd, sdd = m.sum(-1), (m * d).sum(-1), (m * d * d).sum(-1)
    ym = y.double() * m
    sy, sdy = ym.sum(-1), (ym * d).sum(-1)
    den = n * sdd - sd * sd  # n^2 var(d): 0 for fewer than 2 lags
    return torch.where(den > 0, (n * sdy - sd * sy) / den.clamp(min=1e-12), torch.zeros_like(sy))


def decay_targets(attn: torch.Tensor, kv_heads: int, horizon: int = HORIZON) -> tuple[torch.Tensor, torch.Tensor]:
    """The decay map's target of one layer: (log_beta [kv_heads, T], ok [T]): each token's slope of log relative
    attention received against lag (lag_slopes of lag_attention), clipped to <= 0 (a rate of at most 1: attention
    that grows with age is not a retention rate); ok where the token has at least MIN_LAGS later queries (those are
    the rows fitted; callers drop token 0 themselves)."""
    y, valid = lag_attention(attn, kv_heads, horizon)
    return lag_slopes(y, valid).clamp(max=0.0).float(), valid.sum(-1) >= MIN_LAGS


@dataclass
class RidgeSums:
    """Running sums for a Ridge fit of Y [N, outs] on X [N, dim], per layer (float64)."""

    n_layers: int
    dim: int
    outs: int
    targets: tuple[str, ...] = TARGETS
    n: torch.Tensor = field(init=False)
    sx: torch.Tensor = field(init=False)
    sxx: torch.Tensor = field(init=False)
    sy: dict = field(init=False)
    sxy: dict = field(init=False)
    syy: dict = field(init=False)

    def __post_init__(self):
        L, d, g = self.n_layers, self.dim, self.outs
        z = lambda *s: torch.zeros(*s, dtype=torch.float64)  # noqa: E731
        self.n, self.sx, self.sxx = z(L), z(L, d), z(L, d, d)
        self.sy = {k: z(L, g) for k in self.targets}
        self.sxy = {k: z(L, d, g) for k in self.targets}
        self.syy = {k: z(L, g) for k in self.targets}

    def add(self, layer: int, x: torch.Tensor, ys: dict[str, torch.Tensor]) -> None:
        """x: [N, dim]; ys: target -> [N, outs]."""
        x = x.float().cpu()  # one text's products in float32 (a few hundred rows), summed in float64
        self.n[layer] += x.shape[0]
        self.sx[layer] += x.sum(0).double()
        self.sxx[layer] += (x.T @ x).double()
        for k in self.targets:
            y = ys[k].float().cpu()
            self.sy[k][layer] += y.sum(0).double()
            self.sxy[k][layer] += (x.T @ y).double()
            self.syy[k][layer] += (y * y).sum(0).double()

    def state(self) -> dict:
        return {"n": self.n, "sx": self.sx, "sxx": self.sxx, "sy": self.sy, "sxy": self.sxy, "syy": self.syy}

    def load(self, st: dict) -> None:
        for k, v in st.items():
            setattr(self, k, v)

    def solve(self, target: str, ridge: float) -> tuple[torch.Tensor, ...]:
        """(weight [L, outs, dim], bias [L, outs], mean [L, dim], std [L, dim], r2 [L, outs]) of the Ridge fit on
        standardised features: w = (C_s + ridge I)^-1 c_s, C_s the features' correlation matrix, c_s their
        covariance with the target over their std; bias = the target's mean; r2 in-sample."""
        if float(self.n.min()) < 2:
            raise EpiKVError("calibrate: too few tokens to fit (give more or longer texts)")
        n = self.n[:, None]
        mu = self.sx / n  # [L, d]
        cov = self.sxx / n[..., None] - mu[:, :, None] * mu[:, None, :]  # [L, d, d]
        std = cov.diagonal(dim1=1, dim2=2).clamp(min=1e-12).sqrt()  # [L, d]
        cs = cov / (std[:, :, None] * std[:, None, :])
        ybar = self.sy[target] / n  # [L, g]
        cxy = self.sxy[target] / n[..., None] - mu[:, :, None] * ybar[:, None, :]  # [L, d, g]
        cxys = cxy / std[:, :, None]
        eye = torch.eye(self.dim, dtype=torch.float64)
        w = torch.linalg.solve(cs + ridge * eye, cxys)  # [L, d, g]
        var_y = (self.syy[target] / n - ybar**2).clamp(min=1e-12)
        resid = var_y - 2 * (w * cxys).sum(1) + torch.einsum("ldg,lde,leg->lg", w, cs, w)
        r2 = 1 - resid / var_y
        return w.transpose(1, 2).float(), ybar.float(), mu.float(), std.float(), r2.float()


def read_texts(path: str, text_field: str, exclude: str | None, limit: int | None) -> list[tuple[str, str]]:
    """(id, text) of a JSONL file's records, those whose problem or text near-duplicates one of `exclude`'s (a
    JSONL, e.g. the evaluation traces: NearDuplicates) left out, the first `limit` kept."""
    p = Path(path)
    if not p.is_file():
        raise EpiKVError(f"calibrate: texts file {path!r} does not exist")
    banned = NearDuplicates(rec[k] for rec in _jsonl(exclude) for k in ("problem", "prompt", "text", "trace",
                                                                         "solution", text_field)
                            if isinstance(rec.get(k), str)) if exclude else None
    out = []
    for i, rec in enumerate(_jsonl(path)):
        text = rec.get(text_field)
        if not isinstance(text, str) or not text.strip():
            raise EpiKVError(f"calibrate: record {i + 1} of {path} has no text in field {text_field!r}")
        if banned is not None and (banned.near(text) or banned.near(str(rec.get("problem", "")))):
            continue
        out.append((str(rec.get("id", i)), text))
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise EpiKVError(f"calibrate: no texts left in {path}")
    return out


# words per shingle: long enough that unrelated texts share none (measured: none of the 3,584 MATH-500 and GSM8K
# problems and solutions of 13 words or more shares one with the 28 traces), short enough to catch a copied sentence
SHINGLE = 13
NEAR_SHARE = 0.02  # a text with at least this share of its shingles among the excluded texts' is a near-duplicate


def words(s: str) -> list[str]:
    """The text's words, lower-cased, punctuation and spacing dropped (so a copy with other case, spaces or
    punctuation reads the same)."""
    return re.findall(r"\w+", s.lower())


class NearDuplicates:
    """The evaluation texts a calibration text must not repeat: their word SHINGLE-grams. `share(text)` is the share
    of the text's own shingles found among them (a text shorter than one shingle: 1 when its words equal a whole
    evaluation text's, else 0); `near(text)` whether that share reaches NEAR_SHARE: a copy with other case, spacing
    or punctuation, or a text sharing a long passage with one (a 19-word run in a 300-word text), not only an exact
    copy."""

    def __init__(self, texts) -> None:
        self.shingles: set[tuple[str, ...]] = set()
        self.whole: set[tuple[str, ...]] = set()
        for t in texts:
            w = words(t)
            self.whole.add(tuple(w))
            self.shingles.update(_shingles(w))

    def share(self, text: str) -> float:
        w = words(text)
        if len(w) < SHINGLE:
            return float(bool(w) and tuple(w) in self.whole)
        own = _shingles(w)
        return len(own & self.shingles) / len(own)

    def near(self, text: str) -> bool:
        return self.share(text) >= NEAR_SHARE


def _shingles(w: list[str]) -> set[tuple[str, ...]]:
    return {tuple(w[i:i + SHINGLE]) for i in range(len(w) - SHINGLE + 1)}


def _jsonl(path: str) -> list[dict]:
    out = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise EpiKVError(f"calibrate: cannot read {path}: {e.strerror}") from None
    for i, line in enumerate(lines):
        if line.strip():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                raise EpiKVError(f"calibrate: line {i + 1} of {path} is not JSON") from None
            if not isinstance(rec, dict):
                raise EpiKVError(f"calibrate: line {i + 1} of {path} is not a JSON object")
            out.append(rec)
    return out


@dataclass
class ModelRuns:
    """What calibrate needs of an engine: the model's signature (fingerprint.model_signature's keys) and fingerprint
    (the weights file's "fingerprint", which the engines look for), its tokenizer (text -> ids) and `layers(ids)`:
    per layer (features [T, dim], attention weights [heads, T, T], values [kv_heads, T, hd], W_o [hidden,
    heads * hd]) of one full-cache forward over ids [1, T] (torch_runs: transformers' eager attention;
    llamacpp/calibrate.gguf_runs: llama.cpp on a GGUF)."""

    signature: dict
    fingerprint: str
    tokenize: Callable[[str], list[int]]
    layers: Callable[[torch.Tensor], list[tuple]]
    close: Callable[[], None] = lambda: None  # frees what the runs hold (a llama.cpp context)


def torch_runs(model, tokenizer) -> ModelRuns:
    """calibrate's runs on a transformers model (eager attention: layer_run)."""
    from .cache import decoder_layers

    return ModelRuns(model_signature(model), model_fingerprint(model, decoder_layers(model)),
                     lambda text: tokenizer(text).input_ids, lambda ids: layer_run(model, ids))


def layer_run(model, ids: torch.Tensor):
    """One eager forward over ids [1, T]: per layer (features [T, dim], attention [heads, T, T], values
    [kv_heads, T, hd], o_proj weight). The only place that touches the model."""
    from .cache import decoder_layers

    layers = decoder_layers(model)
    attn = model.config._attn_implementation
    if attn != "eager":  # the weights exist only in eager attention; the model is handed back as it came
        model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            out = model(input_ids=ids.to(model.device), output_attentions=True, output_hidden_states=True,
                        use_cache=True)
    finally:
        if attn != "eager":
            model.set_attn_implementation(attn)
    if out.attentions is None or len(out.attentions) != len(layers) or any(a is None for a in out.attentions):
        raise EpiKVError("calibrate: the model returned no attention weights (it needs eager attention)")
    cache = out.get("cache")  # the output's name for the cache differs across transformers 5.x
    cache = out.get("past_key_values") if cache is None else cache
    res = []
    for l, layer in enumerate(layers):
        vals = cache.layers[l].values[0]  # [kv_heads, T, hd]
        res.append((out.hidden_states[feature_block(l) + 1][0], out.attentions[l][0], vals,
                    layer.self_attn.o_proj.weight.detach()))
    return res


def write_checkpoint(path: Path, state: dict) -> None:
    """Write a resume file atomically: a temporary file beside it, synced, then renamed over it (an interrupt or a
    crash leaves the previous checkpoint or the new one, never a torn file)."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _same_layout(got, want) -> bool:
    """Whether a loaded sums state has the keys, dtypes and shapes of a fresh one."""
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(_same_layout(got[k], want[k]) for k in want)
    return isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape


def load_checkpoint(path: Path, config: dict, sums: RidgeSums, decay: RidgeSums) -> tuple[list[str], int]:
    """Load a resume file into `sums` (the score's) and `decay` (the decay map's); returns (ids of the texts done,
    tokens summed). It is unpickled with weights_only=True (tensors, containers, strings and numbers: a crafted file
    runs no code) and checked whole before any of it is used; anything else is refused in one line."""
    refuse = f"calibrate: {path} is not a checkpoint of epikv calibrate"
    try:
        st = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise EpiKVError(f"{refuse} (it cannot be read with torch.load(weights_only=True): "
                         f"{type(e).__name__}): delete it to start over") from None
    if isinstance(st, dict) and set(st) == {"config", "sums", "done", "tokens"}:
        raise EpiKVError(f"calibrate: {path} was written by an epikv calibrate before the decay map (it lacks the "
                         "decay sums, which need the texts run again): delete it to start over")
    if not isinstance(st, dict) or set(st) != {"config", "sums", "decay", "done", "tokens"}:
        raise EpiKVError(f"{refuse} (not its dict of config, sums, decay, done, tokens): delete it to start over")
    if st["config"] != config:
        raise EpiKVError(f"calibrate: {path} is from another model, text set, max_tokens or horizon: delete it or "
                         "give the same settings")
    done, tokens = st["done"], st["tokens"]
    if (not _same_layout(st["sums"], sums.state()) or not _same_layout(st["decay"], decay.state())
            or not isinstance(done, list)
            or not all(isinstance(d, str) for d in done) or type(tokens) is not int or tokens < 0):
        raise EpiKVError(f"{refuse} (its sums, texts done or token count are not of this model's shape and "
                         "type): delete it to start over")
    sums.load(st["sums"])
    decay.load(st["decay"])
    return list(done), tokens


def default_out(model_name: str, model) -> Path:
    """Where `epikv calibrate` writes without --out: the weights cache folder (policies/learned.cache_dir), named
    after the model and its weights checksum, so a fine-tune gets its own file and a rerun resumes the same one.
    model: a transformers model or a ModelRuns."""
    from .cache import decoder_layers
    from .policies.learned import cache_dir

    base = re.sub(r"[^A-Za-z0-9._-]+", "-", model_name.rstrip("/").rsplit("/", 1)[-1]).strip("-.") or "model"
    fp = model.fingerprint if isinstance(model, ModelRuns) else model_fingerprint(model, decoder_layers(model))
    check = fp.rsplit("|", 1)[1].replace(":", "-")
    return cache_dir() / f"{base}-{check}.safetensors"


def calibrate(model, tokenizer, texts: list[tuple[str, str]], out: str, *, target: str = "kvzap",
              max_tokens: int = 512, ridge: float = 1e-3, model_name: str = "", save_every: float = 60.0,
              progress=None, also_fits: list[str] = (), horizon: int = HORIZON) -> tuple[LearnedWeights, dict]:
    """Fit and write the weights file `out` (the score and the decay map over `horizon` later queries); returns
    (weights, report). model: a transformers model (with its tokenizer) or a ModelRuns (tokenizer unused: a GGUF
    through llama.cpp). Resumes from `<out>.partial.pt`. also_fits: fingerprints of other forms of this model (its
    GGUF conversions: llamacpp/gguf_file.py) recorded as fitting too; each must have the model's architecture and
    shapes. When no token has MIN_LAGS later queries (texts too short) the file has no decay map, said in the
    report."""
    if target not in TARGETS:
        raise EpiKVError(f"calibrate: target must be one of {', '.join(TARGETS)}, got {target!r}")
    runs = model if isinstance(model, ModelRuns) else torch_runs(model, tokenizer)
    sig = runs.signature
    mine = json.dumps(sig, sort_keys=True)
    for f in also_fits:
        if f.rsplit("|", 1)[0] != mine:
            raise EpiKVError(f"calibrate: --also-for names a model of another architecture or shape "
                             f"({f.rsplit('|', 1)[0]}) than this one ({mine})")
    if horizon < MIN_LAGS:
        raise EpiKVError(f"calibrate: --horizon must be at least {MIN_LAGS} later queries, got {horizon}")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    partial = Path(str(out) + ".partial.pt")
    ids_all = [i for i, _ in texts]
    config = {"signature": sig, "max_tokens": max_tokens, "horizon": horizon, "texts": hashlib.sha256("\n".join(
        f"{i}\t{t}" for i, t in texts).encode()).hexdigest()}
    sums = RidgeSums(sig["layers"], sig["hidden"], sig["kv_heads"])
    decay = RidgeSums(sig["layers"], sig["hidden"], sig["kv_heads"], targets=(DECAY,))
    done: list[str] = []
    tokens = 0
    if partial.exists():
        done, tokens = load_checkpoint(partial, config, sums, decay)
    t0 = time.monotonic()
    last_save = t0

    def save():
        write_checkpoint(partial, {"config": config, "sums": sums.state(), "decay": decay.state(), "done": done,
                                   "tokens": tokens})

    if progress is not None:
        progress.skip(len(done))
    try:
        for tid, text in texts:
            if tid in set(done):
                continue
            ids = torch.tensor([runs.tokenize(text)[:max_tokens]], dtype=torch.long)  # [1, T]
            if ids.shape[1] < 3:
                done.append(tid)
                continue
            rows = []  # the text's features and targets of every layer, added to the sums only once all are read
            for x, attn, vals, wo in runs.layers(ids):
                ys = attention_targets(attn, vals, wo)
                lb, ok = decay_targets(attn, vals.shape[0], horizon)
                ok[0] = False  # the sink, as for the score
                rows.append((x[1:-1], {k: v[:, 1:].T for k, v in ys.items()}, x[ok], lb[:, ok].T))
            # a text counts whole or not at all: Ctrl-C here would leave some layers' sums with it and others
            # without, and a checkpoint of them would resume to another fit
            with interrupts_held():
                for l, (x, ys, xd, yd) in enumerate(rows):
                    sums.add(l, x, ys)
                    decay.add(l, xd, {DECAY: yd})
                tokens += ids.shape[1] - 2
                done.append(tid)
            if progress is not None:
                progress.update(1)
            if time.monotonic() - last_save >= save_every:
                save()
                last_save = time.monotonic()
    except BaseException:
        save()  # finished texts are never lost
        raise
    save()
    w, b, mu, sd, r2 = sums.solve(target, ridge)
    dw, db, dmeta, dreport = fit_decay(decay, mu, sd, ridge, horizon)
    meta = {"model": model_name or sig["model_type"], "signature": json.dumps(sig, sort_keys=True),
            "fingerprint": runs.fingerprint, "target": target,
            "texts": len([d for d in done if d in set(ids_all)]), "text_ids": ",".join(done), "tokens": tokens,
            "ridge": ridge, "max_tokens": max_tokens}
    if also_fits:
        meta["also_fits"] = "\n".join(dict.fromkeys(also_fits))
    lw = LearnedWeights(w, b, mu, sd, {**meta, **dmeta}, dw, db)
    lw.save(out)
    report = {"out": str(out), "target": target, "texts": meta["texts"], "tokens": tokens,
              "r2_mean": round(float(r2.mean()), 4), "r2_by_layer": [round(float(x), 3) for x in r2.mean(1)],
              **dreport, "seconds": round(time.monotonic() - t0, 1)}
    return lw, report


def fit_decay(decay: RidgeSums, mean: torch.Tensor, std: torch.Tensor, ridge: float, horizon: int):
    """The decay map from its sums, re-expressed in the score's standardisation (mean, std) so one set of
    standardised features feeds both maps: (decay_weight [L, G, D] or None, decay_bias [L, G] or None, header
    fields, report fields). Its rows (tokens with MIN_LAGS later queries) are a subset of the score's, with their
    own mean mu_d and std sd_d: w' = w sd^-1_d std, b' = b + ((mean - mu_d) / sd_d) . w, exact in float64."""
    n = int(decay.n.min())
    if n < 2:
        return None, None, {}, {"decay": f"not fitted: no token has {MIN_LAGS} later queries (longer texts)"}
    wd, bd, mud, sdd, r2 = decay.solve(DECAY, ridge)
    wd64 = wd.double()
    w = (wd64 * (std.double() / sdd.double())[:, None, :]).float()
    b = (bd.double() + torch.einsum("ld,lgd->lg", (mean.double() - mud.double()) / sdd.double(), wd64)).float()
    ybar = decay.sy[DECAY] / decay.n[:, None]  # [L, G] mean target slope (log beta per step)
    meta = {"decay_horizon": horizon, "decay_min_lags": MIN_LAGS, "decay_tokens": n,
            "decay_r2": round(float(r2.mean()), 4)}
    report = {"decay_tokens": n, "decay_r2_mean": round(float(r2.mean()), 4),
              "decay_r2_by_layer": [round(float(x), 3) for x in r2.mean(1)],
              "decay_log_beta_mean": round(float(ybar.mean()), 6)}
    return w, b, meta, report
