"""Per-step cost of eviction inside transformers' continuous batching at a model shape, with random weights.

B requests of random prompt tokens, forced to N new tokens, run together through the engine (`epikv.serving`) under
full and under epikv at each budget, and through padded `model.generate`, after an untimed warm-up, interleaved
over --repeats. Per-step time depends on the shapes, not on the weights, so a random model of a preset's shape
(models.PRESETS, e.g. llama-8b) stands in for the real one where its weights are not at hand. Appends the records
(JSON lines, one per timed run, once all have run) to --out and prints the equal-batch table of `epikv bench serve`.
Bad arguments or settings the engine refuses: one line, exit 2.

  python benchmarks/serve_equal_batch.py --preset llama-8b --device cuda --batch 16 --prompt 64 --new 256 \\
      --budgets 128,256 --out results.jsonl
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from epikv.bench.serve import Row, equal_batch, table  # noqa: E402
from epikv.commands.common import int_list, out_file, positive_int  # noqa: E402
from epikv.errors import EpiKVError  # noqa: E402
from epikv.models import PRESETS, check_device, random_model  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="llama-8b", choices=sorted(PRESETS))
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--batch", type=positive_int, default=16)
    p.add_argument("--prompt", type=positive_int, default=64, help="prompt tokens per request")
    p.add_argument("--new", type=positive_int, default=256, help="tokens generated per request (forced)")
    p.add_argument("--budgets", type=int_list, default=[128, 256])
    p.add_argument("--page", type=positive_int, default=16)
    p.add_argument("--max-batch-tokens", type=positive_int, default=256)
    p.add_argument("--repeats", type=positive_int, default=1)
    p.add_argument("--out", required=True, type=out_file, help="JSON lines, appended")
    a = p.parse_args()
    check_device(a.device)
    model = random_model(a.preset, getattr(torch, a.dtype), a.device).eval()
    vocab = model.get_input_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (a.prompt,), generator=g).tolist() for _ in range(a.batch)]
    rows = [Row("full", None)] + [Row("epikv", k) for k in a.budgets]
    out = Path(a.out)
    head = {"preset": a.preset, "device": a.device, "dtype": a.dtype, "batch": a.batch, "prompt": a.prompt,
            "new": a.new, "page": a.page, "max_batch_tokens": a.max_batch_tokens,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "torch": torch.__version__, "transformers": __import__("transformers").__version__}

    def say(line: str) -> None:
        print(line, flush=True)

    eq = equal_batch(model, None, rows, lambda r: {}, prompts, a.new, a.page, a.max_batch_tokens,
                     repeats=a.repeats, say=say)
    with out.open("a") as f:
        for e in eq:
            f.write(json.dumps({**head, **e}) + "\n")
    print(json.dumps(head))
    print(table([], eq))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except EpiKVError as e:
        print(f"serve_equal_batch: error: {e}", file=sys.stderr)
        sys.exit(2)
