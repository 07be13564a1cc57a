"""EpiKV-Seg and Seg-Q in the paged server (issue 47, item 4): the tier pass on whole pages (seg_page_keep), equal to
the slot rule at page 1, and the server's keep sets equal to the torch engine's at the same page size, Seg-Q's
queries read inside the paged forward.

transformers' paged cache takes pages of 4 tokens or more, so "the server at page 1 gives the dense engine's keep
sets" is shown in two steps that compose: the page rule at page 1 is the slot rule (on constructed inputs and in the
torch engine), and the server at page 4 keeps exactly the torch engine's page-4 sets at every eviction."""

from __future__ import annotations

import pytest
import torch

from epikv import EpiKVError, generate
from epikv.engine import Decoder
from epikv.policies import CacheView
from epikv.policies.epikv_seg import seg_keep, seg_page_keep
from conftest import record_keeps
from epikv.serving import ServeSpec, ServingUnsupported, check_serving, run_batch
from epikv.serving.checks import check_internals


def _view(n, budget, recent, n_protect):
    return CacheView(length=n, budget=budget, token_data={}, n_pad=torch.zeros(1, dtype=torch.long),
                     n_protect=torch.tensor([n_protect]), recent=recent, keys=[], values=[],
                     device=torch.device("cpu"))


@pytest.mark.parametrize("fill, swap", [(False, 0), (True, 0), (True, 3), (False, 2)])
def test_page_rule_at_page_one_is_the_slot_rule(fill, swap):
    g = torch.Generator().manual_seed(1)
    cases = 0
    for n in (41, 64, 97, 130):
        for budget, recent, prot in ((32, 8, 5), (48, 16, 11), (40, 0, 3), (60, 12, 20)):
            if n <= budget:
                continue
            rank = torch.randn(1, n, generator=g)
            stat = torch.rand(1, n, generator=g)
            value = torch.rand(1, n, generator=g)
            v = _view(n, budget, recent, prot)
            ref = seg_keep(rank, stat, v, 8, (6, 3, 1), fill, value, swap)
            got = seg_page_keep(rank, stat, v, 1, 8, (6, 3, 1), fill, value, swap)
            if recent == 0:  # the paged rule always keeps the newest page (the one being written)
                ref = torch.unique(torch.cat([ref[0], torch.tensor([n - 1])]))[None]
                if ref.shape[-1] > got.shape[-1]:  # the slot rule's budget had one more slot to give
                    continue
            assert torch.equal(got, ref), (n, budget, recent, prot)
            cases += 1
    assert cases >= 10


