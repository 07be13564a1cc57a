"""R-KV's redundancy (`epikv.policies.rkv.redundancy`) against its first, out-of-place version (commit bf53fe1, copied
below), side by side in one process on the shapes of the whole-trace run: batch 4, 3 KV heads, head_dim 64, the
cache at K = 1024 and 2048 plus one 16-token chunk. Checks the outputs are bit-identical, prints the median of
5 calls each and the ratio. R-KV computes this for each of the 30 layers on every eviction (every 16 tokens at
tau 16). Usage (repository root):

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/results/rkv-redundancy/speed.py > benchmarks/results/rkv-redundancy/speed.txt
"""

import statistics
import time

import torch

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


def timed(f, *args) -> float:
    f(*args)
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        f(*args)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


torch.set_num_threads(1)
torch.manual_seed(0)
for n in (1040, 2064):
    k = torch.randn(4, 3, n, 64)
    k[:, :, 1::2] = k[:, :, ::2][:, :, : n // 2] + 0.3 * torch.randn(4, 3, n // 2, 64)  # similar pairs
    real = torch.ones(4, n, dtype=torch.bool)
    real[1, :100] = False  # one padded row
    assert torch.equal(redundancy(k, real, 0.5), redundancy_bf53fe1(k, real, 0.5))
    old, new = timed(redundancy_bf53fe1, k, real, 0.5), timed(redundancy, k, real, 0.5)
    print(f"n = {n}: bf53fe1 {old * 1e3:.0f} ms, now {new * 1e3:.0f} ms per layer, {old / new:.2f}x, bit-identical")
