"""EpiKVCache inside model.generate: later turns, deepcopy, hooks that must see the cache, beams,
num_return_sequences and left-padded batches. Oracles: DynamicCache when nothing is evicted; with eviction, the
full model under a 4D mask that shows each query exactly what the cache held, and the engine's single-row runs."""

import copy

import pytest
import torch
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

import epikv.hooks as cache_mod  # the hooks read the cache from the forward's kwargs
from epikv.buffers import select_state_rows
from epikv import EpiKVCache, EpiKVError, generate
from epikv.cache import cache_kwarg
from epikv.engine import Decoder

PROMPTS = ["The quick brown fox jumps over the lazy dog and then", "Once upon a time"]
MORE = [[11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]]  # the user's next turn (token ids)


def gen(model, ids, c, n, **kw):
    """Greedy model.generate with cache c (under the version's kwarg); ids [batch, L] or a BatchEncoding dict."""
    inputs = dict(ids) if not isinstance(ids, torch.Tensor) else {"input_ids": ids}
    kw = dict(dict(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0), **kw)
    return model.generate(**inputs, **kw, **{cache_kwarg(model): c})


class Visibility:
    """Records, for every forward through the model, which true positions each new token could attend to: the
    positions stored in the cache before the forward, plus the new tokens up to itself."""

    def __init__(self, model, c):
        self.c, self.rows, self.last = c, {}, []
        self.handle = model.model.register_forward_pre_hook(self.hook, with_kwargs=True)

    def hook(self, module, args, kwargs):
        stored = self.c.token_data["pos"][0].tolist() if "pos" in self.c.token_data else []
        start = self.c.seen[0].item() if self.c.seen is not None else 0
        t = kwargs["input_ids"].shape[1]
        for j in range(t):
            self.rows[start + j] = stored + list(range(start, start + j + 1))
        self.last.append(start + t - 1)

    def oracle_logits(self, model, ids):
        """Full-model logits at each forward's last position, under the 4D mask of what the cache showed."""
        self.handle.remove()
        n = max(self.rows) + 1
        mask = torch.zeros(n, n, dtype=torch.bool)
        for q, ks in self.rows.items():
            mask[q, ks] = True
        with torch.inference_mode():
            logits = model(ids[:, :n], attention_mask=mask[None, None]).logits[0]
        return logits[self.last]


# -- item 1: a second turn on the same cache ------------------------------------------------------------------------
@pytest.mark.parametrize("policy,budget", [("epikv", 4096), ("full", None)])
def test_second_turn_equals_dynamic_cache(tiny, policy, budget):
    """Above the budget nothing is evicted: two turns on one EpiKVCache give DynamicCache's tokens, and the cache
    has seen exactly the tokens fed (the last generated one is fed by the next turn)."""
    m, enc = tiny.model, tiny.tokenizer(PROMPTS[0], return_tensors="pt")
    runs = []
    for c in (DynamicCache(), EpiKVCache(m, policy, budget=budget)):
        out = gen(m, enc, c, 10)
        out2 = gen(m, torch.cat([out, torch.tensor(MORE)], 1), c, 10)
        runs.append((out2, c.get_seq_length()))
    (ref, ref_seen), (got, seen) = runs
    assert got.tolist() == ref.tolist()
    assert seen == ref_seen == got.shape[1] - 1


@pytest.mark.parametrize("policy,tau", [("epikv", 1), ("epikv", 4), ("streaming", 1)])
def test_second_turn_matches_masked_full_oracle(tiny, policy, tau):
    """Both turns under eviction: every step's logits equal the full model's under a 4D mask that shows each
    query exactly what the cache held (so only the unseen suffix was fed, at true positions, with the policy's
    state continuing); the cache has seen every token fed and stores at most budget + tau - 1."""
    m, enc = tiny.model, tiny.tokenizer(PROMPTS[0], return_tensors="pt")
    c = EpiKVCache(m, policy, budget=20, tau=tau)
    vis = Visibility(m, c)
    out = gen(m, enc, c, 20, output_logits=True, return_dict_in_generate=True)
    evicted_in_turn_1 = c.evictions
    ids2 = torch.cat([out.sequences, torch.tensor(MORE)], 1)
    out2 = gen(m, ids2, c, 15, output_logits=True, return_dict_in_generate=True)
    got = torch.cat([torch.cat(out.logits), torch.cat(out2.logits)])
    ref = vis.oracle_logits(m, out2.sequences)
    assert evicted_in_turn_1 > 0 and c.evictions > evicted_in_turn_1
    assert c.get_seq_length() == c.seen[0].item() == out2.sequences.shape[1] - 1
    assert c.stored_length() <= 20 + tau - 1
    assert len(vis.last) == got.shape[0] == 20 + 15
    assert torch.allclose(got, ref, atol=1e-4), (got - ref).abs().max()


