"""Statistics describe exactly the tokens returned; sampling is seeded per sequence; transformers' logits processors
and GenerationConfig."""

import json
import re
import sys

import pytest
import torch
from transformers import GenerationConfig

from epikv import EpiKVError, Sampling, generate
from epikv import engine
from epikv.cli import main
from epikv.engine import Sampler, draw, sequence_seed

PROMPTS = ["The quick brown fox jumps over the lazy dog and then", "Once upon a time", "Tell me a story about"]
K = 20  # budget with tau = 1: every token fed past K evicts exactly once


def _ends_early(tiny, prompt, at=5):
    """An EOS id that ends greedy generation of `prompt` (epikv, K, tau 1) at step `first` (>= `at`), inside a
    16-step window."""
    ids = generate(tiny.model, tiny.tokenizer, prompt, policy="epikv", budget=K, tau=1, max_new_tokens=40,
                   eos_token_ids=[]).token_ids[0]
    for j in range(at, 30):
        if ids.index(ids[j]) == j and j % 16 not in (0, 15):
            return ids[j], j
    pytest.skip("no suitable EOS candidate")


# -- item 2: statistics as of the true last step --------------------------------------------------------------------
def test_stats_stop_at_eos_not_at_the_next_sync(tiny):
    eos, first = _ends_early(tiny, PROMPTS[0], at=12)
    kw = dict(policy="epikv", budget=K, tau=1, max_new_tokens=40, eos_token_ids=[eos])
    batched = generate(tiny.model, tiny.tokenizer, PROMPTS[0], **kw)  # host reads every 16 steps
    synced = generate(tiny.model, tiny.tokenizer, PROMPTS[0], on_step=lambda info: None, **kw)  # every step
    assert batched.finish_reasons == ["eos"] and len(batched.token_ids[0]) == first + 1
    assert batched.token_ids == synced.token_ids
    keys = ("evictions", "max_cache_tokens", "final_cache_tokens", "decode_steps", "new_tokens")
    assert {k: batched.stats[k] for k in keys} == {k: synced.stats[k] for k in keys}
    # counted independently: the EOS token is never fed, so P + first tokens went through a cache of K
    p = batched.prompt_tokens[0]
    assert p + first > K
    assert batched.stats["evictions"] == p + first - K
    assert batched.stats["max_cache_tokens"] == batched.stats["final_cache_tokens"] == K
    assert batched.stats["decode_steps"] == first + 1
    # the un-synced steps would have evicted: 16 - (first % 16) - 1 more
    longer = generate(tiny.model, tiny.tokenizer, PROMPTS[0], **dict(kw, eos_token_ids=[],
                                                                     max_new_tokens=(first // 16 + 1) * 16))
    assert longer.stats["evictions"] > batched.stats["evictions"]


def test_batch_stats_run_to_the_last_rows_end(tiny):
    kw = dict(policy="epikv", budget=K, tau=1, max_new_tokens=40)
    alone = [generate(tiny.model, tiny.tokenizer, p, eos_token_ids=[], **kw).token_ids[0] for p in PROMPTS[:2]]
    for e0 in alone[0][8:30]:  # EOS ids ending both rows early, the later one inside a 16-step window
        eos = [e0, alone[1][12]]
        ends = [min(r.index(e) for e in eos if e in r) for r in alone]
        if max(ends) % 16 not in (0, 15) and min(ends) < max(ends) < 30:
            break
    else:
        pytest.skip("no suitable EOS candidates")
    kw["eos_token_ids"] = eos
    batched = generate(tiny.model, tiny.tokenizer, PROMPTS[:2], **kw)
    synced = generate(tiny.model, tiny.tokenizer, PROMPTS[:2], on_step=lambda info: None, **kw)
    assert batched.token_ids == synced.token_ids
    end = max(len(r) for r in batched.token_ids) - 1
    assert sorted(len(r) - 1 for r in batched.token_ids) == sorted(ends) and end == max(ends)
    width = max(batched.prompt_tokens)  # padding is stored too (and dropped first)
    for k in ("evictions", "max_cache_tokens", "final_cache_tokens", "decode_steps"):
        assert batched.stats[k] == synced.stats[k], k
    assert batched.stats["evictions"] == max(0, width + end - K) and batched.stats["decode_steps"] == end + 1


def test_seconds_stop_at_the_true_end(tiny, monkeypatch):
    """With a clock that ticks once per mark: start, after prefill, then one mark per chosen token."""

    class Tick:
        def __init__(self, device):
            self.n = 0

        def mark(self):
            self.n += 1
            return self.n

        def between(self, a, b):
            return b - a

    monkeypatch.setattr(engine, "_Clock", Tick)
    eos, first = _ends_early(tiny, PROMPTS[0])
    res = generate(tiny.model, tiny.tokenizer, PROMPTS[0], policy="epikv", budget=K, tau=1, max_new_tokens=40,
                   eos_token_ids=[eos])
    assert res.stats["prefill_seconds"] == 1
    assert res.stats["seconds"] == 1 + (first + 1)  # prefill + the first + 1 steps returned, none after
    # rates named for what they cover: the whole run, or the decode alone
    assert res.stats["decode_seconds"] == first + 1
    assert res.stats["tokens_per_s"] == (first + 1) / (first + 2)
    assert res.stats["decode_tokens_per_s"] == 1.0


def _status(err: str) -> tuple[int, int, int]:
    """Last live status line: (tokens, cache, evictions)."""
    m = re.findall(r"\[(\d+) tokens \| cache (\d+) \| (\d+) evictions", err)
    return tuple(int(x) for x in m[-1])


def test_cli_status_line_and_json_agree(capsys, monkeypatch):
    argv = ["generate", "--raw", "--prompt", "The capital of France is", "--budget", "24", "--max-new-tokens", "40",
            "--policy", "epikv"]  # tau 16: the default policy's tau 128 would not evict within 40 tokens
    assert main(argv + ["--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["finish_reason"] == "eos" and d["new_tokens"] < 40 and d["new_tokens"] % 16 != 0
    assert d["evictions"] > 0  # the budget binds, so un-synced extra steps would have evicted
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(argv) == 0
    err = capsys.readouterr().err
    tokens, cache, evictions = _status(err)
    summary = re.search(r"\+ new (\d+) tokens .*cache max (\d+), final (\d+); (\d+) evictions", err)
    assert (tokens, cache, evictions) == (d["new_tokens"], d["final_cache_tokens"], d["evictions"])
    assert tuple(int(x) for x in summary.groups()) == (d["new_tokens"], d["max_cache_tokens"],
                                                       d["final_cache_tokens"], d["evictions"])


# -- item 5: one random stream per sequence -------------------------------------------------------------------------
def test_sampled_row_does_not_depend_on_batch_mates(tiny):
    kw = dict(policy="epikv", budget=K, tau=1, max_new_tokens=30, eos_token_ids=[],
              sampling=Sampling(temperature=1.0, top_p=0.95))
    alone = generate(tiny.model, tiny.tokenizer, [PROMPTS[0]], seeds=[7], **kw)
    batch = generate(tiny.model, tiny.tokenizer, [PROMPTS[1], PROMPTS[0], PROMPTS[2]], seeds=[1, 7, 3], **kw)
    assert batch.stats["evictions"] > 0
    assert batch.token_ids[1] == alone.token_ids[0]
    other = generate(tiny.model, tiny.tokenizer, [PROMPTS[0]], seeds=[8], **kw)
    assert other.token_ids != alone.token_ids  # the seed matters
    # default seeds: row i uses seed + i, so repeated prompts give different samples
    same = generate(tiny.model, tiny.tokenizer, [PROMPTS[0]] * 2, **kw)
    assert same.token_ids[0] != same.token_ids[1] and same.stats["seeds"] == [0, 1]


def _dataset(path, n=5):
    rows = [{"id": f"p{i}", "problem": f"What is {i} plus {i + 3}?", "answer": str(2 * i + 3)} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_eval_samples_do_not_depend_on_batch_size_or_shard(tmp_path, capsys):
    """A sampled eval decodes each sequence alone, whatever --batch-size: its sample depends on (seed, problem,
    sample) only, so batch size, shard and executor cannot change it on any machine. (Equal texts from batched rows
    would hold on one CPU only: a padded batch's shapes change every row's rounding, and a sampled token near a CDF
    boundary with it, as seen from the 7th token on another machine.)"""
    from epikv.eval.records import read_records

    data = _dataset(tmp_path / "mini.jsonl", n=4)  # batches of 3 and 1
    base = ["eval", "--dataset", str(data), "--model", "random:tiny", "--protocol", "r1", "--samples", "2",
            "--policies", "full,epikv", "--budgets", "68", "--tau", "1", "--recent", "4", "--max-new-tokens", "12",
            "--quiet"]
    outs = {}
    for name, extra in {"b1": ["--batch-size", "1"], "b3": ["--batch-size", "3"]}.items():
        assert main(base + ["--out", str(tmp_path / name)] + extra) == 0
        outs[name] = {(r["id"], r["policy"], r["budget"], r["sample"]): (r["output"], r["seed"])
                      for r in read_records(tmp_path / name)}
    err = capsys.readouterr().err.splitlines()
    assert err == ["epikv eval: warning: protocol r1 samples: each sequence is decoded alone, so its sample does not "
                   "depend on its batch (--batch-size applies to greedy protocols; --batch-sampled batches them)"]
    assert {r["batch_size"] for r in read_records(tmp_path / "b3")} == {1}  # the guarantee itself, on any machine
    for i in range(2):
        assert main(base + ["--out", str(tmp_path / "sh"), "--batch-size", "3", "--shard", f"{i}/2"]) == 0
    outs["sh"] = {(r["id"], r["policy"], r["budget"], r["sample"]): (r["output"], r["seed"])
                  for r in read_records(tmp_path / "sh")}
    assert len(outs["b1"]) == 4 * 2 * 2
    assert outs["b1"] == outs["b3"] == outs["sh"]
    assert any(r["evictions"] > 0 for r in read_records(tmp_path / "b3"))
    seeds = {v[1] for v in outs["b1"].values()}
    assert len(seeds) == 4 * 2  # one seed per (problem, sample), shared by the policies
    assert outs["b1"][("p0", "full", None, 0)][1] == sequence_seed(0, "p0", 0)
    # --batch-sampled: batched as asked (speed over bitwise reproducibility); refused where it means nothing
    assert main(base + ["--out", str(tmp_path / "bs"), "--batch-size", "3", "--batch-sampled"]) == 0
    assert {r["batch_size"] for r in read_records(tmp_path / "bs")} == {3, 1}
    capsys.readouterr()
    for extra in (["--batch-sampled"], ["--batch-size", "3", "--batch-sampled", "--protocol", "paper", "--samples", "1"]):
        assert main(base + ["--out", str(tmp_path / "x")] + extra) == 2
        assert "--batch-sampled only applies to a sampled protocol (r1) with --batch-size > 1" in \
            capsys.readouterr().err


def test_sequence_seed_is_stable():
    assert sequence_seed(0, "p0", 0) == sequence_seed(0, "p0", 0) != sequence_seed(0, "p0", 1)
    assert sequence_seed(0, "p0", 0) == 5646996620399363886  # the same on every machine and Python run
    assert 0 <= sequence_seed(123, "x", 9) < 2**63


# -- issue 14 item 3: transformers' processors -----------------------------------------------------------------------
def test_draw_follows_the_probabilities():
    p = torch.tensor([[0.0, 0.1, 0.0, 0.6, 0.3, 0.0]])
    n = 10_000
    u = (torch.arange(n) + 0.5) / n
    got = draw(p.expand(n, -1), u)
    counts = torch.bincount(got, minlength=6).float() / n
    assert torch.allclose(counts, p[0], atol=2 / n)
    edge = draw(p.expand(2, -1), torch.tensor([0.0, 1 - 2**-24]))
    assert edge.tolist() == [1, 4]  # never a zero-probability token, even at the ends


@pytest.mark.parametrize("cfg", [
    dict(temperature=0.7, top_k=20, top_p=0.9, repetition_penalty=1.3),
    dict(temperature=1.3, min_p=0.6, top_k=0),  # (near-uniform logits of a random model) top_k 50 by default: off
    dict(temperature=1.0, top_p=0.5, top_k=3),
])
def test_scores_equal_model_generate_processors(tiny, cfg):
    """Our processed scores for each step equal the scores model.generate computed with the same settings."""
    tok = tiny.tokenizer
    enc = tok(PROMPTS[0], return_tensors="pt")
    torch.manual_seed(0)
    out = tiny.model.generate(**enc, do_sample=True, max_new_tokens=6, eos_token_id=None,
                              pad_token_id=tok.pad_token_id, output_scores=True, output_logits=True,
                              return_dict_in_generate=True, **cfg)
    p = enc.input_ids.shape[1]
    new = out.sequences[:, p:]
    s = Sampler(Sampling(**cfg), [0], enc.input_ids, [0], 6, "cpu")
    for t in range(6):
        s.out[:, :t] = new[:, :t]
        ours, theirs = s.scores(out.logits[t], t), out.scores[t]
        assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
        assert torch.allclose(ours.softmax(-1), theirs.softmax(-1), atol=1e-6)
    assert torch.isinf(out.scores[0]).any()  # the filters really filter


def test_greedy_with_repetition_penalty_equals_model_generate(tiny):
    tok = tiny.tokenizer
    enc = tok(PROMPTS[1], return_tensors="pt")
    ref = tiny.model.generate(**enc, do_sample=False, max_new_tokens=20, eos_token_id=None, repetition_penalty=1.5,
                              pad_token_id=tok.pad_token_id)[0, enc.input_ids.shape[1]:].tolist()
    plain = generate(tiny.model, tok, PROMPTS[1], policy="full", budget=None, max_new_tokens=20, eos_token_ids=[])
    res = generate(tiny.model, tok, PROMPTS[1], policy="full", budget=None, max_new_tokens=20, eos_token_ids=[],
                   sampling=Sampling(repetition_penalty=1.5))
    assert res.token_ids[0] == ref and ref != plain.token_ids[0]


def test_repetition_penalty_ignores_padding(tiny):
    """In a padded batch the pad id is not penalised: rows score and decode as their single runs."""
    rows = [tiny.tokenizer(p)["input_ids"] for p in PROMPTS[:2]]
    pad = max(map(len, rows)) - min(map(len, rows))
    short = min(range(2), key=lambda i: len(rows[i]))
    v = tiny.model.config.vocab_size
    logits = torch.randn(1, v, generator=torch.Generator().manual_seed(0)).abs() + 1  # > 0: penalty divides
    pad_id = 7  # not in the prompt
    assert pad > 0 and pad_id not in rows[short]
    batch = Sampler(Sampling(repetition_penalty=2.0), [0, 0],
                    torch.tensor([[pad_id] * (max(map(len, rows)) - len(r)) + r for r in rows]),
                    [max(map(len, rows)) - len(r) for r in rows], 4, "cpu")
    alone = Sampler(Sampling(repetition_penalty=2.0), [0], torch.tensor([rows[short]]), [0], 4, "cpu")
    assert torch.equal(batch.scores(logits.expand(2, -1), 0)[short], alone.scores(logits, 0)[0])
    kw = dict(policy="full", budget=None, max_new_tokens=15, eos_token_ids=[], sampling=Sampling(repetition_penalty=2.0))
    both = generate(tiny.model, tiny.tokenizer, PROMPTS[:2], **kw)
    for i in range(2):
        assert both.token_ids[i] == generate(tiny.model, tiny.tokenizer, PROMPTS[i], **kw).token_ids[0]


def test_generation_config_maps_to_sampling(tiny):
    eos, first = _ends_early(tiny, PROMPTS[0])
    kw = dict(policy="epikv", budget=K, tau=1)
    gc = GenerationConfig(do_sample=True, temperature=0.8, top_k=30, top_p=0.9, min_p=0.02, repetition_penalty=1.2,
                          max_new_tokens=25, eos_token_id=eos)
    a = generate(tiny.model, tiny.tokenizer, PROMPTS[:2], generation_config=gc, seeds=[4, 5], **kw)
    b = generate(tiny.model, tiny.tokenizer, PROMPTS[:2], seeds=[4, 5], max_new_tokens=25, eos_token_ids=[eos],
                 sampling=Sampling(temperature=0.8, top_k=30, top_p=0.9, min_p=0.02, repetition_penalty=1.2), **kw)
    assert a.token_ids == b.token_ids and a.texts == b.texts
    greedy = generate(tiny.model, tiny.tokenizer, PROMPTS[0], generation_config=GenerationConfig(
        do_sample=False, max_new_tokens=12, eos_token_id=eos), **kw)
    plain = generate(tiny.model, tiny.tokenizer, PROMPTS[0], max_new_tokens=12, eos_token_ids=[eos], **kw)
    assert greedy.token_ids == plain.token_ids and len(greedy.token_ids[0]) == min(first + 1, 12)
    p = len(tiny.tokenizer(PROMPTS[0])["input_ids"])
    by_length = generate(tiny.model, tiny.tokenizer, PROMPTS[0], eos_token_ids=[],
                         generation_config=GenerationConfig(max_length=p + 7), **kw)
    assert len(by_length.token_ids[0]) == 7


@pytest.mark.parametrize("kwargs,match", [
    (dict(generation_config=GenerationConfig(num_beams=2)), "one sequence per prompt"),
    (dict(generation_config=GenerationConfig(do_sample=True, typical_p=0.5)), "does not map.*EpiKVCache"),
    (dict(generation_config=GenerationConfig(), sampling=Sampling()), "either sampling or generation_config"),
    (dict(seeds=[1, 2]), "one seed per prompt"),
    (dict(seeds=[-1]), "seed must be"),
])
def test_refused_settings(tiny, kwargs, match):
    with pytest.raises(EpiKVError, match=match):
        generate(tiny.model, tiny.tokenizer, PROMPTS[0], budget=64, max_new_tokens=4, **kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(min_p=1.5), "min-p"), (dict(min_p=-0.1), "min-p"), (dict(repetition_penalty=0), "repetition penalty"),
    (dict(repetition_penalty=float("nan")), "repetition penalty"), (dict(temperature=True), "temperature"),
])
def test_sampling_validation(kwargs, match):
    with pytest.raises(EpiKVError, match=match):
        Sampling(**kwargs)


def _bad(capsys, *argv):
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_cli_sampling_flags(capsys):
    base = ["generate", "--model", "random:tiny", "--prompt", "Hello world", "--max-new-tokens", "8", "--json"]
    assert "min-p" in _bad(capsys, *base, "--min-p", "1.5")
    assert "repetition penalty" in _bad(capsys, *base, "--repetition-penalty", "0")
    assert "--min-p" in _bad(capsys, *base, "--min-p", "x")
    assert main(base + ["--temperature", "0.9", "--min-p", "0.1", "--repetition-penalty", "1.3", "--seed", "3"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["new_tokens"] == 8


def test_generation_config_fills_unset_values_like_model_generate(tiny):
    """do_sample without top_k: model.generate's default top_k (50) applies, and the model's own settings."""
    kw = dict(policy="full", budget=None, max_new_tokens=15, eos_token_ids=[], seeds=[2])
    a = generate(tiny.model, tiny.tokenizer, PROMPTS[0], generation_config=GenerationConfig(do_sample=True), **kw)
    b = generate(tiny.model, tiny.tokenizer, PROMPTS[0], sampling=Sampling(temperature=1.0, top_k=50), **kw)
    c = generate(tiny.model, tiny.tokenizer, PROMPTS[0], sampling=Sampling(temperature=1.0), **kw)
    assert a.token_ids == b.token_ids != c.token_ids
