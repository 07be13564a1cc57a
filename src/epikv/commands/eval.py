"""`epikv eval`: accuracy sweeps (dataset x policies x budgets x samples), graded, resumable, local or on Ray."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..errors import EpiKVError
from .common import add_model_args, add_policy_args, load, nonneg_int, out_dir, positive_int, settings_by_policy, warn


def shard_arg(text: str) -> tuple[int, int]:
    """'i/n' with 0 <= i < n (SLURM_ARRAY_TASK_ID style, zero-based)."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a shard like 0/4, got {text!r}") from None
    if n < 1 or not 0 <= i < n:
        raise argparse.ArgumentTypeError(f"shard i/n needs 0 <= i < n, got {text!r}")
    return i, n


def register(sub) -> None:
    p = sub.add_parser("eval", help="reasoning accuracy sweeps over policies and budgets",
                       description="Generate, grade and record every (problem, policy, budget, sample) cell. "
                                   "Rerunning the same command resumes; records go to OUT/records*.jsonl. "
                                   "Several processes may share OUT: each cell runs once (claimed under a lock). "
                                   "Progress: a bar on a terminal, a plain line every 20 s otherwise "
                                   "($EPIKV_PROGRESS_SECONDS).")
    p.add_argument("--dataset", required=True,
                   help="math500 | aime2024 | aime2025 | gsm8k (shipped with epikv) | hf:NAME (from the hub) | PATH.jsonl")
    p.add_argument("--data-dir", default=None,
                   help="folder with local copies of the named datasets (default: $EPIKV_DATA_DIR, else the copy shipped with epikv)")
    p.add_argument("--protocol", choices=["paper", "r1"], default="paper",
                   help="paper: system prompt, greedy, 8192 / 16384 token caps (default); r1: <think> prompt, sampled")
    p.add_argument("--limit", type=positive_int, default=None, help="first N problems only")
    p.add_argument("--samples", type=positive_int, default=1, help="samples per problem (r1 protocol: pass@1)")
    p.add_argument("--max-new-tokens", type=positive_int, default=None,
                   help="token cap (default: the protocol's, e.g. 8192 MATH-500 / 16384 AIME for paper)")
    p.add_argument("--seed", type=nonneg_int, default=0,
                   help="base sampling seed (each problem and sample: a stable hash of seed, id and sample)")
    p.add_argument("--batch-size", type=positive_int, default=1,
                   help="problems decoded together (left padding); a sampled protocol decodes each alone unless "
                        "--batch-sampled")
    p.add_argument("--batch-sampled", action="store_true",
                   help="batch sampled sequences too (faster on a GPU; a sample may then change with its batch mates)")
    p.add_argument("--out", required=True, type=out_dir, help="output directory (config.json + records*.jsonl)")
    p.add_argument("--shard", type=shard_arg, default=None, help="run only shard i of n (0-based), e.g. 0/4")
    p.add_argument("--executor", choices=["local", "ray"], default="local",
                   help="local: cells run in this process (default); ray: spread over a Ray cluster")
    p.add_argument("--workers", type=positive_int, default=None, help="Ray workers (default: one per CPU/GPU)")
    p.add_argument("--ray-address", default=None, help="Ray cluster address (default: start a local instance)")
    p.add_argument("--gpus-per-worker", type=float, default=None, help="default 1 when --device is cuda, else 0")
    p.add_argument("--no-text", action="store_true", help="do not store the generated text in the records")
    p.add_argument("--quiet", action="store_true", help="no progress bar or progress lines")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="CPU threads per process for torch (1 avoids oversubscription on a shared machine)")
    add_model_args(p)
    add_policy_args(p, multi=True)
    p.set_defaults(run=run)


def canonical_dataset(name: str | None) -> str | None:
    """A named dataset's canonical name for its local file's name or stem (`gsm8k_test.jsonl` -> `gsm8k`)."""
    from ..eval.datasets import DATASETS

    if name is None or name in DATASETS:
        return name
    for key, info in DATASETS.items():
        if Path(name).name in (info.file, Path(info.file).stem):
            return key
    return name


def effective_settings(tau, policy_args: dict, policies: list[str]) -> dict:
    """Each policy's settings as it really runs ({"epikv.tau": 1, "epikv.recent": None, ...}), from a config's
    tau and policy_args: defaults written out (`--tau 1`) and left out are the same configuration."""
    import dataclasses

    from ..policies import get_policy
    from .common import policy_setting, policy_settings

    pa = policy_args or {}
    ns = argparse.Namespace(
        recent=pa.get("recent"), n_sink=pa.get("n_sink"), no_protect_prompt=bool(pa.get("no_protect_prompt")),
        layers=tuple(pa["layers"]) if pa.get("layers") else None,
        bands=tuple(tuple(b) for b in pa["bands"]) if pa.get("bands") else None, bands_file=pa.get("bands_file"),
        set=[policy_setting(x) for x in pa.get("set") or []])
    out = {}
    for p in policies:
        pol = get_policy(p, tau=tau, **policy_settings(ns, p))
        out.update({f"{p}.{k}": v for k, v in dataclasses.asdict(pol).items()})
    return out


