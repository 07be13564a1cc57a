"""`epikv bench speed|memory|throughput`: decode speed ratios per policy, the single-pass memory wall, and throughput
under a KV-memory cap."""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

from ..errors import EpiKVError
from .engines import add_cache_type_args, add_engine_args
from .common import (add_model_args, add_policy_args, int_list, load, name_list, nonneg_float, nonneg_int, out_dir,
                     out_file, positive_int, settings_by_policy, top_p_float)


def register(sub) -> None:
    p = sub.add_parser("bench", help="performance benchmarks: decode speed, memory wall, throughput under a cap",
                       description="Performance benchmarks, measured through the engine's Decoder.")
    bsub = p.add_subparsers(dest="bench", metavar="BENCH")
    bsub.required = True

    s = bsub.add_parser("speed", help="decode throughput per policy at equal budget, as ratios",
                        description="Interleaved decode timing of every policy (and tau) at each budget K, plus long "
                                    "generations of full vs epikv. Prints / writes JSON.")
    add_model_args(s)
    add_policy_args(s, multi=True, own_default=True)
    s.add_argument("--taus", type=int_list, default=[1, 128], help="eviction intervals to time (default 1,128)")
    s.add_argument("--gen-tokens", type=positive_int, default=512, help="timed decode steps per config and budget (default 512)")
    s.add_argument("--round-steps", type=positive_int, default=None,
                   help="steps per interleaved round (default: the largest tau)")
    s.add_argument("--prompt-tokens", type=positive_int, default=64, help="protected prompt length (default 64)")
    s.add_argument("--long-lengths", type=int_list, default=[512, 1024, 2048],
                   help="checkpoints (generated tokens) of the long generations (default 512,1024,2048)")
    s.add_argument("--long-policies", type=name_list, default=["full", "epikv"], help="default full,epikv")
    s.add_argument("--long-budget", type=positive_int, default=None, help="budget K of the long runs (default: first)")
    s.add_argument("--no-long", action="store_true", help="skip the long generations")
    s.add_argument("--no-transformers", action="store_true",
                   help="leave out the second reference, transformers' model.generate with a DynamicCache at full's "
                        "cache length (timed in the same rounds; on by default when full is benchmarked)")
    s.add_argument("--cap-gib", type=nonneg_float, default=6.0, help="memory cap of each CPU child process (GiB; default 6)")
    add_engine_args(s, cache_types=True)
    s.add_argument("--seed", type=int, default=0, help="seed of the random prompt tokens (default 0)")
    s.add_argument("--out", default=None, type=out_file,
                   help="write the JSON here (and a PNG next to it); default: stdout only")
    s.set_defaults(run=run_speed, policies=None, budgets=[512])

    m = bsub.add_parser("memory", help="peak memory of one forward pass: attention weights vs attention-free",
                        description="Peak memory (or OOM / over-cap) of one forward pass over n tokens: eager + "
                                    "attention weights of every layer against SDPA + hidden states at two blocks.")
    add_model_args(m)
    m.add_argument("--lengths", type=int_list, default=[2048, 4096, 8192, 16384, 32768, 65536],
                   help="comma-separated token counts of the forward pass (default 2048 ... 65536, doubling)")
    m.add_argument("--modes", type=name_list, default=["eager+attn", "sdpa+hidden"],
                   help="comma-separated: eager+attn (eager attention, weights of every layer), sdpa+hidden (SDPA, "
                        "hidden states at two blocks); default both")
    m.add_argument("--cap-gib", type=nonneg_float, default=None,
                   help="memory cap per point (required on CPU; on CUDA a point above it is reported over-cap)")
    m.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads in each child")
    m.add_argument("--seed", type=int, default=0, help="seed of the random input tokens (default 0)")
    m.add_argument("--out", default=None, type=out_file,
                   help="write the JSON here (and a PNG next to it); default: stdout only")
    m.set_defaults(run=run_memory)

    t = bsub.add_parser("throughput", help="largest batch under a KV-memory cap per policy, and its throughput",
                        description="Per policy, the largest static batch whose KV cache (counted from the buffers the "
                                    "cache allocates, plus an observing policy's attention weights / hidden states) "
                                    "fits --cap-mib; the request set run at that batch and smaller ones, interleaved; "
                                    "tokens/s, time to finish and memory as ratios to full. Generation length is "
                                    "forced (EOS ignored); static batches: a request keeps its slot until its batch "
                                    "ends.")
    add_model_args(t)
    add_policy_args(t, multi=True, own_default=True)
    t.add_argument("--cap-mib", type=nonneg_float, required=True, help="KV-memory cap (MiB) every batch must fit")
    t.add_argument("--data", default="math500", help="dataset name or JSONL path (fields id, problem, answer)")
    t.add_argument("--data-dir", default=None,
                   help="folder of the named datasets (default: $EPIKV_DATA_DIR, else the copy shipped with epikv)")
    t.add_argument("--requests", type=positive_int, default=8, help="N: the first N prompts of the dataset")
    t.add_argument("--max-prompt-tokens", type=positive_int, default=None,
                   help="take only prompts of at most this many tokens (skipping longer ones)")
    t.add_argument("--max-new-tokens", type=positive_int, default=2048, help="tokens generated per request (forced)")
    t.add_argument("--ladder", type=nonneg_int, default=1,
                   help="smaller batch sizes per policy: max/2, max/4 ... (default 1); full's batch is always added")
    t.add_argument("--batch-sizes", type=int_list, default=None, help="extra batch sizes to run for every policy")
    t.add_argument("--ladder-full-set", action="store_true",
                   help="run the whole request set at the smaller batch sizes too (default: their first batch)")
    t.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    t.add_argument("--engine", choices=("torch", "llama.cpp"), default="torch",
                   help="torch only: llama.cpp decodes one sequence, so there is no batch to fit under the cap")
    t.add_argument("--out", default=None, type=out_file,
                   help="write the JSON here (and a PNG next to it); default: stdout only")
    t.set_defaults(run=run_throughput, policies=["full", "epikv"], budgets=[1024])


    v = bsub.add_parser("serve", help="load on `epikv serve` over HTTP: full against eviction under one KV cache",
                        description="Starts `epikv serve` once per policy (in sequence, the same cache: --num-blocks pages, "
                                    "or --ctx cells with --engine llama.cpp), sends "
                                    "--requests chat requests with reasoning problems from the shared data at "
                                    "--concurrency with the openai client, each forced to --max-tokens, and reports "
                                    "requests completed, in flight, tokens/s, latency, peak KV pages and "
                                    "preemptions. Writes results.jsonl (resumable), table.md and serve.png into "
                                    "--out.")
    add_model_args(v)
    add_policy_args(v, multi=True, by_engine=True, also="full")
    v.add_argument("--engine", choices=("torch", "llama.cpp"), default="torch",
                   help="the server's engine: torch (transformers' continuous batching over --num-blocks pages, "
                        "default) or llama.cpp (one context of --ctx cells shared by up to --sequences sequences)")
    v.add_argument("--page", type=positive_int, default=None, help="tokens per cache page (torch; default 16)")
    v.add_argument("--num-blocks", type=positive_int, default=None,
                   help="pages in the shared KV cache, the same for every policy (torch; required unless --url)")
    v.add_argument("--ctx", type=positive_int, default=None,
                   help="KV cells of the llama.cpp context, the same for every policy (llama.cpp; required unless "
                        "--url)")
    v.add_argument("--sequences", type=positive_int, default=None,
                   help="sequences the llama.cpp server decodes at once (llama.cpp; default --concurrency)")
    v.add_argument("--kv", choices=("streams", "unified"), default=None,
                   help="the llama.cpp server's cache layout (llama.cpp; default: the server's, streams for an "
                        "evicting policy, unified for full)")
    add_cache_type_args(v, memory=False)
    v.add_argument("--max-batch-tokens", type=positive_int, default=256, help="tokens per forward pass")
    v.add_argument("--url", default=None,
                   help="load an already running server instead (one row: its policy); a server without epikv's "
                        "/stats (llama.cpp's llama-server) is counted from its timings and usage")
    v.add_argument("--label", default=None, help="the --url row's label in the table (default: its policy)")
    v.add_argument("--requests", type=positive_int, default=32, help="requests per policy (R)")
    v.add_argument("--concurrency", type=positive_int, default=32, help="requests open at once (C)")
    v.add_argument("--max-tokens", type=positive_int, default=1024, help="tokens generated per request (forced)")
    v.add_argument("--temperature", type=nonneg_float, default=0.0,
                   help="sample every request at this temperature (0: greedy, the default)")
    v.add_argument("--top-p", type=top_p_float, default=1.0, help="top-p of sampled requests (default 1: off)")
    v.add_argument("--seed", type=nonneg_int, default=0, help="request i of a sampled run gets seed + i (default 0)")
    v.add_argument("--timeout", type=positive_int, default=3600, help="seconds per policy run, all requests")
    v.add_argument("--data", default="math500", help="dataset name or JSONL path (fields id, problem, answer)")
    v.add_argument("--data-dir", default=None,
                   help="folder of the named datasets (default: $EPIKV_DATA_DIR, else the copy shipped with epikv)")
    v.add_argument("--max-prompt-tokens", type=positive_int, default=None,
                   help="take only prompts of at most this many tokens (an evicting policy refuses a prompt that "
                        "does not fit its budget with the recent window)")
    v.add_argument("--equal-batch", type=nonneg_int, default=0,
                   help="also time B requests together in-process: the engine under each policy and padded "
                        "model.generate (0: skip)")
    v.add_argument("--equal-batch-tokens", type=positive_int, default=None,
                   help="tokens per request of the equal-batch part (default: --max-tokens)")
    v.add_argument("--equal-batch-repeats", type=positive_int, default=1, help="interleaved repeats of that part")
    v.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (server and this process)")
    v.add_argument("--out", required=True, type=out_dir, help="folder for results.jsonl, table.md, serve.png, logs")
    v.set_defaults(run=run_serve, budgets=[256, 512])


