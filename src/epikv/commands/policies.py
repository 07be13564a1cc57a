"""`epikv policies`: every registered policy with its properties."""

from __future__ import annotations

import json


def register(sub) -> None:
    p = sub.add_parser("policies", help="list the eviction policies", description="List every eviction policy.")
    p.add_argument("--json", action="store_true", help="print a JSON list")
    p.set_defaults(run=run)


def run(args) -> int:
    from ..policies import REGISTRY, load_policy_plugins

    load_policy_plugins()  # a plugin named in EPIKV_POLICIES that fails to load is an error, not a shorter list
    rows = [cls().describe() for cls in REGISTRY.values()]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    from rich.console import Console
    from rich.table import Table

    t = Table(title="epikv policies")
    for col in ("name", "attention-free", "granularity", "observes", "paper", "rule"):
        t.add_column(col, overflow="fold")
    for r in rows:
        t.add_row(r["name"], "yes" if r["attention_free"] else "no", r["granularity"],
                  r["observes"].replace(" (for a 32-block model)", ""), r["paper"], r["doc"])
    Console().print(t)
    return 0