def test_deepcopy_forks_a_conversation(tiny):
    """A deep copy continues exactly as the original would, and independently of it."""
    m, enc = tiny.model, tiny.tokenizer(PROMPTS[0], return_tensors="pt")
    c = EpiKVCache(m, "epikv", budget=20, tau=2)
    out = gen(m, enc, c, 20)
    fork = copy.deepcopy(c)
    a = torch.cat([out, torch.tensor(MORE)], 1)
    b = torch.cat([out, torch.tensor([[31, 32, 33, 34, 35]])], 1)
    fork_b = gen(m, b, fork, 12)  # the fork takes turn b first: the original must not notice
    orig_a = gen(m, a, c, 12)
    fresh = EpiKVCache(m, "epikv", budget=20, tau=2)  # the reference for turn b: the same history, never forked
    gen(m, enc, fresh, 20)
    assert fork_b.tolist() == gen(m, b, fresh, 12).tolist()
    ref = EpiKVCache(m, "epikv", budget=20, tau=2)
    gen(m, enc, ref, 20)
    assert orig_a.tolist() == gen(m, a, ref, 12).tolist()
    assert c.evictions > 0 and fork.evictions > 0 and fork.seen[0].item() != c.seen[0].item()


# -- item 2: a forward the hooks cannot see is refused ----------------------------------------------------------------
def test_cache_passed_positionally_is_refused(tiny):
    """model.model(ids, mask, positions, cache): the decoder layers get the cache, the hooks on the stack do not.
    Writing to it would decode with stale positions and no eviction: refused before anything is written."""
    m = tiny.model
    c = EpiKVCache(m, "epikv", budget=20)
    ids = tiny.tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    gen(m, ids, c, 3)
    stored = c.stored_length()
    with torch.inference_mode(), pytest.raises(EpiKVError, match="hooks did not see"):
        m.model(ids[:, :1], None, None, c)
    assert c.stored_length() == stored


def test_cache_under_another_name_is_refused(tiny, monkeypatch):
    """A model that passes the cache under a name the hooks do not look up: refused, never decoded silently."""
    m = tiny.model
    c = EpiKVCache(m, "epikv", budget=20)
    monkeypatch.setattr(cache_mod, "_cache_from", lambda kwargs: None)
    with pytest.raises(EpiKVError, match="hooks did not see"):
        gen(m, tiny.tokenizer(PROMPTS[0], return_tensors="pt"), c, 3)


def test_layer_hooks_that_miss_the_cache_are_refused(tiny, monkeypatch):
    """The stack's hooks see the cache but a block's does not (its kwargs name it otherwise): refused."""
    m = tiny.model
    c = EpiKVCache(m, "epikv", budget=20)
    real = cache_mod._cache_from
    monkeypatch.setattr(cache_mod, "_cache_from", lambda kwargs: real(kwargs) if "input_ids" in kwargs else None)
    with pytest.raises(EpiKVError, match="did not find the cache"):
        gen(m, tiny.tokenizer(PROMPTS[0], return_tensors="pt"), c, 3)


# -- item 3: beams and num_return_sequences ----------------------------------------------------------------------------
class Record(LogitsProcessor):
    """Keeps each step's (running sequences, log-probabilities): row r's tokens are exactly what cache row r has
    consumed when the step's scores are computed."""

    def __init__(self):
        self.steps = []

    def __call__(self, input_ids, scores):
        self.steps.append((input_ids.clone(), scores.float().log_softmax(-1)))  # (beam search: already log-probs)
        return scores


def single_row_logprobs(model, prompt_len, rows, policy, budget, tau):
    """Teacher-forced single-sequence reference: the engine fed the prompt in one forward, then token by token
    (the schedule model.generate follows), under the same policy; log-softmax after every prefix."""
    out = {}
    with torch.inference_mode():
        for row in rows:
            dec = Decoder(model, policy, budget=budget, tau=tau)
            ids = torch.tensor([row])
            lp = [dec.prefill(ids[:, :prompt_len], [0])[0].log_softmax(-1)]
            for t in range(prompt_len, len(row)):
                lp.append(dec.step(ids[:, t : t + 1])[0].log_softmax(-1))
            for k in range(prompt_len, len(row) + 1):
                out[tuple(row[:k])] = lp[k - prompt_len]
    return out


