"""`epikv policies`: every registered policy with its properties."""

from __future__ import annotations

import dataclasses
import json


def register(sub) -> None:
    p = sub.add_parser("policies", help="list the eviction policies",
                       description="List every eviction policy: whether it reads attention scores, what it observes "
                                   "on the embedded SmolLM2 (30 blocks), its own settings' defaults; --wide adds its "
                                   "granularity, paper and rule, --json everything.")
    p.add_argument("--json", action="store_true", help="print a JSON list")
    p.add_argument("--wide", action="store_true", help="also granularity, paper and rule (a wide terminal)")
    p.set_defaults(run=run)


def own_defaults(row: dict) -> str:
    """The settings a policy adds to the ones every policy has (tau, recent, protect_prompt, n_sink, page)."""
    from ..policies import Policy

    common = {f.name for f in dataclasses.fields(Policy)}
    return " ".join(f"{k}={json.dumps(v)}" for k, v in row["defaults"].items() if k not in common)


def run(args) -> int:
    from ..policies import REGISTRY, load_policy_plugins

    load_policy_plugins()  # a plugin named in EPIKV_POLICIES that fails to load is an error, not a shorter list
    rows = [cls().describe() for cls in REGISTRY.values()]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    from rich import box
    from rich.console import Console
    from rich.table import Table

    t = Table(title="epikv policies", box=box.SIMPLE_HEAD, caption="attention-free: reads no attention scores "
              "(no weights, no recomputed q.K); eager: switches the model to eager attention. Every policy also has "
              "tau, recent, protect_prompt, n_sink, page (--json: all defaults)")
    t.add_column("name", no_wrap=True)
    t.add_column("attention-free", no_wrap=True)
    t.add_column("observes (SmolLM2, 30 blocks)", overflow="fold")
    t.add_column("own settings (defaults)", overflow="fold")
    if args.wide:
        for col in ("granularity", "paper", "rule"):
            t.add_column(col, overflow="fold")
    for r in rows:
        free = "yes" if r["attention_free"] else ("no, eager" if r["attention_kernel"] == "eager" else "no")
        cells = [r["name"], free, r["observes"].split(" (for a ")[0], own_defaults(r)]
        if args.wide:
            cells += [r["granularity"], r["paper"], r["doc"]]
        t.add_row(*cells)
    Console().print(t)
    return 0
