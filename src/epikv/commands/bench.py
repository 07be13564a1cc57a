"""`epikv bench speed|memory`: decode throughput ratios per policy, and the single-pass memory wall."""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

from ..errors import EpiKVError
from .common import add_model_args, add_policy_args, int_list, load, name_list, nonneg_float, positive_int, settings_by_policy


def register(sub) -> None:
    p = sub.add_parser("bench", help="performance benchmarks: decode speed and the memory wall",
                       description="Performance benchmarks, measured through the engine's Decoder.")
    bsub = p.add_subparsers(dest="bench", metavar="BENCH")
    bsub.required = True

    s = bsub.add_parser("speed", help="decode throughput per policy at equal budget, as ratios",
                        description="Interleaved decode timing of every policy (and tau) at each budget K, plus long "
                                    "generations of full vs epikv. Prints / writes JSON.")
    add_model_args(s)
    add_policy_args(s, multi=True)
    s.add_argument("--taus", type=int_list, default=[1, 128], help="eviction intervals to time (default 1,128)")
    s.add_argument("--gen-tokens", type=positive_int, default=512, help="timed decode steps per config and budget")
    s.add_argument("--round-steps", type=positive_int, default=None,
                   help="steps per interleaved round (default: the largest tau)")
    s.add_argument("--prompt-tokens", type=positive_int, default=64, help="protected prompt length")
    s.add_argument("--long-lengths", type=int_list, default=[512, 1024, 2048],
                   help="checkpoints (generated tokens) of the long generations")
    s.add_argument("--long-policies", type=name_list, default=["full", "epikv"])
    s.add_argument("--long-budget", type=positive_int, default=None, help="budget K of the long runs (default: first)")
    s.add_argument("--no-long", action="store_true", help="skip the long generations")
    s.add_argument("--cap-gib", type=nonneg_float, default=6.0, help="memory cap of each CPU child process (GiB)")
    s.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--out", default=None, help="write the JSON here (and a PNG next to it); default: stdout only")
    s.set_defaults(run=run_speed, policies=None, budgets=[512])

    m = bsub.add_parser("memory", help="peak memory of one forward pass: attention weights vs attention-free",
                        description="Peak memory (or OOM / over-cap) of one forward pass over n tokens: eager + "
                                    "attention weights of every layer against SDPA + hidden states at two blocks.")
    add_model_args(m)
    m.add_argument("--lengths", type=int_list, default=[2048, 4096, 8192, 16384, 32768, 65536])
    m.add_argument("--modes", type=name_list, default=["eager+attn", "sdpa+hidden"])
    m.add_argument("--cap-gib", type=nonneg_float, default=None,
                   help="memory cap per point (required on CPU; on CUDA a point above it is reported over-cap)")
    m.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads in each child")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--out", default=None, help="write the JSON here (and a PNG next to it); default: stdout only")
    m.set_defaults(run=run_memory)


def _environment() -> dict:
    import torch
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
           "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "loadavg": list(os.getloadavg())}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    return env


def _settings(args) -> dict:
    return {k: v for k, v in vars(args).items() if k not in ("run", "command", "bench")}


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


def run_speed(args) -> int:
    import torch

    from ..bench.memory import Journal, run_long
    from ..bench.plots import plot_speed
    from ..bench.speed import build_configs, default_policies, run_budget

    if args.threads:
        torch.set_num_threads(args.threads)
    taus = [args.tau] if args.tau else args.taus
    names = args.policies or default_policies()
    # every name checked (and --set matched) before any model is loaded
    settings = settings_by_policy(args, list(dict.fromkeys(names + ([] if args.no_long else args.long_policies))))
    configs = build_configs(names, taus, settings.__getitem__)
    if args.gen_tokens < (args.round_steps or max(taus)):
        raise EpiKVError(f"--gen-tokens {args.gen_tokens} is shorter than one round "
                         f"({args.round_steps or max(taus)} steps); raise it or set --round-steps")
    lm = load(args)
    device = _device_of(lm.model)
    dtype = str(lm.model.dtype).replace("torch.", "")
    env_start = _environment()
    jr = Journal(args.out + ".jsonl" if args.out else None)  # finished budgets survive a killed run
    blocks = []
    for k in args.budgets:
        key = json.dumps(["speed", args.model, device, dtype, k, [c.label for c in configs], args.gen_tokens,
                          args.round_steps, args.prompt_tokens, args.seed])
        if key in jr.done:
            print(f"K={k}: reusing the finished record in {jr.path}", file=sys.stderr)
            blocks.append(jr.done[key]["block"])
            continue
        block = run_budget(lm.model, configs, k, args.gen_tokens, args.round_steps, args.prompt_tokens, seed=args.seed,
                           on_round=lambda i, n: print(f"K={k}: round {i}/{n}", file=sys.stderr))
        jr.add({"key": key, "block": block})
        blocks.append(block)
        _print_block(block)
    long = []
    if not args.no_long:
        kl = args.long_budget or args.budgets[0]
        long = run_long(args.model, args.long_policies, kl, args.long_lengths, tau=taus[0], device=device,
                        dtype=args.dtype, cap_gib=args.cap_gib or None, seed=args.seed,
                        prompt_tokens=args.prompt_tokens, model=lm.model,
                        settings=settings.__getitem__, threads=args.threads,
                        on_point=lambda p: print(f"long {p.get('policy')}: {_fmt_point(p)}", file=sys.stderr))
    result = {"kind": "speed", "model": args.model, "device": device, "dtype": dtype, "budgets": blocks,
              "long_budget": None if args.no_long else (args.long_budget or args.budgets[0]), "long": long,
              "environment": {"start": env_start, "end_loadavg": list(os.getloadavg())}, "settings": _settings(args)}
    _write(result, args.out, plot_speed)
    return 0


def _fmt_point(p: dict) -> str:
    if p.get("status", "ok") != "ok":
        return f"{p['status']} {p.get('error', '')}"
    return (f"{p['generated']} tokens, {p['segment_tokens_per_s']:.1f} tok/s, cache {p['cache_length']}, "
            f"peak {p.get('peak_gib', float('nan')):.3f} GiB")


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
    res = measure(args.model, args.lengths, args.cap_gib or None, device=device, dtype=args.dtype, attn=args.attn,
                  modes=tuple(args.modes), seed=args.seed, journal=(args.out + ".jsonl") if args.out else None,
                  threads=args.threads, on_point=lambda p: print(_fmt_mem(p), file=sys.stderr))
    res.update(kind="memory", environment={"start": env, "end_loadavg": list(os.getloadavg())},
               settings=_settings(args))
    _write(res, args.out, plot_memory)
    return 0


def _fmt_mem(p: dict) -> str:
    if p["status"] == "ok":
        return f"{p['mode']:<12} n={p['n']:<6} peak {p['peak_gib']:.3f} GiB (+{p['delta_gib']:.3f})"
    return f"{p['mode']:<12} n={p['n']:<6} {p['status']}: {p.get('error', '')}"