def check_rows_against_single_runs(model, rec, prompt_len, policy, budget, tau):
    last_rows = rec.steps[-1][0].tolist()
    ref = single_row_logprobs(model, prompt_len, last_rows, policy, budget, tau)
    missing = {tuple(r) for ids, _ in rec.steps for r in ids.tolist()} - ref.keys()
    ref.update(single_row_logprobs(model, prompt_len, [list(r) for r in missing], policy, budget, tau))
    worst = 0.0
    for ids, scores in rec.steps:
        for r, row in enumerate(ids.tolist()):
            worst = max(worst, (scores[r] - ref[tuple(row)]).abs().max().item())
    assert worst < 1e-4, worst


def test_beams_equal_dynamic_cache_above_budget(tiny):
    tiny.tokenizer.padding_side = "left"
    m, enc = tiny.model, tiny.tokenizer(PROMPTS, return_tensors="pt", padding=True)
    kw = dict(num_beams=3, num_return_sequences=2, length_penalty=0.0)
    ref = gen(m, enc, DynamicCache(), 16, **kw)
    got = gen(m, enc, EpiKVCache(m, "epikv", budget=4096), 16, **kw)
    assert got.tolist() == ref.tolist()


@pytest.mark.parametrize("policy,beams", [("epikv", 2), ("streaming", 3)])  # epikv: 2 rows = its 2 channels
def test_beams_with_eviction_match_single_row_runs(tiny, policy, beams):
    """Beam search reorders cache rows every step. With eviction, each beam must see exactly the log-probabilities
    a single-sequence run over that beam's own tokens sees (its evictions decided on its own history): the layers,
    token data, positions and the policy's rolling state (epikv) all follow the beam."""
    m = tiny.model
    ids = tiny.tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    c = EpiKVCache(m, policy, budget=16, tau=1)
    rec = Record()
    gen(m, ids, c, 20, num_beams=beams, logits_processor=LogitsProcessorList([rec]))
    assert c.evictions > 5
    check_rows_against_single_runs(m, rec, ids.shape[1], policy, 16, 1)


def test_num_return_sequences_sampled(tiny):
    """num_return_sequences > 1 with sampling: DynamicCache's samples above the budget; with eviction, every row's
    log-probabilities equal its own single-sequence run."""
    m, enc = tiny.model, tiny.tokenizer(PROMPTS[0], return_tensors="pt")
    kw = dict(do_sample=True, num_return_sequences=3, top_k=0)
    torch.manual_seed(0)
    ref = gen(m, enc, DynamicCache(), 12, **kw)
    torch.manual_seed(0)
    assert gen(m, enc, EpiKVCache(m, "epikv", budget=4096), 12, **kw).tolist() == ref.tolist()
    rec = Record()
    c = EpiKVCache(m, "epikv", budget=16, tau=2)
    gen(m, enc, c, 24, logits_processor=LogitsProcessorList([rec]), **kw)
    assert c.evictions > 0 and len({tuple(r) for r in rec.steps[-1][0].tolist()}) == 3
    check_rows_against_single_runs(m, rec, enc.input_ids.shape[1], "epikv", 16, 2)


def test_rows_repeated_and_selected(tiny):
    """One prompt prefilled once, repeated into two rows that continue differently: each equals a cache that saw
    only its own row; selecting a row back keeps exactly that row."""
    m, enc = tiny.model, tiny.tokenizer(PROMPTS[0], return_tensors="pt")
    c = EpiKVCache(m, "epikv", budget=20, tau=1)
    out = gen(m, enc, c, 16)
    c.batch_repeat_interleave(2)
    more = torch.tensor([MORE[0][:5], [41, 42, 43, 44, 45]])
    both = gen(m, torch.cat([out.expand(2, -1), more], 1), c, 12)
    for r in range(2):
        alone = EpiKVCache(m, "epikv", budget=20, tau=1)
        gen(m, enc, alone, 16)
        assert both[r].tolist() == gen(m, torch.cat([out, more[r : r + 1]], 1), alone, 12)[0].tolist()
    c.batch_select_indices(torch.tensor([1]))
    third = gen(m, torch.cat([both[1:], torch.tensor([[7, 8]])], 1), c, 6)
    assert c.n_pad.shape == (1,) and c.get_seq_length() == third.shape[1] - 1
    with pytest.raises(EpiKVError, match="holds 1 sequences but the forward feeds 2"):
        gen(m, torch.cat([third, third]), c, 2)


