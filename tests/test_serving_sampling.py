"""Per-request sampling inside continuous batching (serving/sampling.py): a seeded request's tokens do not depend on
its batch-mates, equal the library's own `generate` with the same seed (one sampler for both), and its first token
follows the softmax of the model's logits at the asked temperature (a chi-square test)."""

import time

import pytest
import torch

from epikv import Sampling, generate
from epikv.serving import ServeSpec, start_manager
from test_serving import _prompts, cb_internals  # noqa: F401  (the skip on an untested transformers; prompts)

K, PAGE, RECENT, NEW = 64, 8, 16, 70


class Engine:
    """A started manager behind the app's Backend interface, collecting each request's final tokens."""

    def __init__(self, lm, policy="epikv", num_blocks=256, max_batch_tokens=64):
        from transformers import GenerationConfig

        from epikv.serving.backend import TransformersBackend

        spec = ServeSpec(policy=policy, budget=K if policy != "full" else None, page=PAGE, num_blocks=num_blocks,
                         max_batch_tokens=max_batch_tokens, recency=RECENT if policy != "full" else None)
        self.manager = start_manager(lm.model, spec, GenerationConfig(do_sample=False, max_new_tokens=NEW,
                                                                        eos_token_id=-1))
        self.backend = TransformersBackend(self.manager)
        self.n = 0

    def run(self, requests, timeout=300):
        """requests: [(prompt ids, Sampling or None, seed, max_tokens)] submitted at once -> token lists."""
        rids = []
        for prompt, sampling, seed, max_tokens in requests:
            rid = f"r{self.n}"
            self.n += 1
            self.backend.submit(rid, prompt, max_tokens, sampling=sampling, seed=seed, ignore_eos=False)
            rids.append(rid)
        outs, end = {}, time.monotonic() + timeout
        while len(outs) < len(rids) and time.monotonic() < end:
            o = self.backend.next_output(0.5)
            if o is not None and o.finished:
                assert o.error is None, o.error
                outs[o.request_id] = o.tokens
                self.backend.release(o.request_id)
        assert len(outs) == len(rids), "requests lost"
        assert not self.manager._epikv_runtime.samplers  # every sampler released
        return [outs[r] for r in rids]

    def stop(self):
        self.manager.stop(block=True, timeout=60)


@pytest.fixture(params=["epikv", "full"])
def engine(tiny, request):
    """Function-scoped: on transformers 5.17 a running manager leaves the model on paged attention, so the library's
    own runs (plain forwards) happen before it starts or after it stops."""
    e = Engine(tiny, policy=request.param)
    yield e
    e.stop()


SAMPLED = Sampling(temperature=0.8, top_p=0.95, draw="gumbel")  # as epikv serve samples


def test_seeded_request_alone_or_among_eight_others(engine):
    p = _prompts((23,))[0]
    others = _prompts((12, 30, 9, 28, 17, 26, 14, 31), seed=1)
    alone = engine.run([(p, SAMPLED, 1234, NEW)])[0]
    mixed = [(o, SAMPLED if i % 3 else None, 99 + i, NEW - 5 * i) for i, o in enumerate(others)]
    among = engine.run(mixed[:4] + [(p, SAMPLED, 1234, NEW)] + mixed[4:])
    assert among[4] == alone  # batch-mates, their seeds and their position change nothing
    rt = engine.manager._epikv_runtime
    assert len(alone) == NEW and (rt.stats["evictions"] > 0) == rt.policy.evicts
    again = engine.run([(p, SAMPLED, 1235, NEW), (p, SAMPLED, 1234, NEW)])
    assert again[1] == alone and again[0] != alone  # another seed, another text
    greedy = engine.run([(p, None, 0, NEW)])[0]
    assert greedy != alone  # it really sampled


def test_equals_the_librarys_generate_with_the_same_seed(tiny):
    """One sampler for both: the served tokens equal epikv.generate's with the same policy (page rule), settings
    and seed."""
    prompts = _prompts((23, 32, 11), seed=3)
    sampling = Sampling(temperature=0.7, top_p=0.9, top_k=50, draw="gumbel")
    engine = Engine(tiny)
    try:
        served = engine.run([(p, sampling, 50 + i, NEW) for i, p in enumerate(prompts)])
    finally:
        engine.stop()
    for i, p in enumerate(prompts):
        ref = generate(tiny.model, tiny.tokenizer, [p], policy="epikv", budget=K, page=PAGE, recent=RECENT,
                       max_new_tokens=NEW, sampling=sampling, seeds=[50 + i], eos_token_ids=[-1])
        assert served[i] == ref.token_ids[0], f"prompt {i} differs from generate"


def test_first_token_follows_the_softmax(tiny):
    """Over 1,500 seeds the first sampled token of one prompt follows softmax(top-4 logits / T) (chi-square);
    a wrong temperature (2T, or none) or a row of another request fails it."""
    from scipy.stats import chisquare

    p = _prompts((9,), seed=5)[0]
    with torch.no_grad():
        logits = tiny.model(torch.tensor([p])).logits[0, -1].float()
    top = logits.topk(4)
    # a random model's logits are close: a temperature that spreads these four over e^0 .. e^-3
    temperature = float(top.values[0] - top.values[3]) / 3
    n = 1500
    sampling = Sampling(temperature=temperature, top_k=4, draw="gumbel")
    # a greedy batch-mate of another prompt in every batch: its row must not be the one sampled
    other = _prompts((14,), seed=6)[0]
    reqs = []
    for s in range(n):
        reqs.append((p, sampling, s, 1))
        if s % 50 == 0:
            reqs.append((other, None, 0, 1))
    engine = Engine(tiny)  # after the plain forward above
    try:
        got = [t[0] for t, r in zip(engine.run(reqs), reqs) if r[0] is p]
    finally:
        engine.stop()
    ids = top.indices.tolist()
    assert set(got) <= set(ids)
    counts = [got.count(i) for i in ids]
    def expected(t):
        pr = (top.values.double() / t).softmax(-1)
        return (pr / pr.sum() * len(got)).tolist()

    assert chisquare(counts, expected(temperature)).pvalue > 1e-3, (counts, expected(temperature))
    # the test has power: the counts are far from what twice the temperature would give
    assert chisquare(counts, expected(2 * temperature)).pvalue < 1e-6
