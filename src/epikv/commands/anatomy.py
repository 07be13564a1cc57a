"""`epikv anatomy label|profile|bands`: counterfactual labels, per-layer profile, band file (METHOD.md section 5)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from ..errors import EpiKVError
from .common import add_model_args, load, nonneg_int, out_dir, out_file, positive_int


def register(sub) -> None:
    p = sub.add_parser("anatomy", help="occlusion labels, per-layer profile and band calibration",
                       description="Measure the two-band anatomy of a model on a task and calibrate the bands.")
    s = p.add_subparsers(dest="anatomy_command", metavar="STEP", parser_class=type(p))
    s.required = True

    lab = s.add_parser("label", help="counterfactual occlusion labels over reasoning traces")
    lab.add_argument("--traces", required=True,
                     help="shared-28 (the traces shipped with epikv) or a JSONL with prompt, trace (and is_correct) "
                          "per row")
    lab.add_argument("--label", choices=("nll", "flip"), default="nll",
                     help="nll: answer NLL increase (continuous, default); flip: regenerated answer changes")
    lab.add_argument("--window", type=positive_int, default=32, help="tokens occluded at once (default 32)")
    lab.add_argument("--stride", type=positive_int, default=16,
                     help="tokens between occluded windows (default 16; at most --window)")
    lab.add_argument("--filler", choices=("eos", "pad", "random"), default="eos",
                     help="occluding token: eos (default), pad (refused when the pad token is EOS, as in SmolLM2), "
                          "random (seeded random ids)")
    lab.add_argument("--regen-tokens", type=positive_int, default=512, help="flip: greedy answer tokens at most")
    lab.add_argument("--answer-tokens", type=positive_int, default=64,
                     help="answer tokens kept after the reasoning span (nll scores all of them)")
    lab.add_argument("--max-reasoning-tokens", type=nonneg_int, default=0,
                     help="cap each reasoning span to its first N tokens (0 = no cap)")
    lab.add_argument("--limit", type=positive_int, default=None, help="first N eligible traces only")
    lab.add_argument("--ids", default=None, help="comma-separated trace ids to label")
    lab.add_argument("--all-traces", action="store_true", help="flip: also label incorrect traces")
    lab.add_argument("--no-text", action="store_true", help="omit the decoded token texts from the records")
    lab.add_argument("--seed", type=nonneg_int, default=0, help="random filler seed")
    lab.add_argument("--out", required=True, type=out_dir, help="output folder (labels.jsonl, appended, resumable)")
    add_model_args(lab)
    _threads(lab)
    lab.set_defaults(run=run_label)

    pro = s.add_parser("profile", help="Spearman rho of every layer's g_l against the labels")
    pro.add_argument("--labels", required=True, help="folder written by `epikv anatomy label`")
    pro.add_argument("--smooth", type=positive_int, default=64, help="trailing mean of g_l (tokens)")
    pro.add_argument("--bootstrap", type=nonneg_int, default=1000, help="cluster-bootstrap resamples over traces")
    pro.add_argument("--seed", type=nonneg_int, default=0, help="bootstrap seed (default 0)")
    pro.add_argument("--out", required=True, type=out_dir, help="output folder: profile.json, profile.png")
    add_model_args(pro)
    _threads(pro)
    pro.set_defaults(run=run_profile, model=None)

    bands = s.add_parser("bands", help="choose band A / band B from a profile and write a band file")
    bands.add_argument("--profile", required=True, help="profile folder or profile.json")
    bands.add_argument("--stat", choices=("trace_mean", "pooled", "partial_position"),
                       default="trace_mean", help="which rho picks the bands (partial_position: position partialled out)")
    bands.add_argument("--frac", type=float, default=0.5, help="band = run of layers with >= frac of the peak rho")
    bands.add_argument("--out", required=True, type=out_file, help="band file to write (read by --bands-file)")
    bands.set_defaults(run=run_bands)


def _threads(p) -> None:
    p.add_argument("--threads", type=positive_int, default=1,
                   help="torch CPU threads (default 1: on a shared CPU, more threads can be ~10x slower)")


def _set_threads(args) -> None:
    import torch

    torch.set_num_threads(args.threads)


def read_records(path: Path) -> list[dict]:
    """Records of a labels.jsonl; a torn last line (killed run) is ignored."""
    from ..store import read_records as read  # the shared JSONL rules: never modifies the file

    return read(path)


def run_label(args) -> int:
    from ..progress import Progress
    from ..store import Store

    from ..anatomy.labels import Spans, filler_token, occlusion_labels, tokenize_trace, windows
    from ..data import read_jsonl, traces_path

    if args.stride > args.window:
        raise EpiKVError(f"--stride {args.stride} is larger than --window {args.window}: tokens would be skipped")
    rows = read_jsonl(traces_path(args.traces), required=("id", "prompt", "trace"))
    if args.label == "flip" and not args.all_traces:
        rows = [r for r in rows if r.get("is_correct", True)]  # the authors label correct traces only
    if args.ids:
        want = [x.strip() for x in args.ids.split(",") if x.strip()]
        missing = sorted(set(want) - {r["id"] for r in rows})
        if missing:
            raise EpiKVError(f"trace id(s) not found (or not eligible): {', '.join(missing)}")
        rows = [r for r in rows if r["id"] in want]
    rows = rows[: args.limit] if args.limit else rows
    if not rows:
        raise EpiKVError(f"no eligible traces in {args.traces}")
    out = Path(args.out)
    path = out / "labels.jsonl"
    settings = {"window": args.window, "stride": args.stride, "answer_tokens": args.answer_tokens,
                "max_reasoning_tokens": args.max_reasoning_tokens or None, "regen_tokens": args.regen_tokens,
                "seed": args.seed}
    done = {(r["id"]) for r in read_records(path)
            if r.get("label") == args.label and r.get("filler") == args.filler and r.get("settings") == settings}
    todo = [r for r in rows if r["id"] not in done]
    print(f"{len(rows) - len(todo)} of {len(rows)} traces already labelled in {path}; {len(todo)} to go")
    if not todo:
        return 0
    _set_threads(args)
    lm = load(args)
    tok = lm.tokenizer
    filler_token(tok, args.filler)  # refuse pad == eos before any work
    prepared = [(r, *tokenize_trace(tok, r, args.answer_tokens, args.max_reasoning_tokens or None)) for r in todo]
    total = sum(len(windows(sp.r0, sp.r1, args.window, args.stride)) for _, _, _, sp, _ in prepared)
    out.mkdir(parents=True, exist_ok=True)
    # a record's cell: the trace under these label settings (claimed, so concurrent runs never label it twice)
    cell = lambda r: (r["id"], r.get("label"), r.get("filler"), json.dumps(r.get("settings"), sort_keys=True))  # noqa: E731
    with Store(out, path.name, cell) as store, Progress("anatomy label", total, unit="windows") as bar:
        for row, ids, offs, sp, n_reason in prepared:
            if not store.claim([(row["id"], args.label, args.filler, json.dumps(settings, sort_keys=True))]):
                bar.skip(len(windows(sp.r0, sp.r1, args.window, args.stride)))  # done or taken by another process
                continue
            bar.set_postfix_str(row["id"][-40:])
            t0 = time.perf_counter()
            res = occlusion_labels(lm.model, tok, ids, Spans(sp.r0, sp.r1, sp.a1), kind=args.label,
                                   window=args.window, stride=args.stride, filler=args.filler,
                                   regen_tokens=args.regen_tokens, seed=args.seed, progress=bar)
            rec = {"id": row["id"], "model": lm.name, "label": args.label, "filler": args.filler,
                   "filler_id": res.pop("filler_id"), "filler_token": res.pop("filler_token"), "settings": settings,
                   "source_correct": row.get("is_correct"), "token_ids": ids, "offsets": offs,
                   "reasoning": [sp.r0, sp.r1], "answer": [sp.r1, sp.a1],
                   "truncated_from": n_reason if n_reason > sp.r1 - sp.r0 else None, **res,
                   "seconds": round(time.perf_counter() - t0, 2)}
            if not args.no_text:
                rec["tokens"] = [tok.decode([t]) for t in ids]
            store.append([rec])
    print(f"wrote {path}")
    return 0


def run_profile(args) -> int:
    import numpy as np

    from ..anatomy.plots import plot_profile
    from ..anatomy.profile import layer_deltas, positional_trend, profile_stats, trace_arrays

    lpath = Path(args.labels)
    lpath = lpath / "labels.jsonl" if lpath.is_dir() else lpath
    if not lpath.exists():
        raise EpiKVError(f"{lpath} does not exist (run `epikv anatomy label` first)")
    recs = read_records(lpath)
    if not recs:
        raise EpiKVError(f"{lpath} holds no label records")
    kinds = {(r.get("label"), r.get("model")) for r in recs}
    if len(kinds) > 1:
        raise EpiKVError(f"{lpath} mixes label kinds or models {sorted(map(str, kinds))}: profile one at a time")
    label, model_name = kinds.pop()
    args.model = args.model or model_name
    _set_threads(args)
    lm = load(args)
    traces = []
    for r in recs:
        if sum(v is not None for v in r["labels"]) < 3:
            continue
        traces.append(trace_arrays(r, layer_deltas(lm.model, r["token_ids"]), args.smooth))
    if len(traces) < 2:
        raise EpiKVError("need at least two labelled traces for a profile with intervals")
    st = profile_stats(traces, n_boot=args.bootstrap, seed=args.seed)
    trend = positional_trend(traces)
    f = lambda v: None if not np.isfinite(v) else round(float(v), 5)  # noqa: E731
    layers = [{"layer": l, "pooled": f(st["pooled"][l]), "pooled_ci": [f(v) for v in st["pooled_ci"][l]],
               "trace_mean": f(st["trace_mean"][l]), "trace_mean_ci": [f(v) for v in st["trace_mean_ci"][l]],
               "partial_position": f(st["partial_mean"][l]),
               "partial_position_ci": [f(v) for v in st["partial_mean_ci"][l]],
               "n_traces_finite": int(st["n_valid"][l]), "rho_position": f(trend["rho_position"][l]),
               "rho_position_smoothed": f(trend["rho_position_smoothed"][l])}
              for l in range(len(st["pooled"]))]
    profile = {"model": lm.name, "label": label, "labels_file": str(lpath), "n_traces": len(traces),
               "n_tokens": int(sum(len(t.y) for t in traces)), "smooth": args.smooth, "bootstrap": args.bootstrap,
               "seed": args.seed, "level": 0.95, "layers": layers,
               "per_trace": {t.id: [f(v) for v in st["per_trace"][k]] for k, t in enumerate(traces)},
               "positional_trend": {"bins": trend["bins"], "rho_position": [f(v) for v in trend["rho_position"]],
                                    "rho_position_smoothed": [f(v) for v in trend["rho_position_smoothed"]],
                                    "rho_label_position": f(trend["rho_label_position"]),
                                    "mean_g": [[f(v) for v in row] for row in trend["mean_g"]]}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile.json").write_text(json.dumps(profile, indent=1) + "\n")
    plot_profile(profile, str(out / "profile.png"))
    order = sorted((r for r in layers if r["trace_mean"] is not None), key=lambda r: r["trace_mean"])
    for r in order[-3:][::-1] + order[:3]:
        print(f"layer {r['layer']:>3}: mean per-trace rho {r['trace_mean']:+.3f} {r['trace_mean_ci']}, "
              f"pooled {r['pooled']:+.3f} {r['pooled_ci']}, position-partialled {r['partial_position']} "
              f"{r['partial_position_ci']}")
    print(f"wrote {out / 'profile.json'} and {out / 'profile.png'} ({len(traces)} traces)")
    return 0


def run_bands(args) -> int:
    from ..anatomy.bands import write_bands

    b = write_bands(args.profile, args.out, args.stat, args.frac)
    print(f"layers A,B = {b['layers'][0]},{b['layers'][1]}; band A {b['band_a']} (supported: "
          f"{b['supported']['band_a']}), band B {b['band_b']} (supported: {b['supported']['band_b']}); wrote {args.out}")
    return 0
