"""Move superseded records out of an equal-bytes folder's results.jsonl into its superseded.jsonl (kept, committed).

    python benchmarks/equal_bytes_supersede.py --policy epikv-seg-q f16=227,694 q8_0=436,1398 q4_0=846,2679

Used once (2026-12-07): Seg-Q's first rows were measured while its arriving keys waited as float32 for up to the
recent window, a buffer that took it from K = 393 to K = 227 at 12 MiB on F16 cells; the engine now keeps them as
F16 and scores them every 16 tokens, and its rows were measured again at the K the plan now gives. The old records
are those of the policy at the old budgets (K); `equal_bytes.py` reads results.jsonl only. Run it with no worker
writing the folder (it rewrites results.jsonl under the folder's lock).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from epikv.store import folder_lock  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=str(ROOT / "benchmarks/results/equal-bytes"))
    ap.add_argument("--policy", required=True)
    ap.add_argument("folders", nargs="+", help="FOLDER=K,K,...: the superseded budgets in each folder")
    args = ap.parse_args(argv)
    for spec in args.folders:
        name, _, ks = spec.partition("=")
        budgets = {int(k) for k in ks.split(",") if k}
        folder = Path(args.root) / name
        with folder_lock(folder):
            lines = (folder / "results.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
            keep, gone = [], []
            for line in lines:
                r = json.loads(line)
                (gone if r.get("policy") == args.policy and r.get("budget") in budgets else keep).append(line)
            with (folder / "superseded.jsonl").open("a", encoding="utf-8") as f:
                f.writelines(gone)
            tmp = folder / "results.jsonl.tmp"
            tmp.write_text("".join(keep), encoding="utf-8")
            os.replace(tmp, folder / "results.jsonl")
        print(f"{name}: {len(gone)} records of {args.policy} at K in {sorted(budgets)} moved to superseded.jsonl, "
              f"{len(keep)} kept")
    return 0


if __name__ == "__main__":
    sys.exit(main())
