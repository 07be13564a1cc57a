"""R-KV's redundancy (`epikv.policies.rkv.redundancy`) against its two earlier versions, side by side in one process,
on the shapes of the whole-trace run: batch 4, 3 KV heads, head_dim 64, the cache at K = 1024 and 2048 plus one
16-token chunk. R-KV computes this for each of the 30 layers on every eviction (every 16 tokens at tau 16).

- bf53fe1: the first version, the n x n cosine matrix built out of place;
- b8ad0c3: the same matrix edited in place (bit-identical to bf53fe1, checked here);
- now: no n x n matrix: column sums from the sum of the keys, newest similar column searched newest-first in blocks
  (equal up to float rounding: the largest difference of the output and the number of tokens whose rank among the
  kept K changes, i.e. that a bottom-16 eviction on redundancy alone would treat differently, are printed).

Keys: "real" = the embedded model's cached keys (layers 0, 15, 29) over the first n tokens of 4 shared traces;
"adversarial" = random keys whose similar partner is the adjacent token, so that almost no row finds a similar
column among the newest ones and the block search falls back to whole rows. Medians of 5 calls. Usage
(repository root):

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/results/rkv-redundancy/speed.py > benchmarks/results/rkv-redundancy/speed.txt
"""

import json
import statistics
import time
from pathlib import Path

import torch

from epikv.data import data_dir
from epikv.models import load_model
from epikv.policies.rkv import redundancy


def redundancy_bf53fe1(k, real, threshold):
    b, _, n, _ = k.shape
    k = k.float()
    kn = k / (k.norm(dim=-1, keepdim=True) + 1e-8)
    sim = kn @ kn.transpose(-1, -2)
    pair = real[:, None, :, None] & real[:, None, None, :]
    sim = sim.masked_fill(~pair | torch.eye(n, dtype=torch.bool, device=k.device), 0.0)
    first = (~real).sum(-1).clamp(max=n - 1)
    col = torch.arange(n, device=k.device)
    cand = torch.where(sim > threshold, col, first[:, None, None, None])
    sim = sim.scatter(-1, cand.amax(-1, keepdim=True), 0.0)
    red = sim.sum(-2) / real.sum(-1).clamp(min=1)[:, None, None]
    return red.masked_fill(~real[:, None, :], float("-inf")).softmax(-1)


def redundancy_b8ad0c3(k, real, threshold):
    b, _, n, _ = k.shape
    k = k.float()
    kn = k / (k.norm(dim=-1, keepdim=True) + 1e-8)
    sim = kn @ kn.transpose(-1, -2)
    if not bool(real.all()):
        sim.masked_fill_(~(real[:, None, :, None] & real[:, None, None, :]), 0.0)
    sim.diagonal(dim1=-2, dim2=-1).zero_()
    first = (~real).sum(-1).clamp(max=n - 1)[:, None, None]
    rev = (sim > threshold).view(torch.uint8).flip(-1)
    last = rev.argmax(-1, keepdim=True)
    found = rev.gather(-1, last).bool()
    newest = torch.where(found, torch.maximum((n - 1) - last, first[..., None]), first[..., None])
    sim.scatter_(-1, newest, 0.0)
    red = sim.sum(-2) / real.sum(-1).clamp(min=1)[:, None, None]
    return red.masked_fill(~real[:, None, :], float("-inf")).softmax(-1)


def timed(f, *args) -> float:
    f(*args)
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        f(*args)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def rank_changes(a, b, keep):
    """Tokens in the top `keep` by redundancy (the ones a bottom-16 eviction spares least) in one and not the other."""
    ta = a.topk(keep, -1).indices.sort(-1).values
    tb = b.topk(keep, -1).indices.sort(-1).values
    return sum(len(set(x.tolist()) ^ set(y.tolist())) for x, y in zip(ta.flatten(0, 1), tb.flatten(0, 1))) // 2


torch.set_num_threads(1)
torch.manual_seed(0)
lm = load_model("smollm2")
traces = [json.loads(line) for line in open(Path(data_dir()) / "reasoning_traces.jsonl")][:4]
ids = [lm.tokenizer(t["prompt"] + t["trace"], return_tensors="pt").input_ids[:, :2064] for t in traces]
with torch.no_grad():
    caches = [lm.model(x, use_cache=True).past_key_values for x in ids]
for n in (1040, 2064):
    cases = {}
    for layer in (0, 15, 29):
        cases[f"real, layer {layer}"] = torch.cat([c.layers[layer].keys[:, :, :n] for c in caches]).float()
    k = torch.randn(4, 3, n, 64)
    k[:, :, 1::2] = k[:, :, ::2][:, :, : n // 2] + 0.3 * torch.randn(4, 3, n // 2, 64)
    cases["adversarial"] = k
    for name, k in cases.items():
        real = torch.ones(4, n, dtype=torch.bool)
        real[1, :100] = False  # one padded row
        first, dense, now = (f(k, real, 0.5) for f in (redundancy_bf53fe1, redundancy_b8ad0c3, redundancy))
        assert torch.equal(first, dense)
        diff = float((now - dense).abs().max() / dense.abs().max())
        changes = rank_changes(now, dense, n - 16 - 100)
        t_first, t_dense, t_now = (timed(f, k, real, 0.5) for f in (redundancy_bf53fe1, redundancy_b8ad0c3, redundancy))
        print(f"n = {n}, {name}: bf53fe1 {t_first * 1e3:.0f} ms, b8ad0c3 {t_dense * 1e3:.0f} ms (bit-identical), "
              f"now {t_now * 1e3:.1f} ms per layer: {t_dense / t_now:.1f}x b8ad0c3; largest difference "
              f"{diff:.1e} of the largest value, {changes} rank changes in the top {n - 116} of 12 x {n}")
