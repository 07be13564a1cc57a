"""Share of a decode step spent after the decoder stack (policy scoring + eviction), timed inside one process.

A ratio measured within the same steps is far less noisy than comparing two configurations' step times on a shared
CPU. Compares eviction by refilling holes (the default for hidden-state policies) with the ordered compaction
(`_refill` off), each for `epikv` and `streaming` at tau = 1 and 128.
Usage: HF_HUB_OFFLINE=1 python eviction_share.py [--budget 512] [--steps 384]"""

import argparse
import time

import torch

from epikv import load_model
from epikv.bench.speed import random_ids
from epikv.cache import EpiKVCache
from epikv.engine import Decoder


def run(lm, policy, tau, budget, steps, refill):
    ids = random_ids(lm.model, budget + 1, seed=0)
    spent = [0.0]
    orig = EpiKVCache._after_forward

    def timed(self):
        t0 = time.perf_counter()
        orig(self)
        spent[0] += time.perf_counter() - t0

    EpiKVCache._after_forward = timed
    try:
        with torch.inference_mode():
            dec = Decoder(lm.model, policy, budget=budget, tau=tau)
            dec.cache._refill = dec.cache._refill and refill
            dec.prefill(ids[:, :64], [0])
            for s in range(64, budget, 256):
                dec.step(ids[:, s : min(budget, s + 256)])
            nxt = ids[:, budget:]
            for _ in range(16):  # warm-up
                nxt = dec.step(nxt).argmax(-1, keepdim=True)
            spent[0] = 0.0
            t0 = time.perf_counter()
            for _ in range(steps):
                nxt = dec.step(nxt).argmax(-1, keepdim=True)
            total = time.perf_counter() - t0
    finally:
        EpiKVCache._after_forward = orig
    return spent[0] / total, total / steps, dec.cache.evictions


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--steps", type=int, default=384)
    a = ap.parse_args()
    torch.set_num_threads(1)
    lm = load_model("smollm2")
    print(f"K={a.budget}, {a.steps} steps: share of the step spent after the decoder stack (scoring + eviction)")
    for policy in ("epikv", "streaming"):
        for tau in (1, 128):
            for refill in (True, False):
                share, per, ev = run(lm, policy, tau, a.budget, a.steps, refill)
                how = "refill" if refill else "compact"
                print(f"  {policy:<10} tau={tau:<4} {how:<8} {100 * share:5.2f} % of {1e3 * per:6.1f} ms/step "
                      f"({ev} evictions)", flush=True)


if __name__ == "__main__":
    main()
