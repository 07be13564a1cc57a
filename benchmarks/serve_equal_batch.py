"""Per-step cost of eviction inside transformers' continuous batching at a model shape, with random weights.

B requests of random prompt tokens, forced to N new tokens, run together through the engine (`epikv.serving`) under
full and under epikv at each budget, and through padded `model.generate`, after an untimed warm-up, interleaved
over --repeats. Per-step time depends on the shapes, not on the weights, so a random model of a preset's shape
(models.PRESETS, e.g. llama-8b) stands in for the real one where its weights are not at hand. Writes the records
(JSON lines, one per timed run, as each finishes) and prints the equal-batch table of `epikv bench serve`.

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
from epikv.models import PRESETS  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="llama-8b", choices=sorted(PRESETS))
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    p.add_argument("--new", type=int, default=256, help="tokens generated per request (forced)")
    p.add_argument("--budgets", default="128,256")
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--max-batch-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--out", required=True, help="JSON lines, appended")
    a = p.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(PRESETS[a.preset])
    cfg = AutoConfig.for_model(kw.pop("arch"), **kw)
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = 1, 2, 2
    torch.manual_seed(0)
    with torch.device(a.device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, a.dtype)).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, cfg.vocab_size, (a.prompt,), generator=g).tolist() for _ in range(a.batch)]
    rows = [Row("full", None)] + [Row("epikv", int(k)) for k in a.budgets.split(",")]
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
    sys.exit(main())