def run_serve(args) -> int:
    from ..bench.serve import (Row, chat_prompts, equal_batch, peak_kv, plot, read_done, row_key, run_row, table,
                               tokenizer_of)
    from ..data import data_dir
    from ..policies import REGISTRY

    if args.policies is None:
        from ..policies import default_policy

        entry = "serve-llama.cpp" if args.engine == "llama.cpp" else "serve-torch"
        args.policies = ["full", str(default_policy(entry))]  # a measurement runs what it names: no fallback
    names = list(dict.fromkeys(args.policies))
    settings = settings_by_policy(args, names)  # unknown names and stray --set refused before anything starts
    llama = args.engine == "llama.cpp"
    given = [f for f, v in ((("--page", args.page), ("--num-blocks", args.num_blocks)) if llama else
                            (("--ctx", args.ctx), ("--sequences", args.sequences),
                             ("--cache-type-k", None if args.cache_type_k == "f16" else args.cache_type_k),
                             ("--cache-type-v", None if args.cache_type_v == "f16" else args.cache_type_v)))
             if v is not None]
    if given:
        raise EpiKVError(f"{' and '.join(given)}: " + (
            "options of the torch engine's paged cache; --engine llama.cpp takes --ctx cells and --sequences" if llama
            else "options of --engine llama.cpp; the torch engine's cache is --num-blocks pages of --page tokens"))
    if llama and args.equal_batch:
        raise EpiKVError("--equal-batch times transformers' engine in process: not with --engine llama.cpp")
    if args.url is None and (args.ctx if llama else args.num_blocks) is None:
        raise EpiKVError(f"{'--ctx' if llama else '--num-blocks'} is required (or --url for a running server)")
    args.page = None if llama else (args.page or 16)
    if args.label is not None and args.url is None:
        raise EpiKVError("--label names the row of a running server: give --url")
    rows = []
    for name in names:
        sets = [f"{n}.{k}={json.dumps(list(v) if isinstance(v, tuple) else v)}"
                for n, k, v in (args.set or []) if n == name]
        for k in ([None] if not REGISTRY[name].evicts else dict.fromkeys(args.budgets)):
            rows.append(Row(name, k, sets, name=args.label))
    if args.url is not None and len(rows) > 1:
        raise EpiKVError("--url loads one running server: give one policy and one budget (its own)")
    folder = args.data_dir or (str(data_dir()) if not args.data.endswith(".jsonl") else None)
    tok = tokenizer_of(args.model) if args.max_prompt_tokens else None
    prompts, source = chat_prompts(args.data, folder, args.requests, tok, args.max_prompt_tokens)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.jsonl"
    done = read_done(results)
    common = {"model": args.model, "page": args.page, "num_blocks": args.num_blocks, "requests": args.requests,
              "concurrency": args.concurrency, "max_tokens": args.max_tokens, "data": args.data,
              "max_batch_tokens": args.max_batch_tokens, "url": args.url,
              "max_prompt_tokens": args.max_prompt_tokens}
    if llama:  # in the key only for llama.cpp, so torch rows recorded before stay reusable
        common.update(engine="llama.cpp", ctx=args.ctx, sequences=args.sequences or args.concurrency)
        if args.kv:  # in the key only when named, so rows recorded before stay reusable
            common["kv"] = args.kv
        for key in ("cache_type_k", "cache_type_v"):  # the same: in the key only when not llama.cpp's f16
            if getattr(args, key) != "f16":
                common[key] = getattr(args, key)
    sampling = None
    if args.temperature > 0:  # in the key only when sampled, so greedy rows recorded before stay reusable
        sampling = {"temperature": args.temperature, "top_p": args.top_p, "seed": args.seed}
        common["sampling"] = sampling
    server_argv = ["--model", args.model, "--max-batch-tokens", str(args.max_batch_tokens),
                   "--max-tokens", str(args.max_tokens)]
    if llama:
        server_argv += ["--engine", "llama.cpp", "--sequences", str(common["sequences"])]
        if args.ctx:
            server_argv += ["--ctx", str(args.ctx)]
        if args.kv:
            server_argv += ["--kv", args.kv]
        for key in ("cache_type_k", "cache_type_v"):
            if key in common:
                server_argv += ["--" + key.replace("_", "-"), common[key]]
    else:
        server_argv += ["--page", str(args.page)]
        if args.num_blocks:
            server_argv += ["--num-blocks", str(args.num_blocks)]
    for flag, v in (("--device", args.device), ("--dtype", args.dtype), ("--attn", args.attn),
                    ("--threads", args.threads), ("--tau", args.tau), ("--recent", args.recent)):
        if v is not None:
            server_argv += [flag, str(v)]
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    recs = []
    for row in rows:
        key = row_key(row, common)
        if key in done:
            say(f"{row.label}: reusing the finished row in {results}")
            recs.append(done[key])
            continue
        say(f"{row.label}: {args.requests} requests x {args.max_tokens} tokens at concurrency {args.concurrency}")
        rec = run_row(row, server_argv, prompts, args.concurrency, args.max_tokens, args.timeout,
                      log=out / f"server-{row.label.replace(' ', '_').replace('=', '')}.log", url=args.url, say=say,
                      sampling=sampling)
        rec.update(kind="serve", key=key, data=source, environment=_environment(), settings=common)
        with results.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        recs.append(rec)
        say(f"{row.label}: {rec['completed']}/{rec['requests']} completed, max in flight {rec['max_in_flight']}, "
            f"{rec['tokens_per_s']} tok/s, latency p50 {rec['latency_p50_s']} s, peak {peak_kv(rec)}")
    eq = []
    if args.equal_batch:
        from ..engine import eos_ids  # noqa: F401  (the model loads only for this part)
        from ..eval.prompts import get_protocol, build_prompt
        from ..eval.datasets import load_dataset

        ekey = json.dumps({"equal_batch": args.equal_batch, "tokens": args.equal_batch_tokens or args.max_tokens,
                           "rows": [r.label for r in rows], **common}, sort_keys=True)
        if ekey in done:
            say(f"equal batch: reusing the finished part in {results}")
            eq = done[ekey]["points"]
        else:
            import torch

            if args.threads:
                torch.set_num_threads(args.threads)
            lm = load(args)
            ds = load_dataset(args.data, data_dir=folder)
            ids = [build_prompt(lm.tokenizer, r["problem"], get_protocol("paper")) for r in ds.rows]
            ids = [x for x in ids if args.max_prompt_tokens is None or len(x) <= args.max_prompt_tokens]
            ids = ids[:args.equal_batch]
            eq = equal_batch(lm.model, lm.tokenizer, rows, lambda r: settings[r.policy], ids,
                             args.equal_batch_tokens or args.max_tokens, args.page, args.max_batch_tokens,
                             repeats=args.equal_batch_repeats, say=say)
            with results.open("a") as f:
                f.write(json.dumps({"kind": "equal_batch", "key": ekey, "points": eq,
                                    "environment": _environment()}) + "\n")
    text = table(recs, eq)
    how = (f"sampled (temperature {args.temperature:g}, top-p {args.top_p:g}, seed {args.seed} + i)" if sampling
           else "greedy")
    cache = ("a running server (--url)" if args.url else
             f"llama.cpp, {args.ctx} cells, {common['sequences']} sequences" if llama
             else f"page {args.page}, {args.num_blocks} blocks")
    head = (f"{args.model}, {cache}, {args.requests} requests x {args.max_tokens} "
            f"tokens (forced), concurrency {args.concurrency}, data {args.data}, {how}\n\n")
    (out / "table.md").write_text(head + text)
    if recs:
        plot(recs, out / "serve.png", head.strip())
    print(head + text)
    say(f"wrote {results}, {out / 'table.md'}" + (f", {out / 'serve.png'}" if recs else ""))
    return 0


