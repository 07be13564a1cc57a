"""bench speed's second reference: transformers' own model.generate with a DynamicCache, at full's cache length,
timed in the same interleaved rounds (runs on every transformers version of the matrix)."""

import pytest

from epikv.bench.speed import HF, _HFRun, build_configs, random_ids, run_budget


def test_transformers_reference_runs_at_fulls_length(tiny):
    cfgs = build_configs(["full", "epikv"], [1])
    block = run_budget(tiny.model, cfgs, budget=48, gen_tokens=8, round_steps=4, prompt_tokens=8, fill_chunk=16,
                       transformers_reference=True)
    rows = {r["label"]: r for r in block["configs"]}
    assert set(rows) == {"full", "epikv@tau=1", HF}
    # the same starting length (K - gen/2) and one token per step: the same cache length as `full` every round
    assert rows[HF]["cache_length_after_round"] == rows["full"]["cache_length_after_round"] == [48 - 4 + 4 + 4, 56]  # 4 warm-up steps
    over = block["ratios"]["overhead_vs_transformers"]
    assert set(over) == {"full", "epikv@tau=1"}
    assert over["full"] == pytest.approx(rows["full"]["ms_per_token"] / rows[HF]["ms_per_token"] - 1)
    assert HF not in block["ratios"]["speedup_vs_full"]


def test_transformers_reference_decodes_greedily_from_the_same_tokens(tiny):
    """It continues the sequence it was filled with: each round feeds only the unseen last token and adds
    round_steps greedy tokens, equal to a plain greedy generate from the same prefix."""
    ids = random_ids(tiny.model, 30, seed=3)
    run = _HFRun(tiny.model, 20, ids)
    run.round(3)
    run.round(3)
    ref = tiny.model.generate(input_ids=ids[:, :20], max_new_tokens=7, min_new_tokens=7, do_sample=False,
                              pad_token_id=0)
    assert run.seq.tolist() == ref.tolist()
