"""`epikv calibrate`: fit epikv-learned's linear hidden-state score on a model's own full-cache eager runs."""

from __future__ import annotations

import json

from ..errors import EpiKVError
from .common import add_model_args, nonneg_float, out_file, positive_int


def register(sub) -> None:
    p = sub.add_parser("calibrate", help="fit epikv-learned's score on a model's own attention",
                       description="Run the model (eager attention, full cache) over a JSONL of texts and fit, per "
                                   "layer and KV head, a Ridge map from the hidden state entering attention to an "
                                   "attention-based target (KVzap's, or the mean future attention); writes a small "
                                   "safetensors file for `--set epikv-learned.weights=FILE`. Resumable: rerun the "
                                   "same command to continue (sums kept in OUT.partial.pt).")
    p.add_argument("--texts", required=True, help="JSONL file, one record per text")
    p.add_argument("--field", default="text", help="the record field holding the text (default: text)")
    p.add_argument("--exclude", default=None,
                   help="JSONL of evaluation records (e.g. the traces): texts whose problem or text is among theirs "
                        "are left out")
    p.add_argument("--max-texts", type=positive_int, default=None, help="use the first N texts left")
    p.add_argument("--max-tokens", type=positive_int, default=512, help="tokens per text (default 512)")
    p.add_argument("--target", choices=("kvzap", "mean"), default="kvzap",
                   help="kvzap: log max later attention x ||W_o v|| (default); mean: log mean later attention")
    p.add_argument("--ridge", type=nonneg_float, default=1e-3, help="Ridge penalty on standardised features (default 1e-3)")
    p.add_argument("--out", required=True, type=out_file, help="weights file to write (.safetensors)")
    add_model_args(p)
    p.set_defaults(run=run)


def run(args) -> int:
    from ..calibrate import calibrate, read_texts
    from ..models import load_model
    from ..progress import Progress

    if args.attn not in (None, "eager"):
        raise EpiKVError("calibrate reads attention weights: it runs eager attention (leave --attn out)")
    texts = read_texts(args.texts, args.field, args.exclude, args.max_texts)
    lm = load_model(args.model, dtype=args.dtype, device=args.device, device_map=args.device_map,
                    attn_implementation="eager")
    with Progress("calibrate", total=len(texts), unit="texts") as prog:
        _, report = calibrate(lm.model, lm.tokenizer, texts, args.out, target=args.target,
                              max_tokens=args.max_tokens, ridge=args.ridge, model_name=args.model, progress=prog)
    print(json.dumps(report))
    return 0