def test_state_rows_follow_the_contract():
    """Per-row tensors (dim 0 = batch) are reordered through dicts, lists and objects; '_' keys are shared."""
    from epikv.signals import RollingStats

    stats = RollingStats(4)
    stats.hist = torch.arange(6.0).view(3, 2, 1)
    state = {"per_row": [torch.tensor([0, 1, 2])], "_shared": torch.tensor([5, 6, 7]), "stats": stats, "n": 3}
    out = select_state_rows(state, torch.tensor([2, 2, 0]), 3)
    assert out["per_row"][0].tolist() == [2, 2, 0] and out["_shared"].tolist() == [5, 6, 7]
    assert stats.hist[:, 0, 0].tolist() == [4.0, 4.0, 0.0] and out["n"] == 3


# -- item 4: left-padded batches ---------------------------------------------------------------------------------------
def test_padded_batch_rows_match_single_runs_and_engine(tiny):
    """A left-padded batch through model.generate with eviction (tau = 1): per row the tokens of that row run
    alone, and the tokens of epikv.generate on the batch."""
    tok = tiny.tokenizer
    tok.padding_side = "left"
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    c = EpiKVCache(tiny.model, "epikv", budget=20, tau=1)
    out = gen(tiny.model, enc, c, 40)[:, enc.input_ids.shape[1]:].tolist()
    assert c.evictions > 0 and c.n_pad.tolist() == [0, 0]
    for i, p in enumerate(PROMPTS):
        alone = gen(tiny.model, tok(p, return_tensors="pt"), EpiKVCache(tiny.model, "epikv", budget=20, tau=1), 40)
        assert out[i] == alone[0, -40:].tolist()
    res = generate(tiny.model, tok, PROMPTS, policy="epikv", budget=20, tau=1, max_new_tokens=40, eos_token_ids=[])
    assert out == res.token_ids


@pytest.mark.parametrize("policy", ["lag-kv", "streaming"])
def test_padded_batch_second_turn(tiny, policy):
    """The padding of the first turn stays known: a second turn (mask passed as generate expects) continues each
    row as the row alone does."""
    tok = tiny.tokenizer
    tok.padding_side = "left"
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    c = EpiKVCache(tiny.model, policy, budget=20, tau=1)
    out = gen(tiny.model, enc, c, 20)
    more = torch.tensor(MORE * 2)
    ids2 = torch.cat([out, more], 1)
    mask2 = torch.cat([enc.attention_mask, torch.ones(2, ids2.shape[1] - enc.attention_mask.shape[1], dtype=torch.long)], 1)
    both = gen(tiny.model, {"input_ids": ids2, "attention_mask": mask2}, c, 15)[:, -15:]
    for i, p in enumerate(PROMPTS):
        alone = EpiKVCache(tiny.model, policy, budget=20, tau=1)
        o = gen(tiny.model, tok(p, return_tensors="pt"), alone, 20)
        assert both[i].tolist() == gen(tiny.model, torch.cat([o, more[:1]], 1), alone, 15)[0, -15:].tolist()


def test_padding_in_a_later_turn_is_refused(tiny):
    m = tiny.model
    c = EpiKVCache(m, "epikv", budget=64)
    out = gen(m, tiny.tokenizer(PROMPTS[0], return_tensors="pt"), c, 3)
    ids2 = torch.cat([out, torch.tensor([[5, 6, 7]])], 1)
    mask2 = torch.ones_like(ids2)
    mask2[0, -2] = 0
    with pytest.raises(EpiKVError, match="must all be real"):
        gen(m, {"input_ids": ids2, "attention_mask": mask2}, c, 2)


def test_knorm_later_turn_is_refused_clearly(tiny):
    """knorm's uncompressed layers grow longer than the rest once it evicts: its first turn matches the engine,
    a later multi-token turn cannot be masked in one forward and is refused with what to do instead."""
    m, tok = tiny.model, tiny.tokenizer
    c = EpiKVCache(m, "knorm", budget=16, tau=1)
    out = gen(m, tok(PROMPTS[0], return_tensors="pt"), c, 20)
    res = generate(m, tok, PROMPTS[0], policy="knorm", budget=16, tau=1, max_new_tokens=20, eos_token_ids=[])
    assert out[0, -20:].tolist() == res.token_ids[0] and c.evictions > 0
    with pytest.raises(EpiKVError, match="Decoder.step"):
        gen(m, torch.cat([out, torch.tensor([[5, 6]])], 1), c, 2)