def normaliser(policies: list[str], dtype: str):
    """Canonical form of a config.json for comparison: the dataset's canonical name, the dtype the model really has,
    and the effective settings of the policies this command runs instead of how they were written."""

    def norm(cfg: dict) -> dict:
        c = dict(cfg)
        c["dataset"] = canonical_dataset(c.get("dataset"))
        c["dtype"] = c.get("dtype") or dtype
        try:
            eff = effective_settings(c.get("tau"), c.get("policy_args") or {}, policies)
        except (EpiKVError, argparse.ArgumentTypeError):  # e.g. a bands file that is gone: compare as written
            return c
        c.pop("tau", None), c.pop("policy_args", None)
        c.update(eff)
        return c

    return norm


def run(args) -> int:
    from ..eval.datasets import DATASETS, load_dataset
    from ..eval.prompts import get_protocol
    from ..eval.report import summarize, table_text
    from ..eval.records import read_records
    from ..eval.runner import EvalSpec, prepare, run_local

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    protocol = get_protocol(args.protocol)
    if args.samples > 1 and protocol.temperature == 0:
        raise EpiKVError("--samples > 1 needs sampling: greedy samples are identical (use --protocol r1)")
    batch_size = args.batch_size
    if args.batch_sampled and (protocol.temperature == 0 or args.batch_size == 1):
        raise EpiKVError("--batch-sampled only applies to a sampled protocol (r1) with --batch-size > 1")
    if protocol.temperature > 0 and batch_size > 1 and not args.batch_sampled:
        # a padded batch's shapes change the rounding of every row, and a sampled token near a CDF boundary with it
        warn(args, f"protocol {protocol.name} samples: each sequence is decoded alone, so its sample does not "
                   "depend on its batch (--batch-size applies to greedy protocols; --batch-sampled batches them)")
        batch_size = 1
    settings = settings_by_policy(args, args.policies)
    ds = load_dataset(args.dataset, data_dir=args.data_dir)
    canonical = canonical_dataset(args.dataset if args.dataset in DATASETS else ds.name)
    named = DATASETS.get(canonical)
    if named is not None and args.dataset not in DATASETS:  # a named set given by its file: the same dataset
        ds.name, ds.integer = canonical, named.integer
    fingerprint = ds.fingerprint()
    ds.rows = ds.rows[: args.limit] if args.limit else ds.rows
    max_new = args.max_new_tokens or (named.max_new_tokens[protocol.name] if named else 8192)
    model_kwargs = dict(dtype=args.dtype, device=args.device, device_map=args.device_map,
                        attn_implementation=args.attn)
    spec = EvalSpec(dataset=ds.name, integer=ds.integer, model=args.model, model_kwargs=model_kwargs,
                    threads=args.threads,
                    protocol=protocol, max_new_tokens=max_new, tau=args.tau, seed=args.seed, settings=settings,
                    store_text=not args.no_text)
    lm = load(args)
    dtype = str(next(lm.model.parameters()).dtype).replace("torch.", "")
    config = {
        "dataset": ds.name, "data_fingerprint": fingerprint, "model": args.model, "dtype": args.dtype or dtype,
        "protocol": protocol.name, "system": protocol.system, "temperature": protocol.temperature,
        "top_p": protocol.top_p, "max_new_tokens": max_new, "seed": args.seed, "tau": args.tau,
        "policy_args": {"recent": args.recent, "n_sink": args.n_sink, "no_protect_prompt": args.no_protect_prompt,
                        "layers": list(args.layers) if args.layers else None,
                        "bands": [list(b) for b in args.bands] if args.bands else None,
                        "bands_file": args.bands_file,
                        # --set: absent when unused, so folders written before the option still resume
                        **({"set": sorted(f"{n}.{k}={json.dumps(v)}" for n, k, v in args.set)} if args.set else {})},
    }
    out = Path(args.out)
    plan = prepare(out, ds, spec, args.policies, args.budgets, args.samples, batch_size, args.shard,
                   lm.tokenizer, config, normaliser(args.policies, dtype))
    name = f"records-{args.shard[0]}of{args.shard[1]}.jsonl" if args.shard else "records.jsonl"
    if not plan.batches:
        print(f"{out}: every cell is already done")
    elif args.executor == "ray":
        from ..eval.ray_executor import run_ray

        del lm  # the driver only plans; workers load their own copy
        gpus = args.gpus_per_worker if args.gpus_per_worker is not None else \
            (1.0 if (args.device or "").startswith("cuda") else 0.0)
        n = run_ray(plan, out / name, workers=args.workers, address=args.ray_address, gpus_per_worker=gpus,
                    quiet=args.quiet)
        print(f"{out}: {n} generations on Ray")
    else:
        n = run_local(plan, lm, out / name, quiet=args.quiet)
        print(f"{out}: {n} generations")
    print(table_text(summarize(read_records(out))))
    return 0
