"""`epikv retention`: what each policy's compressed cache loses on real reasoning traces (runs on a CPU)."""

from __future__ import annotations

import sys
from pathlib import Path

from ..errors import EpiKVError
from .engines import add_engine_args, kv_memory_list, make_engine, memory_budget
from .common import add_model_args, add_policy_args, nonneg_int, out_dir, positive_int, settings_by_policy


def register(sub) -> None:
    p = sub.add_parser(
        "retention", help="retention benchmark: answer NLL, top-1 agreement and KL against the full cache",
        description="Stream reasoning traces through the model under each policy and budget (chunks of tau tokens), "
                    "score the answer after </think> with teacher forcing, and compare every prediction with the full "
                    "cache. Results are appended to OUT/results.jsonl (resumable; several processes may share OUT, each record "
                    "is computed once); a table and plots go to OUT. Each record is logged as [k/total]; when stderr "
                    "is not a terminal a progress line with the time left also appears every 20 s "
                    "($EPIKV_PROGRESS_SECONDS).")
    p.add_argument("--traces", default=None,
                   help="shared-28 (the 28 R1 traces shipped with epikv, the default) or a JSONL file of traces with id, "
                        "problem, trace")
    p.add_argument("--skip", type=nonneg_int, default=0,
                   help="skip the first N traces (with --limit: a slice), to split a run across processes or machines")
    p.add_argument("--limit", type=positive_int, default=None, help="only the first N traces (after --skip)")
    p.add_argument("--max-reasoning-tokens", type=positive_int, default=None,
                   help="keep only the first N reasoning tokens before </think> (CPU-sized runs)")
    p.add_argument("--max-answer-tokens", type=positive_int, default=None,
                   help="score only the first N answer tokens after </think> (CPU-sized runs)")
    p.add_argument("--system", default=None, help="system prompt of the chat-formatted problem (default: none)")
    p.add_argument("--out", required=True, type=out_dir, help="results folder (results.jsonl, retention.md, plots)")
    p.add_argument("--no-report", action="store_true", help="do not render the table and plots at the end")
    p.add_argument("--batch-traces", type=positive_int, default=1,
                   help="stream up to N traces with the same prompt length as one batch: the same records, 1.7x "
                        "the tokens per CPU-second at N = 4 on the embedded model (measured 1.69x; default 1: one at "
                        "a time)")
    add_model_args(p)
    g = add_engine_args(p, flash_attn=True, cache_types=True)
    g.add_argument(
        "--kv-memory", type=kv_memory_list, default=None, metavar="SIZE[,SIZE]",
        help="instead of --budgets (--engine llama.cpp): per policy, the largest budget whose peak (K + tau cells at "
             "the chosen types plus the policy's buffers) fits each size, e.g. 24MiB,48MiB; each pick is printed")
    add_policy_args(p, multi=True, own_default=True)
    p._option_string_actions["--tau"].help = "eviction interval: tokens per chunk fed between evictions (default 16)"
    p._option_string_actions["--policies"].help = (
        "comma-separated policies; a variant POLICY[SETTING=VALUE, ...] (e.g. epikv[reserve=16], the label the report "
        "prints) is another row, run against the same reference pass")
    p.set_defaults(run=run, tau=16, policies=["full", "epikv", "lag-kv", "streaming", "random"],
                   budgets=[256, 512, 1024])


def run(args) -> int:
    from ..data import traces_path
    from ..retention.report import render_retention
    from ..retention.runner import load_traces, run_retention
    from ..retention.store import read_records

    path = traces_path(args.traces)
    every_row = load_traces(path)
    if args.skip >= len(every_row):
        raise EpiKVError(f"--skip {args.skip}: {path} has only {len(every_row)} traces")
    rows = every_row[args.skip: args.skip + args.limit if args.limit else None]
    settings = settings_by_policy(args, args.policies, variants=True)  # validates names first
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise EpiKVError(f"--out {out} exists and is not a folder")
    eng = make_engine(args)
    if eng.name == "llama.cpp":
        from ..retention.llamacpp import LlamaCppTraces

        model = LlamaCppTraces(eng.gm, threads=args.threads, type_k=eng.type_k, type_v=eng.type_v,
                               flash_attn=eng.flash_attn)
    else:
        model = eng.lm.model
    # --kv-memory: each policy at its own budgets (the largest whose peak fits each size); else every policy at
    # --budgets. One pass either way: trace by trace, one reference pass for all its rows
    budgets_for = None
    if args.kv_memory is not None:
        from ..policies import get_policy
        from ..retention.runner import _name

        if "budgets" in (getattr(args, "given", None) or set()):
            raise EpiKVError("--kv-memory chooses the budgets: give --kv-memory or --budgets, not both")
        from ..retention.llamacpp import feed_chunk
        from ..retention.runner import prepare_traces

        # the plan knows the file's prompts (all of them: a --skip / --limit slice gets the same K) and how retention
        # feeds them: chunks (feed_chunk of the policy's tau), the prompt in micro-batches of the same (LlamaCppTraces)
        items, _ = prepare_traces(every_row, eng.tokenizer, args.max_reasoning_tokens, args.system,
                                  args.max_answer_tokens)
        longest = max((len(it.prompt_ids) for it in items), default=1)
        chosen = {}
        for spec in args.policies:
            if not get_policy(_name(spec)).evicts:
                chosen[spec] = args.budgets
                continue
            s = dict(settings[spec])
            tau = s.pop("tau", args.tau)
            chunk = feed_chunk(tau)  # as LlamaCppTraces feeds this policy
            chosen[spec] = sorted({memory_budget(eng.gm, args, _name(spec), tau, eng.type_k, eng.type_v, None,
                                                 kv_memory=m, plan={"step_tokens": chunk, "n_batch": chunk,
                                                                    "prompt_tokens": longest},
                                                 **s) for m in args.kv_memory})
        budgets_for = chosen.__getitem__
    for note in getattr(eng, "notes", ()):
        print(note, file=sys.stderr)
    summary = run_retention(model, eng.tokenizer, rows, out, args.policies, args.budgets, tau=args.tau,
                            max_reasoning_tokens=args.max_reasoning_tokens, system=args.system,
                            max_answer_tokens=args.max_answer_tokens, model_name=args.model,
                            settings_for=settings.__getitem__, batch_traces=args.batch_traces,
                            budgets_for=budgets_for)
    print(f"{summary['written']} records written, {summary['already_done']} already done, "
          f"{len(summary['skipped_traces'])} traces skipped, {len(summary['failed'])} runs not possible"
          + (f", {summary['claimed_elsewhere']} being computed by another process"
             if summary.get("claimed_elsewhere") else "") + f" -> {summary['results']}")
    if not args.no_report:
        written = render_retention(read_records(out / "results.jsonl"), out)
        print("report: " + ", ".join(str(w) for w in written))
    return 0