def _environment() -> dict:
    import torch
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
           "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "loadavg": list(os.getloadavg())}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    return env


def _settings(args) -> dict:
    return {k: sorted(v) if isinstance(v, (set, frozenset)) else v for k, v in vars(args).items()
            if k not in ("run", "command", "bench")}


def _write(result: dict, out: str | None, plot) -> None:
    text = json.dumps(result, indent=1)
    if out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
        plot(result, path.with_suffix(".png"))
        print(f"wrote {path} and {path.with_suffix('.png')}", file=sys.stderr)
    else:
        print(text)


def _device_of(model) -> str:
    return str(model.get_input_embeddings().weight.device)


# bench speed's options that only the torch engine reads (name -> default): the transformers reference and the
# memory cap of the long runs' child processes (llama.cpp's long runs are in this process)
_SPEED_TORCH_ONLY = {"no_transformers": False, "cap_gib": 6.0}


def run_speed(args) -> int:
    import torch

    from ..bench.memory import Journal, run_long
    from ..bench.plots import plot_speed
    from ..bench.speed import build_configs, default_policies

    taus = [args.tau] if args.tau else args.taus
    llama = args.engine == "llama.cpp"
    if llama:
        from ..llamacpp import SUPPORTED
        from .engines import refuse_engine_options

        refuse_engine_options(args, _SPEED_TORCH_ONLY, "torch engine options; --engine llama.cpp has no transformers "
                                                       "reference and runs its long generations in this process")
        names = args.policies or [n for n in default_policies() if n in SUPPORTED]
    else:
        from .engines import refuse_engine_options

        refuse_engine_options(args, {"cache_type_k": "f16", "cache_type_v": "f16"}, "options of --engine llama.cpp")
        if args.threads:
            torch.set_num_threads(args.threads)
        names = args.policies or default_policies()
    # every name checked (and --set matched) before any model is loaded
    settings = settings_by_policy(args, list(dict.fromkeys(names + ([] if args.no_long else args.long_policies))))
    configs = build_configs(names, taus, settings.__getitem__)
    if args.gen_tokens < (args.round_steps or max(taus)):
        raise EpiKVError(f"--gen-tokens {args.gen_tokens} is shorter than one round "
                         f"({args.round_steps or max(taus)} steps); raise it or set --round-steps")
    if llama:
        return _run_speed_llamacpp(args, names, taus, configs, settings)
    lm = load(args)
    if not args.no_long:
        _check_context(lm.model, args.prompt_tokens, max(args.long_lengths))
    device = _device_of(lm.model)
    dtype = str(lm.model.dtype).replace("torch.", "")
    env_start = _environment()
    jr = Journal(args.out + ".jsonl" if args.out else None)  # finished budgets survive a killed run
    hb = _heartbeat("bench speed", "steps (rounds, long checkpoints)")
    try:
        hf = "full" in names and not args.no_transformers
        blocks = _budget_blocks(lm.model, configs, args, jr, hb, lambda k: [
            "speed", args.model, device, dtype, k, [c.label for c in configs] + (["transformers"] if hf else []),
            args.gen_tokens, args.round_steps, args.prompt_tokens, args.seed], transformers_reference=hf)
        long = []
        if not args.no_long:
            kl = args.long_budget or args.budgets[0]
            long = run_long(args.model, args.long_policies, kl, args.long_lengths, tau=taus[0], device=device,
                            dtype=args.dtype, cap_gib=args.cap_gib or None, seed=args.seed,
                            prompt_tokens=args.prompt_tokens, model=lm.model,
                            settings=settings.__getitem__, threads=args.threads,
                            on_point=lambda p: _tick(hb, f"long {p.get('policy')}: {_fmt_point(p)}"))
    finally:
        hb.close()
    result = {"kind": "speed", "engine": "torch", "model": args.model, "device": device, "dtype": dtype, "budgets": blocks,
              "long_budget": None if args.no_long else (args.long_budget or args.budgets[0]), "long": long,
              "environment": {"start": env_start, "end_loadavg": list(os.getloadavg())}, "settings": _settings(args)}
    _write(result, args.out, plot_speed)
    return 0


