"""Speed and memory of EPIKV inside llama.cpp (`epikv.llamacpp`) on the embedded GGUF, as ratios from one run.

    PYTHONPATH=src .venv/bin/python benchmarks/llamacpp_speed.py step --out benchmarks/results/llamacpp/step.json
    PYTHONPATH=src .venv/bin/python benchmarks/llamacpp_speed.py step --policy epikv-seg-q \
        --out benchmarks/results/llamacpp/step-seg-q.json
    PYTHONPATH=src .venv/bin/python benchmarks/llamacpp_speed.py long --out benchmarks/results/llamacpp/long.json
    PYTHONPATH=src .venv/bin/python benchmarks/llamacpp_speed.py capture --out benchmarks/results/llamacpp/capture.json
    PYTHONPATH=src .venv/bin/python benchmarks/llamacpp_speed.py interleaved --out benchmarks/results/llamacpp/interleaved.json

step: decode tokens/s at batch 1, K = 512, --gen new tokens after the chat prompt, configurations taking turns in
  rounds of --round tokens in one process (each has its own context): plain llama.cpp with the whole cache and
  held at K by removing the oldest decode token (both a bare ctypes loop: no callback, no policy), epikv with the C
  capture, epikv with the Python capture, and epikv in the torch engine (float32, SDPA). The figure per
  configuration is its total decode time over its tokens; ratios are against the two plain runs. --policy P (a
  policy llama.cpp runs, at its shipped settings) replaces epikv in the llama.cpp and torch configurations; epikv
  with the C capture stays as a reference row.
long: tokens/s over each 1,000 tokens of a --gen-token generation (EOS ignored), epikv K = 512 against plain
  llama.cpp with the whole cache, each in its own child process (peak RSS of that process; KV bytes of its
  context), the two alternating segment by segment is not possible across processes, so they run one after the
  other; the torch engine's epikv K = 512 is run the same way unless --no-torch.
capture: the eval callback's cost alone (bare loop without / with the C / with the Python callback).
interleaved: the same two llama.cpp generations in one process, alternating segment by segment (speeds only).
split: where a step's time goes, inside llama_decode and outside it (epikv's Python), per configuration (split()).
All llama.cpp runs use --threads threads (default 1) and llama.cpp's default F16 cache and flash-attention choice
(--type-kv f32 and --flash-attn on|off change both for every llama.cpp configuration).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import subprocess
import sys
import time

import numpy as np

PROMPT = "Explain step by step why the sum of two odd numbers is even."


def _prompt_ids(gm):
    from epikv.engine import encode_prompts

    return encode_prompts(gm.tokenizer, [PROMPT], chat=True)[0]


class _Llama:
    def __init__(self, gm, ids, policy, budget, capture, total, cells=None):
        from epikv.llamacpp import LlamaDecoder

        # cells: one K and V type for both (celltypes mode), with flash attention on (a quantized V cache needs it)
        kv = dict(type_kv=ARGS.type_kv, flash_attn=_fa()) if cells is None else dict(type_k=cells, type_v=cells,
                                                                                    flash_attn=True)
        self.dec = LlamaDecoder(gm, policy, budget, max_tokens=len(ids) + total, threads=ARGS.threads,
                                capture=capture, n_batch=min(512, len(ids)), **kv)
        self.logits = self.dec.prefill(ids)

    def run(self, n):
        for _ in range(n):
            self.logits = self.dec.step(int(np.argmax(self.logits)))


class _Raw:
    """Plain llama.cpp through the same low-level API with no epikv code: decode, copy the logits, argmax. hold=K:
    after each token the oldest decode token is removed once the cache is over K (no eviction callback, no
    policy), in a context sized as epikv's; else the whole cache in a context of prompt + new tokens."""

    def __init__(self, gm, ids, total, hold=None, capture=None, blocks=(9, 20)):
        from epikv.llamacpp import load
        from epikv.llamacpp.capture import BlockCapture
        from epikv.llamacpp.engine import KV_TYPES

        ll = self.ll = load().ll
        cp = ll.llama_context_default_params()
        self.cap = None
        if capture:  # the eval callback alone (blocks 9 and 20 unless told), no policy
            self.cap = BlockCapture(list(blocks), gm.n_embd, min(512, len(ids)), capture)
            cp.cb_eval, cp.cb_eval_user_data = self.cap.cb, self.cap.user_data
        nb = min(512, len(ids))
        cp.n_ctx = len(ids) + total if hold is None else min(len(ids) + total, hold + nb)
        cp.n_batch = cp.n_ubatch = nb
        cp.kv_unified = True
        cp.n_threads = cp.n_threads_batch = ARGS.threads
        fa = _fa()
        cp.flash_attn_type = (ll.LLAMA_FLASH_ATTN_TYPE_AUTO if fa is None else
                              ll.LLAMA_FLASH_ATTN_TYPE_ENABLED if fa else ll.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        if ARGS.type_kv == "f32":
            cp.type_k = cp.type_v = KV_TYPES["f32"]
        self.ctx = ll.llama_init_from_model(gm.ptr, cp)
        self.mem = ll.llama_get_memory(self.ctx)
        self.batch = ll.llama_batch_init(nb, 0, 1)
        self.n_vocab, self.hold, self.p = gm.tokenizer.n_vocab, hold, len(ids)
        self.seen, self.oldest = 0, len(ids)
        self.logits = self._decode(ids)

    def _decode(self, toks):
        b, ll = self.batch, self.ll
        b.n_tokens = len(toks)
        for j, t in enumerate(toks):
            b.token[j], b.pos[j], b.n_seq_id[j], b.logits[j] = t, self.seen + j, 1, int(j == len(toks) - 1)
            b.seq_id[j][0] = 0
        assert ll.llama_decode(self.ctx, b) == 0
        self.seen += len(toks)
        if self.hold is not None and self.seen - (self.oldest - self.p) > self.hold:
            assert ll.llama_memory_seq_rm(self.mem, 0, self.oldest, self.oldest + 1)
            self.oldest += 1
        out = ll.llama_get_logits_ith(self.ctx, len(toks) - 1)
        return np.ctypeslib.as_array(out, shape=(self.n_vocab,)).copy()

    def run(self, n):
        for _ in range(n):
            self.logits = self._decode([int(np.argmax(self.logits))])


def _fa():
    """--flash-attn as LlamaDecoder takes it: None (llama.cpp's choice), True or False."""
    return {"auto": None, "on": True, "off": False}[ARGS.flash_attn]


class _Torch:
    def __init__(self, ids, budget, total, policy="epikv"):
        import torch

        from epikv import load_model
        from epikv.engine import Decoder

        torch.set_num_threads(ARGS.threads)
        self.torch = torch
        lm = load_model("smollm2")
        self.dec = Decoder(lm.model, policy, budget)
        with torch.inference_mode():
            self.logits = self.dec.prefill(torch.tensor([ids]), [0])

    def run(self, n):
        with self.torch.inference_mode():
            for _ in range(n):
                self.logits = self.dec.step(self.logits.argmax(-1)[:, None])


def _rounds(runs: dict, total: int, size: int) -> dict[str, float]:
    """Seconds each configuration spent generating `total` tokens, in rounds of `size` taken in turn (the machine's
    drift falls on every configuration alike)."""
    spent = {k: 0.0 for k in runs}
    done = 0
    while done < total:
        n = min(size, total - done)
        for k, r in runs.items():
            t0 = time.perf_counter()
            r.run(n)
            spent[k] += time.perf_counter() - t0
        done += n
    return spent


def step(args):
    """Every configuration in rounds taken in turn (_rounds); `--repeats N` does it N times from fresh decoders. Each
    row is the configuration's median over the repeats of its time ratios, each ratio paired within its repeat (the
    range and every repeat's ratio kept beside it)."""
    import statistics

    from epikv.llamacpp import load_gguf

    gm = load_gguf("smollm2")
    ids = _prompt_ids(gm)
    total = args.gen
    pol = args.policy
    whole, held_name = "plain llama.cpp, whole cache", f"plain llama.cpp, held at K={args.budget} (oldest removed)"
    configs = {
        whole: lambda: _Raw(gm, ids, total),
        held_name: lambda: _Raw(gm, ids, total, args.budget),
        f"{pol} llama.cpp (C capture)": lambda: _Llama(gm, ids, pol, args.budget, "c", total),
        f"{pol} llama.cpp (Python capture)": lambda: _Llama(gm, ids, pol, args.budget, "python", total),
    }
    if pol != "epikv":
        configs["epikv llama.cpp (C capture)"] = lambda: _Llama(gm, ids, "epikv", args.budget, "c", total)
    if not args.no_torch:
        configs[f"{pol} torch engine (float32)"] = lambda: _Torch(ids, args.budget, total, pol)
    repeats = []
    for rep in range(args.repeats):
        load_before = [round(x, 2) for x in os.getloadavg()]
        runs = {k: make() for k, make in configs.items()}
        spent = _rounds(runs, total, args.round)
        rows = {}
        for k, sec in spent.items():
            r = runs[k]
            extra = {}
            if isinstance(r, _Llama):
                extra = dict(evictions=r.dec.evictions, cache_tokens=r.dec.stored(), kv_cells=r.dec.n_ctx,
                             capture=r.dec.capture.method if r.dec.capture else None, kv_bytes=r.dec.kv_bytes(),
                             kv_mirror_bytes=r.dec.mirror_bytes(), max_cache_tokens=r.dec.max_tokens)
            rows[k] = dict(config=k, tokens=total, seconds=round(sec, 3), tokens_per_s=round(total / sec, 2),
                           time_vs_plain_whole=round(sec / spent[whole], 4),
                           time_vs_plain_held=round(sec / spent[held_name], 4), **extra)
        repeats.append(dict(load_before=load_before, rows=list(rows.values())))
        print(rep, {k: v["time_vs_plain_held"] for k, v in rows.items()}, file=sys.stderr)
        del runs
    out_rows = []
    for k in configs:
        per = [next(r for r in rep["rows"] if r["config"] == k) for rep in repeats]
        row = dict(per[-1])
        for f in ("seconds", "tokens_per_s", "time_vs_plain_whole", "time_vs_plain_held"):
            row[f] = round(statistics.median(r[f] for r in per), 4)
        if len(per) > 1:
            row["time_vs_plain_held_repeats"] = [r["time_vs_plain_held"] for r in per]
        out_rows.append(row)
    out = dict(rows=out_rows, prompt_tokens=len(ids), budget=args.budget, policy=pol, threads=args.threads,
               round=args.round)
    if len(repeats) > 1:
        out["repeats"] = repeats
    return out


def celltypes(args):
    """Issue 56: one policy at one K on F16, q8_0 and q4_0 cells (flash attention on for all three), rounds
    interleaved in one process; each repeat builds fresh decoders. Per repeat the time ratio of each type to F16
    (above 1: slower); the median and range of the repeats."""
    import statistics

    from epikv.llamacpp import load_gguf

    gm = load_gguf("smollm2")
    ids = _prompt_ids(gm)
    total, types = args.gen, ("f16", "q8_0", "q4_0")
    repeats = []
    for _ in range(args.repeats):
        runs = {t: _Llama(gm, ids, args.policy, args.budget, "c", total, cells=t) for t in types}
        spent = _rounds(runs, total, args.round)
        repeats.append({t: dict(seconds=round(spent[t], 3), tokens_per_s=round(total / spent[t], 2),
                                evictions=runs[t].dec.evictions, kv_peak_bytes=runs[t].dec.peak_report()["kv_peak_bytes"],
                                time_vs_f16=round(spent[t] / spent["f16"], 4)) for t in types})
        for r in runs.values():
            r.dec.close()
    summary = {t: dict(time_vs_f16_median=statistics.median(r[t]["time_vs_f16"] for r in repeats),
                       time_vs_f16_range=[min(r[t]["time_vs_f16"] for r in repeats),
                                          max(r[t]["time_vs_f16"] for r in repeats)],
                       tokens_per_s_median=statistics.median(r[t]["tokens_per_s"] for r in repeats)) for t in types}
    return dict(repeats=repeats, summary=summary, prompt_tokens=len(ids), budget=args.budget, policy=args.policy,
                threads=args.threads, round=args.round, tokens=total, flash_attn="on")


def split(args):
    """Where a step's time goes: each configuration's time inside llama_decode (the graph compute, the capture
    callback included) and outside it (epikv's Python: record, scoring, bookkeeping, eviction; the loop's argmax),
    per token, rounds interleaved in one process, `--repeats` times from fresh decoders. Configurations: plain
    llama.cpp held at K, with and without the C callback copying every block; `streaming` and `random` at tau 16
    (no capture); --policy at its shipped tau and at tau 1."""
    import statistics

    from epikv.llamacpp import load_gguf, lib
    from epikv.policies import get_policy

    ll = lib.load().ll
    inside = {}
    current = [None]
    decode = ll.llama_decode

    def timed(ctx, batch):  # every decode path calls ll.llama_decode by attribute: timed per configuration
        t0 = time.perf_counter()
        rc = decode(ctx, batch)
        inside[current[0]] = inside.get(current[0], 0.0) + time.perf_counter() - t0
        return rc

    gm = load_gguf("smollm2")
    ids = _prompt_ids(gm)
    total, k, pol = args.gen, args.budget, get_policy(args.policy)
    configs = {
        f"plain llama.cpp, held at K={k}": lambda: _Raw(gm, ids, total, k),
        f"plain llama.cpp, held at K={k}, C callback every block": lambda: _Raw(
            gm, ids, total, k, capture="c", blocks=range(gm.n_layers - 1)),
        "streaming, tau 16": lambda: _Llama(gm, ids, get_policy("streaming", tau=16), k, "c", total),
        "random, tau 16": lambda: _Llama(gm, ids, get_policy("random", tau=16), k, "c", total),
        f"{pol.name}, tau {pol.tau}": lambda: _Llama(gm, ids, get_policy(args.policy), k, "c", total),
        f"{pol.name}, tau 1": lambda: _Llama(gm, ids, get_policy(args.policy, tau=1), k, "c", total),
    }
    repeats = []
    ll.llama_decode = timed
    try:
        for rep in range(args.repeats):
            load_before = [round(x, 2) for x in os.getloadavg()]
            runs = {}
            for name, make in configs.items():
                current[0] = name
                runs[name] = make()
            inside.clear()
            spent = {name: 0.0 for name in runs}
            for s in range(0, total, args.round):
                n = min(args.round, total - s)
                for name, r in runs.items():
                    current[0] = name
                    t0 = time.perf_counter()
                    r.run(n)
                    spent[name] += time.perf_counter() - t0
            rows = [dict(config=name, ms_per_token=round(1e3 * spent[name] / total, 3),
                         decode_ms=round(1e3 * inside[name] / total, 3),
                         outside_ms=round(1e3 * (spent[name] - inside[name]) / total, 3),
                         evictions=getattr(getattr(runs[name], "dec", None), "evictions", None)) for name in runs]
            repeats.append(dict(load_before=load_before, rows=rows))
            print(rep, {r["config"]: (r["decode_ms"], r["outside_ms"]) for r in rows}, file=sys.stderr)
            del runs
    finally:
        ll.llama_decode = decode
    summary = []
    for name in configs:
        per = [next(r for r in rep["rows"] if r["config"] == name) for rep in repeats]
        summary.append({"config": name, **{f: round(statistics.median(r[f] for r in per), 3)
                                           for f in ("ms_per_token", "decode_ms", "outside_ms")},
                        "evictions": per[-1]["evictions"]})
    return dict(rows=summary, repeats=repeats, prompt_tokens=len(ids), budget=k, policy=args.policy,
                threads=args.threads, round=args.round, tokens=total)


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


def capture(args):
    """The eval callback's cost alone: the bare loop with no callback, with the C callback, with the Python
    callback (blocks 9 and 20 copied every token, nothing else), and the C callback copying every block's output
    (what the learned scores read), whole cache, rounds interleaved."""
    from epikv.llamacpp import load_gguf

    gm = load_gguf("smollm2")
    ids = _prompt_ids(gm)
    runs = {"no callback": _Raw(gm, ids, args.gen), "C callback": _Raw(gm, ids, args.gen, capture="c"),
            "Python callback": _Raw(gm, ids, args.gen, capture="python"),
            "C callback, every block": _Raw(gm, ids, args.gen, capture="c", blocks=range(gm.n_layers - 1))}
    spent = {k: 0.0 for k in runs}
    for s in range(0, args.gen, args.round):
        for k, r in runs.items():
            t0 = time.perf_counter()
            r.run(min(args.round, args.gen - s))
            spent[k] += time.perf_counter() - t0
    base = spent["no callback"]
    asks = runs["C callback"].cap.asks / (args.gen + 1)
    return dict(rows=[dict(config=k, tokens_per_s=round(args.gen / v, 2), time_vs_no_callback=round(v / base, 4))
                      for k, v in spent.items()], asks_per_forward=round(asks, 1), gen=args.gen, threads=args.threads)


def interleaved(args):
    """epikv K (`--policy`) and plain llama.cpp with the whole cache in one process, alternating segment by segment:
    the tokens/s ratio per segment is measured under the same load. `--repeats N` runs the pair N times from a fresh
    prefill (the order of the two alternating each repeat), records every repeat and the machine's load before it,
    and reports the per-segment median of the repeats and of their ratios."""
    import statistics

    from epikv.llamacpp import load_gguf

    gm = load_gguf("smollm2")
    ids = _prompt_ids(gm)
    ep_name = "epikv llama.cpp" if args.policy == "epikv" else f"{args.policy} llama.cpp"
    pl_name = "plain llama.cpp, whole cache"
    repeats = []
    for rep in range(args.repeats):
        load_before = os.getloadavg()
        runs = {ep_name: _Llama(gm, ids, args.policy, args.budget, "auto", args.gen), pl_name: _Raw(gm, ids, args.gen)}
        order = list(runs) if rep % 2 == 0 else list(runs)[::-1]
        segs = {k: [] for k in runs}
        for s in range(0, args.gen, args.segment):
            n = min(args.segment, args.gen - s)
            for k in order:
                t0 = time.perf_counter()
                runs[k].run(n)
                segs[k].append(round(n / (time.perf_counter() - t0), 2))
            print(rep, {k: v[-1] for k, v in segs.items()}, file=sys.stderr)
        repeats.append(dict(segments_tok_s=segs, load_before=[round(x, 2) for x in load_before], first=order[0],
                            ratio_per_segment=[round(a / b, 3) for a, b in zip(segs[ep_name], segs[pl_name])],
                            kv_cells=runs[ep_name].dec.n_ctx))
        del runs
    med = {k: [round(statistics.median(r["segments_tok_s"][k][i] for r in repeats), 2)
               for i in range(len(repeats[0]["segments_tok_s"][k]))] for k in (ep_name, pl_name)}
    ratio = [round(statistics.median(r["ratio_per_segment"][i] for r in repeats), 2)
             for i in range(len(repeats[0]["ratio_per_segment"]))]
    return dict(segments_tok_s=med, epikv_over_full_per_segment=ratio, repeats=repeats, n_repeats=args.repeats,
                policy=args.policy, gen=args.gen, segment=args.segment, budget=args.budget, threads=args.threads,
                kv_cells={ep_name: repeats[0]["kv_cells"]})


def main():
    global ARGS
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["step", "long", "interleaved", "capture", "celltypes", "split", "_child"])
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--gen", type=int, default=None)
    ap.add_argument("--round", type=int, default=64)
    ap.add_argument("--segment", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--engine", default="llama.cpp")
    ap.add_argument("--policy", default="epikv")
    ap.add_argument("--flash-attn", choices=["auto", "on", "off"], default="auto",
                    help="llama.cpp's flash attention in every llama.cpp configuration (default: llama.cpp's choice)")
    ap.add_argument("--type-kv", choices=["f16", "f32"], default="f16", help="llama.cpp's K and V cache type")
    ap.add_argument("--repeats", type=int, default=1,
                    help="step, interleaved, celltypes, split: run the configurations this many times from fresh "
                    "decoders")
    ap.add_argument("--label", default=None, help="a name for the code measured (PYTHONPATH may point at another tree)")
    ap.add_argument("--out", default=None)
    ARGS = args = ap.parse_args()
    if args.gen is None:
        args.gen = 1024 if args.mode in ("step", "capture", "celltypes", "split") else 6000
    import torch

    # as every llama.cpp entry point (commands/engines.py, serving/build.py): one torch thread for the policy's few
    # rows a token; torch's own default (a thread per core) spins against llama.cpp's threads (the torch rows set
    # --threads for themselves)
    torch.set_num_threads(1)
    if args.mode == "_child":
        return _child(args)
    t0 = time.time()
    res = {"step": step, "long": long, "interleaved": interleaved, "capture": capture,
           "celltypes": celltypes, "split": split}[args.mode](args)
    import llama_cpp

    if args.label:
        res["label"] = args.label
    res.update(command=f"PYTHONPATH={os.environ.get('PYTHONPATH', 'src')} .venv/bin/python benchmarks/llamacpp_speed.py "
               + shlex.join(sys.argv[1:]),
               llama_cpp_python=llama_cpp.__version__, machine=platform.processor() or platform.machine(),
               cpus=len(os.sched_getaffinity(0)), load_average=os.getloadavg(), wall_s=round(time.time() - t0, 1),
               **({} if args.mode == "celltypes" else dict(flash_attn=args.flash_attn, type_kv=args.type_kv)))
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
