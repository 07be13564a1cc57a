"""`epikv calibrate`: fit epikv-learned's linear hidden-state score on a model's own full-cache eager runs."""

from __future__ import annotations

import argparse
import json

from ..errors import EpiKVError
from .common import add_model_args, nonneg_float, out_dir, out_file, positive_int

# calibrate.HORIZON and calibrate.MIN_LAGS, named here without importing torch for --help (tests/test_calibrate.py
# checks they agree)
HORIZON, MIN_LAGS = 256, 16


def register(sub) -> None:
    p = sub.add_parser("calibrate", help="fit epikv-learned's score on a model's own attention",
                       description="Run the model (transformers' eager attention, or llama.cpp on a GGUF with "
                                   "--engine llama.cpp; full cache) over a JSONL of texts and fit, per "
                                   "layer and KV head, a Ridge map from the hidden state entering attention to an "
                                   "attention-based target (KVzap's, or the mean future attention), and a second "
                                   "map to each token's log retention rate (epikv-learned-decay, TRIM-KV: the slope "
                                   "of the log attention it receives against lag over --horizon later queries); "
                                   "writes a small "
                                   "safetensors file, by default into the weights cache folder that the engines "
                                   "search for the file fitted on their model ($EPIKV_WEIGHTS_DIR, default "
                                   "~/.cache/epikv/weights; elsewhere name it with --weights FILE). Resumable: "
                                   "rerun the same command to continue (sums kept in OUT.partial.pt).")
    p.add_argument("--texts", required=True, help="JSONL file, one record per text")
    p.add_argument("--field", default="text", help="the record field holding the text (default: text)")
    p.add_argument("--exclude", default=None,
                   help="JSONL of evaluation records (e.g. the traces): texts whose problem or text is among theirs "
                        "are left out")
    p.add_argument("--max-texts", type=positive_int, default=None, help="use the first N texts left")
    p.add_argument("--max-tokens", type=positive_int, default=512, help="tokens per text (default 512)")
    p.add_argument("--target", choices=("kvzap", "mean"), default="kvzap",
                   help="kvzap: log max later attention x ||W_o v|| (default); mean: log mean later attention")
    p.add_argument("--horizon", type=positive_int, default=HORIZON,
                   help=f"later queries each token's retention rate is fitted over (default {HORIZON}; at least "
                        f"{MIN_LAGS})")
    p.add_argument("--ridge", type=nonneg_float, default=1e-3, help="Ridge penalty on standardised features (default 1e-3)")
    p.add_argument("--out", default=None, type=out_file,
                   help="weights file to write (.safetensors); default: MODEL-CHECKSUM.safetensors in the weights "
                        "cache folder ($EPIKV_WEIGHTS_DIR, default ~/.cache/epikv/weights)")
    p.add_argument("--also-for", action="append", default=[], metavar="GGUF",
                   help="a GGUF conversion of the model (a .gguf file, or smollm2 for the embedded one) that the "
                        "weights also fit: its fingerprint is recorded beside the model's, so --engine llama.cpp "
                        "accepts them for it (repeatable; its architecture and shapes must be the model's)")
    add_model_args(p)
    from .engines import add_engine_args

    add_engine_args(p)
    p.set_defaults(run=run)


def run(args) -> int:
    from ..calibrate import calibrate, default_out, read_texts
    from ..policies.learned import cache_dir
    from ..models import load_model
    from ..progress import Progress

    if args.engine == "llama.cpp":
        from .engines import LlamaCppEngine

        LlamaCppEngine.refuse_torch_options(args)
    elif args.attn not in (None, "eager"):
        raise EpiKVError("calibrate reads attention weights: it runs eager attention (leave --attn out)")
    if args.horizon < MIN_LAGS:  # before the model loads
        raise EpiKVError(f"calibrate: --horizon must be at least {MIN_LAGS} later queries, got {args.horizon}")
    texts = read_texts(args.texts, args.field, args.exclude, args.max_texts)
    also = _gguf_fingerprints(args.also_for)
    if args.out is None:  # the cache folder, refused in one line before the model loads when it is not writable
        try:
            out_dir(str(cache_dir()))
        except argparse.ArgumentTypeError as e:
            raise EpiKVError(f"calibrate: the weights cache folder: {e} (set $EPIKV_WEIGHTS_DIR or give --out)") \
                from None
    if args.engine == "llama.cpp":  # the GGUF itself, through llama.cpp (llamacpp/calibrate.py)
        from ..llamacpp import load_gguf
        from ..llamacpp.calibrate import gguf_runs
        from ..llamacpp.engine import default_threads
        from ..llamacpp.model import gguf_path

        gm = load_gguf(args.model)
        model = gguf_runs(gm, gguf_path(args.model), args.max_tokens, args.threads or default_threads(),
                          need_wo=args.target == "kvzap")
        tokenizer = None
    else:
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        lm = load_model(args.model, dtype=args.dtype, device=args.device, device_map=args.device_map,
                        attn_implementation="eager")
        model, tokenizer = lm.model, lm.tokenizer
    out = args.out or str(default_out(args.model, model))
    try:
        with Progress("calibrate", total=len(texts), unit="texts") as prog:
            _, report = calibrate(model, tokenizer, texts, out, target=args.target,
                                  max_tokens=args.max_tokens, ridge=args.ridge, model_name=args.model,
                                  progress=prog, also_fits=also, horizon=args.horizon)
    finally:
        if args.engine == "llama.cpp":
            model.close()
    print(json.dumps({**report, "engine": args.engine}))
    return 0


def _gguf_fingerprints(models: list[str]) -> list[str]:
    """The fingerprints of --also-for's GGUF files (read from their headers: no llama.cpp needed)."""
    if not models:
        return []
    from pathlib import Path

    from ..llamacpp.gguf_file import gguf_fingerprint
    from ..llamacpp.model import EMBEDDED, gguf_path

    for m in models:
        if m != EMBEDDED and not Path(m).expanduser().is_file():
            raise EpiKVError(f"calibrate: --also-for {m}: no such file (a .gguf file, or smollm2)")
    return [gguf_fingerprint(gguf_path(m)) for m in models]