def _budget_blocks(model, configs, args, jr, hb, key_of, **kw) -> list[dict]:
    """bench speed's block per budget, taken from the journal when its key (key_of(K)) finished before."""
    from ..bench.speed import run_budget

    blocks = []
    for k in args.budgets:
        key = json.dumps(key_of(k))
        if key in jr.done:
            print(f"K={k}: reusing the finished record in {jr.path}", file=sys.stderr)
            blocks.append(jr.done[key]["block"])
            continue
        block = run_budget(model, configs, k, args.gen_tokens, args.round_steps, args.prompt_tokens, seed=args.seed,
                           on_round=lambda i, n: _tick(hb, f"K={k}: round {i}/{n}"), **kw)
        jr.add({"key": key, "block": block})
        blocks.append(block)
        _print_block(block)
    return blocks


def _run_speed_llamacpp(args, names, taus, configs, settings) -> int:
    """bench speed through the llama.cpp engine: the same rounds, ratios, long checkpoints and JSON (with "engine",
    and each row's context cells and KV bytes); policies llama.cpp cannot run are refused by name before any work."""
    from ..bench.memory import Journal
    from ..bench.plots import plot_speed
    from ..llamacpp import load_gguf
    from ..llamacpp.engine import check_model_policy, default_threads
    from ..bench.llamacpp import LlamaCppSpeed, long_generation
    from .engines import LlamaCppEngine

    LlamaCppEngine.refuse_torch_options(args)
    gm = load_gguf(args.model)
    for c in configs:
        check_model_policy(gm, c.make())
    if not args.no_long:
        from ..policies import get_policy

        for name in args.long_policies:
            check_model_policy(gm, get_policy(name, tau=taus[0], **settings[name]))
        if gm.n_ctx_train and args.prompt_tokens + max(args.long_lengths) > gm.n_ctx_train:
            raise EpiKVError(f"--prompt-tokens {args.prompt_tokens} + {max(args.long_lengths)} generated tokens "
                             f"exceeds the model's context limit of {gm.n_ctx_train} positions")
    from .engines import cache_setup

    type_k, type_v, fa = cache_setup(gm, args)  # refused in one line where llama.cpp would refuse them
    eng = LlamaCppSpeed(gm, threads=args.threads, type_k=type_k, type_v=type_v, flash_attn=fa)
    env_start = _environment()
    jr = Journal(args.out + ".jsonl" if args.out else None)  # finished budgets survive a killed run
    hb = _heartbeat("bench speed", "steps (rounds, long checkpoints)")
    try:
        blocks = _budget_blocks(eng, configs, args, jr, hb, lambda k: [
            "speed", "llama.cpp", args.model, args.threads, k, [c.label for c in configs], args.gen_tokens,
            args.round_steps, args.prompt_tokens, args.seed])
        long = []
        if not args.no_long:
            kl = args.long_budget or args.budgets[0]
            for name in args.long_policies:
                long += long_generation(eng, name, kl, args.long_lengths, tau=taus[0], prompt_tokens=args.prompt_tokens,
                                        seed=args.seed, settings=settings[name],
                                        on_point=lambda p: _tick(hb, f"long {p['policy']}: {_fmt_point(p)}"))
    finally:
        hb.close()
    from ..llamacpp.lib import system_info

    result = {"kind": "speed", "engine": "llama.cpp", "system_info": system_info(), "model": args.model,
              "device": "cpu", "dtype": "gguf",
              "threads": args.threads or default_threads(), "budgets": blocks,
              "long_budget": None if args.no_long else (args.long_budget or args.budgets[0]), "long": long,
              "environment": {"start": env_start, "end_loadavg": list(os.getloadavg())}, "settings": _settings(args)}
    _write(result, args.out, plot_speed)
    return 0