def test_page_rule_keeps_whole_pages_by_page_mean_within_budget():
    """Pages of 4: prompt pages, recency pages and the newest page whole; a tier keeps cap // page pages, ranked by
    the mean of their slots (a page with one high slot loses to a page that is high throughout)."""
    n, page, prot, recent, budget = 50, 4, 6, 8, 32
    rank = torch.zeros(1, n)
    rank[0, 8:12] = torch.tensor([9.0, -9.0, -9.0, -9.0])  # page 2: the highest slot, a low mean
    rank[0, 12:16] = 1.0  # page 3: the highest mean
    stat = torch.ones(1, n)  # one tier for every segment: R
    keep = seg_page_keep(rank, stat, _view(n, budget, recent, prot), page, 16, (4, 4, 4))[0]
    pages = sorted(set((keep // page).tolist()))
    assert keep.numel() == (len(pages) - 1) * page + (n - 12 * page)  # whole pages, the newest holds n - 48 slots
    assert keep.numel() <= budget
    assert {0, 1} <= set(pages) and {10, 11, 12} <= set(pages)  # prompt (slots 0-5), window (42-49), newest
    assert 3 in pages and 2 not in pages  # one page per segment (cap 4 // 4): the page with the higher mean


def test_page_rule_refusals():
    v = _view(40, 32, 8, 4)
    with pytest.raises(EpiKVError, match="multiple of the page size"):
        seg_page_keep(torch.zeros(1, 40), torch.zeros(1, 40), v, 4, 10, (4, 4, 4))
    with pytest.raises(EpiKVError, match="too small"):
        seg_page_keep(torch.zeros(1, 40), torch.zeros(1, 40), _view(40, 12, 8, 6), 4, 8, (4, 4, 4))


def _record(monkeypatch):
    """Every keep set any engine asks PolicyState for, per PolicyState (one per generation or request), with the
    queries the view held (Seg-Q)."""
    return record_keeps(monkeypatch, lambda keep, kw: (
        keep.detach().cpu().clone(), [x.detach().cpu().clone() for x in kw.get("queries") or () if x is not None]))


@pytest.mark.parametrize("policy", ["epikv-seg-q", "epikv-seg"])
def test_torch_engine_page_one_equals_the_slot_rule(tiny, policy, monkeypatch):
    """In the torch engine, page=1 keeps the same set as the slot rule at every eviction (same tokens fed)."""
    ids = torch.randint(0, 1000, (1, 130), generator=torch.Generator().manual_seed(4))
    runs = []
    for page in (0, 1):
        seen = _record(monkeypatch)
        dec = Decoder(tiny.model, policy, 48, tau=8, segment=8, caps=(6, 3, 1), recent=8, page=page)
        with torch.inference_mode():
            dec.prefill(ids[:, :10], [0])
            for i in range(10, ids.shape[1]):
                dec.step(ids[:, i : i + 1])
        (keeps,) = seen.values()
        runs.append([k for k, _ in keeps])
        monkeypatch.undo()
    assert len(runs[0]) >= 5
    assert [k.tolist() for k in runs[1]] == [k.tolist() for k in runs[0]]


SETTINGS = dict(segment=16, caps=(8, 4, 4))


@pytest.mark.parametrize("policy", ["epikv-seg-q", "epikv-seg"])
def test_server_keep_sets_equal_the_torch_engine(tiny, policy, monkeypatch):
    """Served (continuous batching, 3 requests in one forward, one prefilled in chunks) at page 4, every request's
    keep sets and tokens equal the torch engine's batch-1 run at page 4; Seg-Q ranks with queries the paged forward
    recomputed, equal to the torch cache's. The 40-token prompt is evicted 25 tokens after it, when 7 of Seg-Q's 32
    queries are still the prompt's newest (its forward held 40 > 32 tokens)."""
    try:
        check_internals()
    except ServingUnsupported as e:
        pytest.skip(f"transformers lacks {e.missing}")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (40, 20, 9)]
    settings = {**SETTINGS, "queries": 32} if policy == "epikv-seg-q" else SETTINGS
    seen = _record(monkeypatch)
    spec = ServeSpec(policy=policy, budget=64, page=4, num_blocks=96, max_batch_tokens=64, recency=4, tau=8,
                     settings=settings)
    outs, stats = run_batch(tiny.model, spec, prompts, 100)
    served = sorted(seen.values(), key=lambda s: [k.tolist() for k, _ in s])  # by content: requests interleave
    seen.clear()
    refs = [generate(tiny.model, tiny.tokenizer, [p], policy=policy, budget=64, max_new_tokens=100, page=4,
                     recent=4, tau=8, **settings) for p in prompts]
    dense = sorted(seen.values(), key=lambda s: [k.tolist() for k, _ in s])
    assert stats["chunked_prefills"] >= 1 and stats["max_batch"] >= 3
    assert [o for o in outs] == [r.token_ids[0] for r in refs]
    assert len(served) == len(prompts) and sum(map(len, served)) >= 6
    assert [[k.tolist() for k, _ in s] for s in served] == [[k.tolist() for k, _ in d] for d in dense]
    n_q = 0
    for s, d in zip(served, dense):
        for (_, qs), (_, qd) in zip(s, d):
            assert len(qs) == len(qd) == (policy == "epikv-seg-q")
            for a, b in zip(qs, qd):
                assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5)
                n_q += 1
    assert n_q >= (6 if policy == "epikv-seg-q" else 0)


def test_served_seg_refusals(tiny):
    base = dict(budget=64, page=8, num_blocks=32, max_batch_tokens=32)
    with pytest.raises(EpiKVError, match="multiple of the page size 8"):
        check_serving(tiny.model, ServeSpec(policy="epikv-seg", settings={"segment": 12}, **base))
    for name in ("epikv-seg", "epikv-seg-q"):
        assert check_serving(tiny.model, ServeSpec(policy=name, **base)).page == 8
