"""The decode step of `epikv serve --engine llama.cpp` with many sequences holding many cells: a KV stream per
sequence against the unified cache, at equal KV cells (issue 40), in one process, the layouts alternated
(A B A B ...) so that a change in the shared CPU's load falls on both.

Each run: S requests of the same MATH-500-like chat prompt padded to P tokens, max_tokens T, all submitted at once
(LlamaBackend, greedy, epikv K, no eviction while they fit); timed: the steps in which all S sequences decode (S rows
a step), after the prefill. Appends one JSON line per run to --out.

    PYTHONPATH=src python benchmarks/llamacpp_streams_step.py --sequences 24 --prompt 380 --new 80 --budget 512 \
        --threads 2 --reps 2 --out benchmarks/results/serve/streams/step.jsonl
"""

import argparse
import json
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sequences", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=380)
    ap.add_argument("--new", type=int, default=24)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    from epikv.llamacpp import load_gguf
    from epikv.serving.llamacpp import LlamaBackend

    gm = load_gguf("smollm2")
    words = gm.tokenizer.encode(" Explain each step of the proof with care.", False)
    prompts = []
    for i in range(a.sequences):
        head = gm.tokenizer.encode(f"Problem {i}: find the sum of the first {i + 10} odd numbers.", True)
        ids = head + words * ((a.prompt - len(head)) // len(words) + 1)
        prompts.append(ids[: a.prompt])
    per = a.budget + 256  # a stream: K + tau - 1 + a 256-token prompt chunk (tau 1), as serve derives it
    ctx = a.sequences * ((per + 255) // 256 * 256)
    for rep in range(a.reps):
        for kv in ("unified", "streams") if rep % 2 == 0 else ("streams", "unified"):
            be = LlamaBackend(gm, "epikv", a.budget, None, ctx=ctx, sequences=a.sequences, max_batch_tokens=256,
                              threads=a.threads, kv=kv)
            marks = []
            be.on_step = lambda b: marks.append((time.perf_counter(), len(b._running),
                                                 sum(r.fed >= len(r.prompt) for r in b._running), b._held()))
            t0 = time.perf_counter()
            for k, ids in enumerate(prompts):
                be.submit(str(k), ids, a.new, sampling=None, seed=k, ignore_eos=True)
            done = 0
            while done < a.sequences:
                o = be.next_output(600)
                assert o is not None and o.error is None, o
                done += o.finished
            wall = time.perf_counter() - t0
            st = be.stats()
            be.stop()
            full = [(t1 - t0_, c) for (t0_, _, d0, _), (t1, n, d, c) in zip(marks, marks[1:])
                    if d0 == n == d == a.sequences]
            dt = [x for x, _ in full]
            rec = {"kv": kv, "rep": rep, "sequences": a.sequences, "prompt": a.prompt, "new": a.new,
                   "budget": a.budget, "threads": a.threads, "cells": st["cells"], "cells_allocated":
                   st["cells_allocated"], "stream_cells": st["stream_cells"], "kv_bytes": st["kv_bytes"],
                   "decode_steps_timed": len(dt), "step_ms_median": round(1000 * statistics.median(dt), 1),
                   "step_ms_mean": round(1000 * statistics.mean(dt), 1),
                   "cells_in_use_median": statistics.median(c for _, c in full),
                   "decode_tokens_per_s": round(a.sequences / statistics.median(dt), 1), "wall_s": round(wall, 1)}
            print(json.dumps(rec), flush=True)
            with open(a.out, "a") as f:
                f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