def _heartbeat(label: str, unit: str, total: int | None = None):
    """Plain progress lines every 20 s when stderr is not a terminal (the run's own lines stay as they are)."""
    from ..progress import Progress

    return Progress(label, total=total, unit=unit, bar=False)


def _tick(hb, line: str) -> None:
    hb.update(1)
    print(line, file=sys.stderr, flush=True)


def _check_context(model, prompt_tokens: int, generated: int) -> None:
    """A long generation may reach the model's context limit (SmolLM2: 8192 positions), not pass it: positions
    count every token seen, evicted or not."""
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    limit = getattr(cfg, "max_position_embeddings", None)
    if limit and prompt_tokens + generated > limit:
        raise EpiKVError(f"--prompt-tokens {prompt_tokens} + {generated} generated tokens exceeds the model's context "
                         f"limit of {limit} positions: the longest checkpoint can be {limit - prompt_tokens}")


def _fmt_point(p: dict) -> str:
    if p.get("status", "ok") != "ok":
        return f"{p['status']} {p.get('error', '')}"
    peak = f"peak {p['peak_gib']:.3f} GiB, " if "peak_gib" in p else ""  # llama.cpp's in-process runs have none
    return (f"{p['generated']} tokens, {p['segment_tokens_per_s']:.1f} tok/s, cache {p['cache_length']}, "
            f"{peak}KV buffers allocated "
            f"{p.get('kv_buffer_mib', float('nan')):.2f} MiB")  # the measure and name of the plot's KV panel


