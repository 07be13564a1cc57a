"""Where in a whole reasoning trace each policy's cache comes from once the reasoning is fed.

Streams the prompt and reasoning (up to `</think>`) of a few shared traces through the embedded model under each
policy at one budget, exactly as `epikv retention` does (chunks of tau, the engine's Decoder), and prints the true
positions the cache holds at the end, counted per tenth of the trace, plus how many of them lie in the last quarter.
It explains the whole-trace retention results (`../retention-full/`): a score-based keep set is stationary, so the
flat EPIKV score spreads the cache evenly over the trace, while random eviction and the Seg family keep a recency-
biased sample. Usage (from the repository root; one line of JSON per (trace, policy) to stdout):

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 .venv/bin/python benchmarks/results/kept-positions/kept_positions.py \
        --budget 1024 --traces 3 > benchmarks/results/kept-positions/k1024.jsonl
"""

import argparse
import json

import torch

from epikv.data import data_dir
from epikv.engine import Decoder, attention_for
from epikv.models import load_model
from epikv.policies import get_policy
from epikv.retention.runner import load_traces, prepare_traces

POLICIES = [("epikv", 16), ("epikv-raw", 16), ("lag-kv", 16), ("random", 16), ("h2o", 16), ("streaming", 16),
            ("epikv", 128), ("epikv-seg", 128), ("epikv-seg-q", 128)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--traces", type=int, default=3, help="how many traces, spread over the length quantiles")
    args = ap.parse_args()
    torch.set_num_threads(1)
    lm = load_model("smollm2")
    items, _ = prepare_traces(load_traces(data_dir() / "reasoning_traces.jsonl"), lm.tokenizer)
    items.sort(key=lambda it: (len(it.reasoning_ids), it.id))
    picks = [items[round(i * (len(items) - 1) / max(1, args.traces - 1))] for i in range(args.traces)]
    for it in picks:
        ids = torch.tensor([it.prompt_ids + it.reasoning_ids])  # [1, N]
        p, n = len(it.prompt_ids), ids.shape[1]
        for name, tau in POLICIES:
            pol = get_policy(name, tau=tau)
            with torch.inference_mode(), attention_for(lm.model, pol):
                dec = Decoder(lm.model, pol, args.budget)
                dec.prefill(ids[:, :p], [0])
                for s in range(p, n, tau):
                    dec.step(ids[:, s : min(s + tau, n)])
                pos = dec.cache.token_data["pos"][0]  # true positions of the stored tokens
            tenths = torch.histc(pos.float(), bins=10, min=0, max=n).long().tolist()
            print(json.dumps({"trace_id": it.id, "tokens": n, "policy": name, "tau": tau, "budget": args.budget,
                              "stored": int(pos.numel()), "per_tenth": tenths,
                              "last_quarter": int((pos >= n - n // 4).sum())}), flush=True)


if __name__ == "__main__":
    main()
