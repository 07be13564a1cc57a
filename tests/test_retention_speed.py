"""Retention with several traces per batch (`--batch-traces`): the same records as one trace at a time."""

import json

import pytest
import torch

from epikv.cli import main
from epikv.errors import EpiKVError
from epikv.policies import get_policy, policy_names
from epikv.retention.runner import (_stream, _stream_batch, batchable, batches, prepare_traces, run_retention)
from epikv.retention.store import read_records

# fields measured on the machine (time, memory), not computed from the model's predictions
MEASURED = {"seconds", "wall_s", "tokens_per_s", "peak_mem_mib", "peak_mem_kind"}


def _steps(n: int, k: int) -> str:
    return "".join(f"Step {i}: add {i} and {i + k} to get {2 * i + k}, then check it. " for i in range(n))


def traces(n_steps=(5, 3, 4), answers=("The answer is 27.", "So \\boxed{12}, as checked.", "27")):
    """One problem (one prompt length), streams of different lengths so that rows leave the batch at different
    chunks, some inside a chunk."""
    return [{"id": f"t{j}", "problem": "Add the numbers step by step.",
             "trace": f"<think>\n{_steps(n, j + 3)}\n</think>\n{a}"} for j, (n, a) in enumerate(zip(n_steps, answers))]


def _records(path):
    return {(r["trace_id"], r["policy"], r["budget"]): r for r in read_records(path / "results.jsonl")}


def _assert_same(one: dict, many: dict):
    assert one.keys() == many.keys() and one
    for k, a in one.items():
        b = many[k]
        assert a.keys() == b.keys(), k
        for f in a:
            if f in MEASURED:
                continue
            if isinstance(a[f], float):
                assert b[f] == pytest.approx(a[f], abs=1e-4), (k, f)
            else:
                assert a[f] == b[f], (k, f)


def test_batches_group_by_prompt_length_and_size(tiny):
    rows = traces() + [{"id": "other", "problem": "A different and longer problem: add the numbers, then "
                        "multiply them.", "trace": "<think>\nfine\n</think>\n1"}] + traces()[:1]
    items, _ = prepare_traces(rows, tiny.tokenizer)
    got = [[it.id for it in b] for b in batches(items, 2)]
    assert got == [["t0", "t1"], ["t2", "t0"], ["other"]]
    assert [[it.id for it in b] for b in batches(items, 1)] == [[it.id] for it in items]


def _batchable_on_tiny(name: str) -> bool:
    """Run by the torch engine and batchable on the 4-block tiny model; a learned score has no weights for it
    (refused in one line) and is left out here (its state holds its weights, no generator: tests/test_learned.py
    runs it), and context-shift runs in llama.cpp only."""
    from epikv.support import torch_refusal

    try:
        return torch_refusal(get_policy(name)) is None and batchable(get_policy(name), 4)
    except EpiKVError:
        return False


@pytest.mark.parametrize("policy", sorted(p for p in set(policy_names()) - {"full"} if _batchable_on_tiny(p)))
def test_every_batchable_policy_streams_each_row_as_alone(tiny, policy):
    """Row by row: logits, evictions and peak cache of a batch equal single runs, for every registered policy that
    batches; rows end at different chunks (one inside a chunk)."""
    items, _ = prepare_traces(traces(), tiny.tokenizer)
    # the learned scores run on conftest's random:tiny weights; half of this small K as a recent window leaves no
    # room beside the prompt, so epikv-learned-window keeps a quarter
    kw = {"recent_frac": 0.25} if policy == "epikv-learned-window" else {}
    pol = get_policy(policy, tau=4, **kw)
    budget = len(items[0].prompt_ids) + 24
    single, single_stats = [], []
    for it in items:
        got = []
        _, s1, kv1 = _stream(tiny.model, it, get_policy(policy, tau=4, **kw), budget,
                             lambda j, x: got.append((j, x.clone())))
        single.append(got)
        single_stats.append((s1["evictions"], s1["max_cache_tokens"], kv1))
    batched = [[] for _ in items]
    runs = _stream_batch(tiny.model, items, get_policy(policy, tau=4, **kw), budget,
                         lambda i, j, x: batched[i].append((j, x.clone())))
    for it, one, many, (_, stats, _) in zip(items, single, batched, runs):
        assert [j for j, _ in one] == [j for j, _ in many]
        assert torch.cat([x for _, x in one]).shape[0] == len(it.ids) - len(it.prompt_ids)
        torch.testing.assert_close(torch.cat([x for _, x in many]), torch.cat([x for _, x in one]),
                                   atol=1e-4, rtol=0)
    # the stats of each row are its single run's (same schedule, own end)
    assert [(s["evictions"], s["max_cache_tokens"], kv) for _, s, kv in runs] == single_stats
    assert sum(s["evictions"] for _, s, _ in runs) > 0 or not pol.evicts


def test_random_policy_is_not_batched():
    assert not batchable(get_policy("random"))
    assert batchable(get_policy("epikv")) and batchable(get_policy("h2o")) and batchable(get_policy("lag-kv"))


@pytest.mark.parametrize("model", ["tiny", "smollm2"])
def test_batched_cli_records_equal_one_at_a_time(tmp_path, request, model, capsys):
    """The records of --batch-traces 3 (2 for the embedded model) equal those of the old one-at-a-time path (within 1e-4), for epikv, h2o
    (eager attention) and lag-kv, on the tiny random model and the embedded model; `random`, whose rows would share
    one generator, runs one trace at a time and so gives the same records too."""
    lm = request.getfixturevalue(model)
    rows = traces() if model == "tiny" else traces((2, 1), ("27", "So 12."))  # the embedded model: short, tau 8
    tau = 4 if model == "tiny" else 8
    path = tmp_path / "traces.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    items, _ = prepare_traces(rows, lm.tokenizer)
    budget = len(items[0].prompt_ids) + 24
    name = "random:tiny" if model == "tiny" else "smollm2"
    outs = []
    for n in (1, 3):
        out = tmp_path / f"b{n}"
        policies = ["full", "epikv", "h2o", "lag-kv"] + (["random"] if model == "tiny" else [])  # random: alone
        run_retention(lm.model, lm.tokenizer, rows, out, policies, [budget], tau=tau,
                      model_name=name, quiet=True, batch_traces=n)
        outs.append(_records(out))
    _assert_same(*outs)
    assert any(r["evictions"] > 0 for r in outs[1].values())
    if model == "tiny":  # the option itself, through the CLI (one run: the batched one)
        out = tmp_path / "cli"
        assert main(["retention", "--model", name, "--traces", str(path), "--policies", ",".join(policies),
                     "--budgets", str(budget), "--tau", "4", "--batch-traces", "3", "--no-report",
                     "--out", str(out)]) == 0
        _assert_same(outs[0], _records(out))


def test_bad_batch_traces_is_one_line_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["retention", "--model", "random:tiny", "--batch-traces", "0", "--out", str(tmp_path / "o")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "--batch-traces" in err[-1] and "Traceback" not in "\n".join(err)
