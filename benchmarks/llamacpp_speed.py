"""Speed and memory of EPIKV inside llama.cpp (`epikv.llamacpp`) on the embedded GGUF, as ratios from one run.

    PYTHONPATH=src .venv/bin/python benchmarks/llamacpp_speed.py step --out benchmarks/results/llamacpp/step.json
    PYTHONPATH=src .venv/bin/python benchmarks/llamacpp_speed.py long --out benchmarks/results/llamacpp/long.json

step: decode tokens/s at batch 1, K = 512, --gen new tokens after the chat prompt, configurations taking turns in
  rounds of --round tokens in one process (each has its own context): plain llama.cpp (`full`: no eval callback,
  no eviction), epikv with the C capture, epikv with the Python capture, the C capture alone (epikv with a budget
  that never fills: the capture's cost without eviction), and epikv in the torch engine (float32, SDPA). The
  figure per configuration is its total decode time over its tokens; ratios are against plain llama.cpp.
long: tokens/s over each 1,000 tokens of a --gen-token generation (EOS ignored), epikv K = 512 against plain
  llama.cpp with the whole cache, each in its own child process (peak RSS of that process; KV bytes of its
  context), the two alternating segment by segment is not possible across processes, so they run one after the
  other; the torch engine's epikv K = 512 is run the same way unless --no-torch.
All llama.cpp runs use --threads threads (default 1) and llama.cpp's default F16 cache and flash-attention choice.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time

import numpy as np

PROMPT = "Explain step by step why the sum of two odd numbers is even."


def _prompt_ids(gm):
    from epikv.engine import encode_prompts

    return encode_prompts(gm.tokenizer, [PROMPT], chat=True)[0]


class _Llama:
    def __init__(self, gm, ids, policy, budget, capture, total):
        from epikv.llamacpp import LlamaDecoder

        self.dec = LlamaDecoder(gm, policy, budget, max_tokens=len(ids) + total, threads=ARGS.threads,
                                capture=capture, n_batch=min(512, len(ids)))
        self.logits = self.dec.prefill(ids)

    def run(self, n):
        for _ in range(n):
            self.logits = self.dec.step(int(np.argmax(self.logits)))


class _Torch:
    def __init__(self, ids, budget, total):
        import torch

        from epikv import load_model
        from epikv.engine import Decoder

        torch.set_num_threads(ARGS.threads)
        self.torch = torch
        lm = load_model("smollm2")
        self.dec = Decoder(lm.model, "epikv", budget)
        with torch.inference_mode():
            self.logits = self.dec.prefill(torch.tensor([ids]), [0])

    def run(self, n):
        with self.torch.inference_mode():
            for _ in range(n):
                self.logits = self.dec.step(self.logits.argmax(-1)[:, None])


def step(args):
    from epikv.llamacpp import load_gguf

    gm = load_gguf("smollm2")
    ids = _prompt_ids(gm)
    total = args.gen
    configs = {
        "llama.cpp plain (full, no callback)": lambda: _Llama(gm, ids, "full", None, "auto", total),
        "epikv llama.cpp (C capture)": lambda: _Llama(gm, ids, "epikv", args.budget, "c", total),
        "epikv llama.cpp (Python capture)": lambda: _Llama(gm, ids, "epikv", args.budget, "python", total),
        "C capture only (no eviction)": lambda: _Llama(gm, ids, "epikv", 100_000, "c", total),
    }
    if not args.no_torch:
        configs["epikv torch engine (float32)"] = lambda: _Torch(ids, args.budget, total)
    runs = {k: make() for k, make in configs.items()}
    spent = {k: 0.0 for k in runs}
    done = 0
    while done < total:
        n = min(args.round, total - done)
        for k, r in runs.items():
            t0 = time.perf_counter()
            r.run(n)
            spent[k] += time.perf_counter() - t0
        done += n
    base = spent["llama.cpp plain (full, no callback)"]
    rows = []
    for k, s in spent.items():
        r = runs[k]
        extra = {}
        if isinstance(r, _Llama):
            extra = dict(evictions=r.dec.evictions, cache_tokens=r.dec.stored(), kv_cells=r.dec.n_ctx,
                         capture=r.dec.capture.method if r.dec.capture else None)
        rows.append(dict(config=k, tokens=total, seconds=round(s, 3), tokens_per_s=round(total / s, 2),
                         time_vs_plain=round(s / base, 4), **extra))
    return dict(rows=rows, prompt_tokens=len(ids), budget=args.budget, threads=args.threads, round=args.round)


def _child(args):
    """One long generation in this process: tokens/s per segment, peak RSS, KV bytes."""
    if args.engine == "torch":
        import torch

        r = _Torch(_ids_for_torch(), args.budget, args.gen)
        segs = []
        for s in range(0, args.gen, args.segment):
            t0 = time.perf_counter()
            r.run(min(args.segment, args.gen - s))
            segs.append(round(min(args.segment, args.gen - s) / (time.perf_counter() - t0), 2))
        from epikv.measure import kv_bytes_per_token

        kv = kv_bytes_per_token(r.dec.model) * r.dec.cache.layers[0].capacity
        out = dict(segments_tok_s=segs, kv_bytes=int(kv), cache_tokens=r.dec.cache.stored_length())
    else:
        from epikv.llamacpp import load_gguf

        gm = load_gguf("smollm2")
        ids = _prompt_ids(gm)
        budget = args.budget if args.policy != "full" else None
        r = _Llama(gm, ids, args.policy, budget, "auto", args.gen)
        segs = []
        for s in range(0, args.gen, args.segment):
            t0 = time.perf_counter()
            r.run(min(args.segment, args.gen - s))
            segs.append(round(min(args.segment, args.gen - s) / (time.perf_counter() - t0), 2))
        out = dict(segments_tok_s=segs, kv_bytes=r.dec.kv_bytes(), kv_cells=r.dec.n_ctx, cache_tokens=r.dec.stored(),
                   evictions=r.dec.evictions)
    out["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    print(json.dumps(out))


def _ids_for_torch():
    from epikv import load_model
    from epikv.engine import encode_prompts

    return encode_prompts(load_model("smollm2").tokenizer, [PROMPT], chat=True)[0]


def long(args):
    rows = []
    plan = [("llama.cpp", "epikv"), ("llama.cpp", "full")] + ([] if args.no_torch else [("torch", "epikv")])
    for engine, policy in plan:
        cmd = [sys.executable, __file__, "_child", "--engine", engine, "--policy", policy, "--gen", str(args.gen),
               "--segment", str(args.segment), "--budget", str(args.budget), "--threads", str(args.threads)]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode:
            raise SystemExit(f"{engine} {policy} failed: {p.stderr.strip().splitlines()[-1:]}")
        rows.append(dict(engine=engine, policy=policy, budget=args.budget if policy != "full" else None,
                         **json.loads(p.stdout.strip().splitlines()[-1])))
        print(rows[-1], file=sys.stderr)
    e, f = rows[0]["segments_tok_s"], rows[1]["segments_tok_s"]
    return dict(rows=rows, epikv_over_full_per_segment=[round(a / b, 2) for a, b in zip(e, f)],
                gen=args.gen, segment=args.segment, threads=args.threads)


def main():
    global ARGS
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["step", "long", "_child"])
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--gen", type=int, default=None)
    ap.add_argument("--round", type=int, default=64)
    ap.add_argument("--segment", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--engine", default="llama.cpp")
    ap.add_argument("--policy", default="epikv")
    ap.add_argument("--out", default=None)
    ARGS = args = ap.parse_args()
    if args.gen is None:
        args.gen = 1024 if args.mode == "step" else 6000
    if args.mode == "_child":
        return _child(args)
    t0 = time.time()
    res = step(args) if args.mode == "step" else long(args)
    import llama_cpp

    res.update(command="PYTHONPATH=src .venv/bin/python benchmarks/llamacpp_speed.py " + " ".join(sys.argv[1:]),
               llama_cpp_python=llama_cpp.__version__, machine=platform.processor() or platform.machine(),
               cpus=len(os.sched_getaffinity(0)), load_average=os.getloadavg(), wall_s=round(time.time() - t0, 1))
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