def _print_block(block: dict) -> None:
    print(f"K={block['budget']}: median ms per token over {block['rounds']} rounds of {block['round_steps']} steps",
          file=sys.stderr)
    for r in block["configs"]:
        print(f"  {r['label']:<22} {r['ms_per_token']:8.2f} ms  {r['tokens_per_s']:7.1f} tok/s", file=sys.stderr)
    for name, d in block["ratios"].items():
        print(f"  {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in d.items()), file=sys.stderr)


def run_memory(args) -> int:
    from ..bench.memory import MODES, run_memory as measure
    from ..bench.plots import plot_memory

    bad = [m for m in args.modes if m not in MODES]
    if bad:
        raise EpiKVError(f"unknown mode {bad[0]!r}; known: {', '.join(MODES)}")
    device = args.device or ("cuda" if (args.device_map or "").startswith("auto") else "cpu")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise EpiKVError("--device cuda was asked for, but no CUDA device is available")
    env = _environment()
    hb = _heartbeat("bench memory", "points", total=len(args.modes) * len(set(args.lengths)))
    try:
        res = measure(args.model, args.lengths, args.cap_gib or None, device=device, dtype=args.dtype,
                      attn=args.attn, modes=tuple(args.modes), seed=args.seed,
                      journal=(args.out + ".jsonl") if args.out else None, threads=args.threads,
                      on_point=lambda p: _tick(hb, _fmt_mem(p)))
    finally:
        hb.close()
    res.update(kind="memory", environment={"start": env, "end_loadavg": list(os.getloadavg())},
               settings=_settings(args))
    _write(res, args.out, plot_memory)
    return 0


def _fmt_mem(p: dict) -> str:
    if p["status"] == "ok":
        return f"{p['mode']:<12} n={p['n']:<6} peak {p['peak_gib']:.3f} GiB (+{p['delta_gib']:.3f})"
    return f"{p['mode']:<12} n={p['n']:<6} {p['status']}: {p.get('error', '')}"


def run_throughput(args) -> int:
    if args.engine == "llama.cpp":
        raise EpiKVError("bench throughput --engine llama.cpp: the llama.cpp engine decodes one sequence, so there is "
                         "no batch to fit under --cap-mib (bench speed --engine llama.cpp times it)")
    import torch

    from ..bench.memory import Journal
    from ..bench.plots import plot_throughput
    from ..bench.throughput import FULL, MIB, Plan, job_key, run_throughput as measure
    from ..data import data_dir
    from ..engine import eos_ids
    from ..eval.datasets import load_dataset
    from ..eval.prompts import build_prompt, get_protocol

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cap_mib <= 0:
        raise EpiKVError(f"--cap-mib must be positive, got {args.cap_mib:g}")
    names = list(dict.fromkeys(args.policies))
    if FULL not in names:
        raise EpiKVError("--policies must include full: every ratio is to full")
    settings = settings_by_policy(args, names)  # unknown names and stray --set refused before loading anything
    folder = args.data_dir or (str(data_dir()) if not args.data.endswith(".jsonl") else None)
    ds = load_dataset(args.data, data_dir=folder)
    if args.device and args.device.startswith("cuda") and not torch.cuda.is_available():
        raise EpiKVError("--device cuda was asked for, but no CUDA device is available")
    lm = load(args)
    tok = lm.tokenizer
    prompts = []
    for row in ds.rows:
        ids = (build_prompt(tok, row["problem"], get_protocol("paper")) if getattr(tok, "chat_template", None)
               else list(tok(row["problem"])["input_ids"]))
        if args.max_prompt_tokens is None or len(ids) <= args.max_prompt_tokens:
            prompts.append(ids)
        if len(prompts) == args.requests:
            break
    if len(prompts) < args.requests:
        limit = f" of at most {args.max_prompt_tokens} tokens" if args.max_prompt_tokens else ""
        raise EpiKVError(f"{ds.name} has only {len(prompts)} prompts{limit}; --requests is {args.requests}")
    plans = []
    for name in names:
        budgets = args.budgets if name != FULL else [None]
        for k in dict.fromkeys(budgets):
            plans.append(Plan.make(lm.model, name, k, args.tau, settings[name]))
    device = _device_of(lm.model)
    dtype = str(lm.model.dtype).replace("torch.", "")
    env_start = _environment()
    jr = Journal(args.out + ".jsonl" if args.out else None)  # finished batches survive a killed run

    def progress(c, j, rec):
        print(f"{c.plan.label} batch {c.batch} [{j + 1}/{len(c.jobs)}]: {rec['rows']} x {args.max_new_tokens} tokens "
              f"in {rec['seconds']:.1f} s ({rec['rows'] * args.max_new_tokens / rec['seconds']:.1f} tok/s), KV "
              f"{rec['kv_peak_bytes'] / MIB:.1f} MiB (predicted {rec['predicted_kv_bytes'] / MIB:.1f})", file=sys.stderr)

    res = measure(lm.model, tok, plans, prompts, args.max_new_tokens, args.cap_mib, ladder=args.ladder,
                  extra_batches=args.batch_sizes, ladder_full_set=args.ladder_full_set, eos=eos_ids(lm.model, tok),
                  journal=jr, job_key=job_key(args.model, device, dtype, args.max_new_tokens, args.cap_mib, settings),
                  on_job=progress)
    res.update(kind="throughput", model=args.model, device=device, dtype=dtype, data=ds.source,
               static_batches="requests run in static batches in dataset order: a request keeps its slot until its "
                              "batch ends; generation length forced (EOS ignored), so every policy does equal work; "
                              "static_waste_fraction = slot-steps after a request's first EOS plus empty slots of a "
                              "partial last batch, over all slot-steps",
               environment={"start": env_start, "end_loadavg": list(os.getloadavg())}, settings=_settings(args))
    _print_throughput(res)
    _write(res, args.out, plot_throughput)
    return 0


def _print_throughput(res: dict) -> None:
    print(f"cap {res['cap_mib']:g} MiB, {res['requests']} requests x {res['new_tokens']} tokens", file=sys.stderr)
    for label, s in res["search"].items():
        print(f"  {label:<16} max batch {s['max_batch']} ({s['fits_sequences_of_longest_prompt']} sequences of the "
              f"longest prompt fit)", file=sys.stderr)
    for p in res["points"]:
        t = p["time_all_requests_s"]
        print(f"  {p['label']:<16} b={p['batch']:<3} {p['aggregate_tokens_per_s']:8.1f} tok/s  "
              f"{p['per_sequence_tokens_per_s']:6.2f} tok/s/seq  "
              f"{'all in %.0f s' % t if t else 'first batch only'}  waste {p['static_waste_fraction']:.1%}",
              file=sys.stderr)
    for name, d in res["ratios"].items():
        for label, r in d.items():
            print(f"  {name} {label}: " + ", ".join(f"{k} {v:.3g}" for k, v in r.items()), file=sys.stderr)
