"""Each policy's whole-trace retention through the llama.cpp engine beside the torch engine's rows on the same
traces (paired by trace), as a Markdown table: mean answer-NLL increase, top-1 agreement and answer KL, each
engine's against its own full cache.

    python benchmarks/llamacpp_retention_compare.py benchmarks/results/llamacpp/retention-seg \
        benchmarks/results/retention-full/tau128 --budget 1024
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def records(folder: Path, budget: int) -> dict[tuple[str, str], dict]:
    out = {}
    for line in (folder / "results.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("kind") == "retention" and r["budget"] in (None, budget) and not r.get("settings"):
            out[(r["policy"], r["trace_id"])] = r
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("llama")
    ap.add_argument("torch")
    ap.add_argument("--budget", type=int, default=1024)
    a = ap.parse_args()
    lc, tc = records(Path(a.llama), a.budget), records(Path(a.torch), a.budget)
    policies = list(dict.fromkeys(p for p, _ in lc))
    done = {t for p, t in lc if all((q, t) in lc for q in policies)}  # traces every policy finished
    print(f"{len(done)} traces with every policy finished through llama.cpp; torch rows on the same traces\n")
    print("| policy | answer-NLL increase, llama.cpp | torch | difference | top-1, llama.cpp | torch | answer KL, "
          "llama.cpp | torch |")
    print("|---|---|---|---|---|---|---|---|")
    means = {}
    for p in policies:
        pairs = [(lc[(p, t)], tc[(p, t)]) for t in sorted(done) if (p, t) in tc]
        if not pairs:
            continue
        m = defaultdict(float)
        for x, y in pairs:
            for k in ("answer_nll_increase", "answer_top1_agreement", "answer_kl"):
                m["l" + k] += x[k] / len(pairs)
                m["t" + k] += y[k] / len(pairs)
        means[p] = (m["lanswer_nll_increase"], m["tanswer_nll_increase"])
        print(f"| {p} ({len(pairs)}) | {m['lanswer_nll_increase']:+.4f} | {m['tanswer_nll_increase']:+.4f} | "
              f"{m['lanswer_nll_increase'] - m['tanswer_nll_increase']:+.4f} | {100 * m['lanswer_top1_agreement']:.1f} % | "
              f"{100 * m['tanswer_top1_agreement']:.1f} % | {m['lanswer_kl']:.4f} | {m['tanswer_kl']:.4f} |")
    order_l = sorted(means, key=lambda p: means[p][0])
    order_t = sorted(means, key=lambda p: means[p][1])
    print(f"\norder by answer-NLL increase, llama.cpp: {', '.join(order_l)}; torch: {', '.join(order_t)}"
          f" ({'the same' if order_l == order_t else 'different'})")


if __name__ == "__main__":
    main()
