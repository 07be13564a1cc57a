"""How long `epikv calibrate` takes through each engine (issue 57 item 2: minutes on a CPU for a small model, and how
the time scales with the text length and the number of texts).

    python benchmarks/calibrate_speed.py --out benchmarks/results/calibrate-speed/speed.json

Texts: GSM8K test problems and their solutions from ../shared/data (never the 28 traces), joined 8 at a time so
each is longer than the longest --max-tokens. Rows: (engine, max_tokens, texts), each a fresh `epikv calibrate`
process on the embedded SmolLM2 with one thread (torch's and llama.cpp's), its own output file (no resume), run in
interleaved rounds so a slow spell of this shared machine falls on every row alike. Each row's time is the report's
`seconds` (the fit loop: every text's forward, its targets and the Ridge sums; the model load excluded) and the wall
time of the process. The summary gives medians, seconds per text, and llama.cpp's time over torch's per setting.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GSM8K = ROOT.parent / "shared" / "data" / "gsm8k_test.jsonl"


def make_texts(path: Path, n: int) -> None:
    rows = [json.loads(l) for l in GSM8K.read_text(encoding="utf-8").splitlines() if l.strip()]
    with path.open("w", encoding="utf-8") as f:
        for i in range(n):
            group = rows[8 * i: 8 * i + 8]
            text = "\n\n".join(f"{r['problem']}\n{r.get('solution') or r.get('answer', '')}" for r in group)
            f.write(json.dumps({"id": f"gsm8k-group-{i}", "text": text}) + "\n")


def one(engine: str, max_tokens: int, texts: Path, n: int, tmp: Path) -> dict:
    out = tmp / f"{engine}-{max_tokens}-{n}-{time.monotonic_ns()}.safetensors"
    argv = [sys.executable, "-m", "epikv.cli", "calibrate", "--engine", engine, "--model", "smollm2", "--texts",
            str(texts), "--max-texts", str(n), "--max-tokens", str(max_tokens), "--threads", "1", "--out", str(out)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    p = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"calibrate_speed: {' '.join(argv[2:])} failed: {p.stderr.strip().splitlines()[-1:]}")
    rep = json.loads(p.stdout.strip().splitlines()[-1])
    return {"engine": engine, "max_tokens": max_tokens, "texts": n, "seconds": rep["seconds"], "wall_s": round(wall, 2),
            "tokens": rep["tokens"], "r2_mean": rep["r2_mean"]}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def summarise(runs: list[dict]) -> list[dict]:
    keys = sorted({(r["max_tokens"], r["texts"]) for r in runs})
    rows = []
    for mt, n in keys:
        med = {e: statistics.median(r["seconds"] for r in runs if (r["engine"], r["max_tokens"], r["texts"]) ==
                                    (e, mt, n)) for e in ("torch", "llama.cpp")}
        rows.append({"max_tokens": mt, "texts": n, "torch_s": round(med["torch"], 2),
                     "llama_cpp_s": round(med["llama.cpp"], 2), "torch_s_per_text": round(med["torch"] / n, 2),
                     "llama_cpp_s_per_text": round(med["llama.cpp"] / n, 2),
                     "llama_cpp_over_torch": round(med["llama.cpp"] / med["torch"], 3)})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", default="256,512")
    ap.add_argument("--texts", default="4,8")
    args = ap.parse_args(argv)
    if not GSM8K.is_file():
        raise SystemExit(f"calibrate_speed: {GSM8K} is missing (the shared data)")
    lengths = [int(x) for x in args.max_tokens.split(",")]
    counts = [int(x) for x in args.texts.split(",")]
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        texts = tmp / "texts.jsonl"
        make_texts(texts, max(counts))
        for rnd in range(args.rounds):
            for mt in lengths:
                for n in counts:
                    for engine in (("torch", "llama.cpp") if rnd % 2 == 0 else ("llama.cpp", "torch")):
                        r = one(engine, mt, texts, n, tmp)
                        runs.append({**r, "round": rnd})
                        print(json.dumps(runs[-1]), flush=True)
    res = {"command": "python benchmarks/calibrate_speed.py " + " ".join(argv or sys.argv[1:]),
           "cpu": cpu_model(), "cpus": os.cpu_count(), "runs": runs,
           "summary": summarise(runs)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n", encoding="utf-8")
    for row in res["summary"]:
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
