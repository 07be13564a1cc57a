"""`epikv generate`: stream a generation under a policy, with a live status line and a summary (or --json)."""

from __future__ import annotations

import json
import sys

from ..errors import EpiKVError
from .engines import add_engine_args, make_engine
from .common import (add_model_args, add_policy_args, default_for_model, hybrid_policy, nonneg_float, nonneg_int,
                     positive_int, read_text, settings_by_policy)


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate text with an evicting KV cache",
                       description="Generate text with the KV cache kept within --budget tokens.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-file", help="read the prompt from this file")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--raw", action="store_true",
                     help="feed the prompt as plain text (default: the model's chat template, when it has one)")
    fmt.add_argument("--chat", action="store_true",
                     help="the chat template (the default already; kept for compatibility; refused without one)")
    p.add_argument("--system", default=None, help="system prompt of the chat template (refused with --raw)")
    p.add_argument("--max-new-tokens", type=positive_int, default=256,
                   help="stop after this many new tokens (default 256)")
    p.add_argument("--temperature", type=nonneg_float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=nonneg_float, default=1.0,
                   help="nucleus sampling: sample from the smallest set of tokens holding this probability (1 = off)")
    p.add_argument("--top-k", type=nonneg_int, default=0, help="sample from the k likeliest tokens only (0 = off)")
    p.add_argument("--min-p", type=nonneg_float, default=0.0, help="min-p filter in [0, 1] (0 = off)")
    p.add_argument("--repetition-penalty", type=nonneg_float, default=1.0,
                   help="penalty > 0 on tokens already in the prompt or output (1 = off; greedy too)")
    p.add_argument("--seed", type=nonneg_int, default=0, help="sampling seed (default 0; greedy ignores it)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--prefill-chunk", type=positive_int, default=None, help="prefill in chunks of this many tokens")
    p.add_argument("--json", action="store_true", help="print only one JSON object")
    p.add_argument("--allow-beyond-context", action="store_true",
                   help="run a --budget larger than the model's trained context (refused otherwise)")
    add_model_args(p)
    add_engine_args(p, flash_attn=True, cache_types=True, kv_memory=True)
    add_policy_args(p)
    p.set_defaults(run=run)


def status_line(info) -> str:
    """The live status line of one decode step (the rate only once it means something: `progress.live_rate`)."""
    from ..progress import rate_text

    return (f"[{info.step + 1} tokens | cache {info.cache_tokens} | {info.evictions} evictions | "
            f"{rate_text(info.tokens_per_s)}]")


