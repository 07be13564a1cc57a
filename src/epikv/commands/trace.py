"""`epikv trace`: a policy's per-token score over a text (or, without one, its keep set over time), with the tokens
evicted at a budget marked."""

from __future__ import annotations

from pathlib import Path

from ..errors import EpiKVError
from .common import (add_model_args, add_policy_args, default_for_model, hybrid_policy, load, out_file, read_text,
                     settings_by_policy)


def png_file(text: str) -> str:
    """--png's type: an output file named .png, checked while parsing (not by matplotlib after the model ran)."""
    import argparse

    out_file(text)
    if Path(text).suffix.lower() != ".png":
        raise argparse.ArgumentTypeError(f"{text}: expected a file name ending in .png")
    return text


def register(sub) -> None:
    p = sub.add_parser("trace", help="show per-token scores and evictions over a text",
                       description="Stream a text once under a policy at --budget and show which tokens it evicted, "
                                   "coloured by the score each token got on arrival in that pass (the EPIKV family) "
                                   "or, for a policy that gives none (epikv-seg-q, streaming, h2o ...), by how long "
                                   "each stayed cached; --png then plots the keep set over time. Policies that never "
                                   "evict or keep per head or layer are refused.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--text-file", help="a text file (its first line is treated as the prompt)")
    src.add_argument("--prompt", help="the prompt (protected); use with --completion")
    p.add_argument("--completion", help="the text after the prompt (after a space, unless the prompt ends or the "
                                        "completion starts with whitespace)")
    p.add_argument("--html", type=out_file, help="write an HTML view here")
    p.add_argument("--png", type=png_file, help="write a PNG plot here (a .png file)")
    add_model_args(p)
    add_policy_args(p)
    p.set_defaults(run=run, budget=256)


def run(args) -> int:
    from ..policies import policy_class
    from ..trace import render_html, render_png, render_terminal, trace_scores, traceable, traceable_names

    why = traceable(policy_class(args.policy))  # refused before the model loads
    if why:
        raise EpiKVError(f"{why}; trace one of: {', '.join(traceable_names())}")

    if args.text_file:
        text = read_text(args.text_file)
        prompt, _, completion = text.partition("\n")
        completion = "\n" + completion if completion else ""
    else:
        if args.completion is None:
            raise EpiKVError("--prompt needs --completion")
        prompt, completion = args.prompt, args.completion
        if prompt[-1:].strip() and completion[:1].strip():  # two texts joined as words: "13? First", not "13?First"
            completion = " " + completion
    if not prompt.strip():
        raise EpiKVError("empty prompt")
    if not completion.strip():
        raise EpiKVError("empty completion: nothing to trace")
    settings = settings_by_policy(args, [args.policy])[args.policy]
    lm = load(args)
    named = args.policy
    hybrid_policy(args, lm.model)  # a sliding-window model: the default may fall back (one warning line)
    default_for_model(args, lm.model)  # no weights fitted on this model: the same fallback
    if args.policy != named:
        settings = settings_by_policy(args, [args.policy])[args.policy]
    tok = lm.tokenizer
    p_ids = tok(prompt, add_special_tokens=True)["input_ids"]
    c_ids = tok(completion, add_special_tokens=False)["input_ids"]
    tr = trace_scores(lm.model, tok, p_ids, c_ids, policy=args.policy, budget=args.budget, tau=args.tau, **settings)
    for out in (args.html, args.png):  # missing folders above an output are made (checked writable at parse)
        if out:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
    if args.html:
        Path(args.html).write_text(render_html(tr), encoding="utf-8")
    if args.png:
        render_png(tr, args.png)
    if not args.html and not args.png:
        render_terminal(tr)
    else:
        print(f"{sum(tr.evicted)} of {len(tr.tokens)} tokens evicted at K={tr.budget}; wrote "
              + ", ".join(x for x in (args.html, args.png) if x))
    return 0
