"""Where `epikv serve --engine llama.cpp`'s resident memory goes before its KV cache (issue 50: "what the 250 MB
are"): the process's RSS after each import the server makes, in the order it makes them, then after the GGUF
loads. Each stage runs in a fresh interpreter (so one stage's pages do not hide in another's), and prints
{stage: MiB}, the increment over the previous stage beside it.

  PYTHONPATH=src .venv/bin/python benchmarks/rss_breakdown.py --out benchmarks/results/serve/llama-server/fair/rss.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

# each stage adds its imports to those of every stage before it
STAGES = [
    ("python", ""),
    ("numpy", "import numpy"),
    ("torch", "import torch"),
    ("llama_cpp (ctypes library)", "from epikv.llamacpp import lib; lib.load()"),
    ("epikv.serving.llamacpp (policies, engine)", "import epikv.serving.llamacpp"),
    ("fastapi, uvicorn, the app", "import fastapi, uvicorn; import epikv.serving.app"),
    ("GGUF loaded (SmolLM2 Q4_1)", "from epikv.llamacpp import load_gguf; m = load_gguf('smollm2')"),
]
PROBE = "import re; print(int(re.search(r'VmRSS:\\s*(\\d+)', open('/proc/self/status').read()).group(1)))"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="write the figures here as JSON")
    args = p.parse_args(argv)
    out, prev = {}, 0.0
    for i, (name, _) in enumerate(STAGES):
        code = "\n".join(c for _, c in STAGES[: i + 1] if c)
        r = subprocess.run([sys.executable, "-c", f"{code}\n{PROBE}"], capture_output=True, text=True)
        if r.returncode != 0:
            print(f"rss_breakdown: stage {name!r} failed: {r.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
            return 2
        mib = int(r.stdout.split()[-1]) / 1024
        out[name] = round(mib, 1)
        print(f"{name:45s} {mib:7.1f} MiB  (+{mib - prev:.1f})")
        prev = mib
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rss_mib": out, "python": sys.version.split()[0]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