def run(args) -> int:
    from ..engine import Sampling
    from ..policies import get_policy

    if args.prompt_file:
        prompt = read_text(args.prompt_file, "prompt file")
    else:
        prompt = args.prompt
    if not prompt or not prompt.strip():
        raise EpiKVError("empty prompt")
    if args.system is not None and args.raw:
        raise EpiKVError("--system needs the chat template, which --raw turns off")
    sampling = Sampling(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                        min_p=args.min_p, repetition_penalty=args.repetition_penalty)
    settings = settings_by_policy(args, [args.policy])[args.policy]  # refused before the model loads
    eng = make_engine(args)
    if eng.name == "torch":
        named = args.policy
        hybrid_policy(args, eng.lm.model)  # a sliding-window model: the default may fall back (one warning line)
        default_for_model(args, eng.lm.model)  # no weights fitted on this model: the same fallback
        if args.policy != named:
            settings = settings_by_policy(args, [args.policy])[args.policy]
    # the chat template by default, as transformers' chat tools do: an instruct model fed raw text often ends at once
    chat = not args.raw and bool(getattr(eng.tokenizer, "chat_template", None))
    if not chat and not args.raw and (args.chat or args.system is not None):
        raise EpiKVError(f"model {args.model} has no chat template: drop {'--chat' if args.chat else '--system'}")
    live = not args.json
    tty = sys.stderr.isatty()

    layers = eng.layer_choice(get_policy(args.policy, tau=args.tau, **settings))
    if getattr(args, "kv_memory", None) is not None:  # llama.cpp only (the torch engine refuses it)
        args.budget = eng.budget_for_memory(args.policy, args.tau, **settings)
    notes = list(getattr(eng, "notes", ()))  # llama.cpp's: the flash-attention switch, --kv-memory's pick
    pending = bool((layers or notes) and live)  # the blocks note, still to print

    def announce():
        # only once the run has passed every check: a refused run prints its one error line and nothing else
        nonlocal pending
        if pending:
            for line in notes:
                print(line, file=sys.stderr)
            if layers:
                print(f"[{args.policy} reads {layers}]", file=sys.stderr)
            pending = False

    def on_step(info):
        announce()
        sys.stdout.write(info.new_text)
        sys.stdout.flush()
        if tty:
            sys.stderr.write(f"\x1b7\x1b[999;1H\x1b[2K{status_line(info)}\x1b8")
            sys.stderr.flush()

    res = eng.generate(prompt, policy=args.policy, budget=args.budget, tau=args.tau,
                       max_new_tokens=args.max_new_tokens, sampling=sampling, stop=args.stop, chat=chat,
                       system=args.system, on_step=on_step if live else None,
                       allow_beyond_context=args.allow_beyond_context, **settings)
    st = res.stats
    summary = {
        "text": res.texts[0], "prompt_tokens": st["prompt_tokens"][0], "new_tokens": st["new_tokens"][0],
        "max_cache_tokens": st["max_cache_tokens"], "final_cache_tokens": st["final_cache_tokens"],
        "evictions": st["evictions"], "seconds": round(st["seconds"], 3),
        "prefill_seconds": round(st["prefill_seconds"], 3), "decode_seconds": round(st["decode_seconds"], 3),
        "tokens_per_s": round(st["tokens_per_s"], 2), "decode_tokens_per_s": round(st["decode_tokens_per_s"], 2),
        "finish_reason": res.finish_reasons[0], "policy": st["policy"], "budget": st["budget"], "tau": st["tau"],
        "model": args.model, "engine": args.engine,
    }
    if layers:
        summary["layers"] = layers
    # llama.cpp: its KV cache and epikv's key/value mirror (issue 39), its threads and flash-attention setting, the
    # cells' types and the sequence's peak KV bytes (cells as stored + the policy's buffers: issue 56); either engine:
    # every buffer kept for the policy by kind, at the end and at the most (issue 58)
    for key in ("kv_bytes", "kv_mirror_bytes", "threads", "flash_attn", "cache_type_k", "cache_type_v",
                "kv_peak_bytes", "kv_peak_cells", "kv_peak_cell_bytes", "kv_peak_buffer_bytes", "buffer_bytes",
                "buffer_peak_bytes"):
        if st.get(key) is not None:
            summary[key] = st[key]
    if args.json:
        print(json.dumps(summary, ensure_ascii=False))
    else:
        if tty:
            sys.stderr.write("\x1b7\x1b[999;1H\x1b[2K\x1b8")
        announce()  # a run with no new token still names its blocks
        print()
        print(f"[{summary['policy']} K={summary['budget']} tau={summary['tau']}] prompt {summary['prompt_tokens']} "
              f"+ new {summary['new_tokens']} tokens ({summary['finish_reason']}); cache max "
              f"{summary['max_cache_tokens']}, final {summary['final_cache_tokens']}; {summary['evictions']} "
              f"evictions; {summary['seconds']} s (prefill {summary['prefill_seconds']} s, decode "
              f"{summary['decode_seconds']} s); {summary['tokens_per_s']} tok/s overall, "
              f"{summary['decode_tokens_per_s']} decoding"
              + (f"; KV peak {summary['kv_peak_bytes']} bytes ({summary['kv_peak_cells']} {summary['cache_type_k']}/"
                 f"{summary['cache_type_v']} cells + {summary['kv_peak_buffer_bytes']} of policy buffers)"
                 if "kv_peak_bytes" in summary else ""), file=sys.stderr)
    return 0
