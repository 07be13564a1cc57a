"""`epikv policies`: every registered policy, one line each (--wide: its settings, granularity, paper and rule)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import textwrap

ENGINES = ("torch", "hybrid", "serve", "llama.cpp")
ENGINE_NOTE = ("runs in: torch = `epikv generate`, `epikv.generate`, EpiKVCache; hybrid = the same on a model with "
               "sliding-window layers (Gemma-3, GPT-OSS, Ministral); serve = `epikv serve` (torch, paged); llama.cpp "
               "= --engine llama.cpp (generate and serve).")


def register(sub) -> None:
    p = sub.add_parser("policies", help="list the eviction policies",
                       description="List every eviction policy, one line each: whether it reads attention scores, "
                                   "the engines it runs in and what it reads; --wide adds its own settings' defaults, "
                                   "granularity, paper and rule, --json everything.")
    p.add_argument("--json", action="store_true", help="print a JSON list (every field and default)")
    p.add_argument("--wide", action="store_true",
                   help="under each policy its own settings (defaults), granularity, paper and rule")
    p.set_defaults(run=run)


def own_defaults(row: dict) -> str:
    """The settings a policy adds to the ones every policy has (tau, recent, protect_prompt, n_sink, page), as
    SETTING=VALUE words without spaces (so wrapping never cuts one)."""
    from ..policies import Policy

    common = {f.name for f in dataclasses.fields(Policy)}
    return " ".join(f"{k}={json.dumps(v, separators=(',', ':'))}" for k, v in row["defaults"].items()
                    if k not in common)


# hooks.py and llamacpp/ import torch, which this command never loads: their refusal rules are restated here, and
# tests/test_cli.py holds them equal to epikv.support's checks (the engines' own) for every registered policy.
def _hybrid_ok(pol, n_layers: int = 32) -> bool:
    """hooks._check_hybrid_policy: one token set per sequence, no attention weights, no recomputed queries."""
    obs = pol.observes(n_layers)
    return (pol.granularity == "token" and not obs.attention_layers and not obs.queries
            and not (pol.evicts and pol.uncompressed_layers(n_layers)))


def _llamacpp_ok(pol, n_layers: int = 32) -> bool:
    """llamacpp.engine.check_policy: no attention weights, token granularity, no pre-RoPE queries."""
    obs = pol.observes(n_layers)
    return (not obs.attention_layers and pol.granularity == "token"
            and not (pol.evicts and pol.uncompressed_layers(n_layers)) and not (obs.queries and obs.pre_rope))


def runs_in(pol) -> list[str]:
    """The engines (ENGINES) that run this policy object."""
    from ..support import serve_torch_refusal, torch_refusal

    torch = torch_refusal(pol) is None  # a hybrid model runs in the torch engine: what it refuses, hybrid does too
    ok = {"torch": torch, "hybrid": torch and _hybrid_ok(pol), "serve": serve_torch_refusal(pol) is None,
          "llama.cpp": _llamacpp_ok(pol)}
    return [e for e in ENGINES if ok[e]]


def reads(pol, n_layers: int = 30) -> str:
    """What a policy reads, in a few words (the blocks and counts: --wide, --json)."""
    obs = pol.observes(n_layers)
    parts = []
    if obs.hidden_layers:
        parts.append("hidden")  # hidden states; short, so the longest names' rows stay within 80 columns
    if obs.attention_layers:
        parts.append("attention weights")
    if (obs.keys_values and obs.kv_layers != ()) or obs.arriving_kv:
        parts.append({"k": "keys", "v": "values"}.get(obs.kv_parts, "keys+values"))
    if obs.queries:
        parts.append("q.K")  # recomputed queries against the cached keys
    return ", ".join(parts) or "nothing"


def _free(r: dict) -> str:
    return "yes" if r["attention_free"] else ("no, eager" if r["attention_kernel"] == "eager" else "no")


def _wrap(text: str, width: int, indent: str) -> list[str]:
    """Lines of at most `width` characters, broken between words only (a word longer than a line stands alone)."""
    return textwrap.wrap(text, width=max(width, 20), initial_indent=indent, subsequent_indent=indent + "  ",
                         break_long_words=False, break_on_hyphens=False)


def run(args) -> int:
    from ..policies import REGISTRY, load_policy_plugins

    load_policy_plugins()  # a plugin named in EPIKV_POLICIES that fails to load is an error, not a shorter list
    pols = [cls() for cls in REGISTRY.values()]
    rows = [p.describe() for p in pols]
    for p, r in zip(pols, rows):
        r["runs_in"] = runs_in(p)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    # plain aligned text, one line a policy: the columns are as wide as their longest cell and nothing is wrapped,
    # so no word is ever cut, on a terminal of any width or in a pipe
    head = ("name", "attn-free", "runs in", "reads")
    cells = [(r["name"], _free(r), " ".join(r["runs_in"]) or "-", reads(p)) for p, r in zip(pols, rows)]
    widths = [max(len(c[i]) for c in [head, *cells]) for i in range(3)]
    line = lambda c: "  ".join(x.ljust(w) for x, w in zip(c[:3], widths)) + "  " + c[3]  # noqa: E731
    width = shutil.get_terminal_size((80, 24)).columns  # $COLUMNS, the terminal, else 80 (a pipe)
    print(line(head))
    for c, r in zip(cells, rows):
        print(line(c))
        if args.wide:
            for label, text in (("settings", own_defaults(r) or "(only the common ones)"),
                                ("granularity", r["granularity"]),
                                ("reads", r["observes"].replace(",", ", ")),  # a long block list may wrap
                                ("paper", r["paper"] or "-"), ("rule", r["doc"])):
                print("\n".join(_wrap(f"{label}: {text}", width, "    ")))
    print()
    notes = ["attn-free: attention-free, reads no attention scores (no attention weights, no recomputed q.K); "
             "\"no, eager\": switches the model to eager attention to read its weights.", ENGINE_NOTE,
             "Every policy also has tau, recent, protect_prompt, n_sink, page. " + (
                 "--json: every field." if args.wide else "--wide: each policy's own settings, granularity, paper "
                                                          "and rule; --json: everything.")]
    for note in notes:
        print("\n".join(_wrap(note, width, "")))
    return 0
