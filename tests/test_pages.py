"""Page-granular eviction (Policy.page, policies/pages.py): whole aligned pages of B slots kept or dropped by their
mean score, prompt / recency / newest pages kept whole, at most K and at least K - B + 1 slots kept, the alignment
an invariant through the engine, and refusals."""

import json

import pytest
import torch

from epikv import EpiKVError, get_policy
from epikv.cli import main
from epikv.engine import Decoder
from epikv.policies import CacheView, select_keep
from epikv.policies.pages import page_keep, page_overflow


def view(n, budget, recent, n_protect, n_pad=(0,)):
    return CacheView(length=n, budget=budget, token_data={}, n_pad=torch.tensor(list(n_pad)),
                     n_protect=torch.tensor([n_protect] * len(n_pad)), recent=recent, keys=[], values=[],
                     device=torch.device("cpu"))


def pages_of(keep, page):
    """The set of page indices a keep list covers, checking each is covered whole (but the newest)."""
    got = {}
    for s in keep:
        got.setdefault(s // page, []).append(s)
    return got


def test_whole_pages_ranked_by_mean_score():
    # 10 pages of 4; prompt = 2 slots (page 0), recent = 3 (page 9, slots 37-39); budget 20 = 5 pages: 3 compete in
    n, page = 40, 4
    pr = torch.zeros(1, n)
    pr[0, 4:8] = torch.tensor([9.0, -9, -9, -9])  # page 1: highest single score, mean -4.5: dropped
    pr[0, 8:12] = 1.0  # page 2: mean 1
    pr[0, 12:16] = torch.tensor([3.0, 3, -1, -1])  # page 3: mean 1, ties page 2 ... both beat page 4
    pr[0, 16:20] = 0.5  # page 4: mean 0.5
    pr[0, 20:24] = 2.0  # page 5: mean 2
    keep = page_keep(pr, view(n, 20, 3, 2), page)[0].tolist()
    assert keep == list(range(0, 4)) + list(range(8, 16)) + list(range(20, 24)) + list(range(36, 40))
    # token granularity would have kept slot 4 (score 9)
    assert 4 in select_keep(pr, view(n, 20, 3, 2))[0].tolist()


def test_padding_is_left_out_of_an_unprotected_page_mean():
    # 6 pages of 4, 6 padding slots, nothing protected but the recency window (2 slots, the newest page): page 0 is
    # padding only, page 1 holds padding 4-5 and real 6-7. Budget 12 = the newest page + the 2 best others.
    n, page = 24, 4
    pr = torch.zeros(1, n)
    pr[0, :6] = -100.0  # whatever a policy gives padding: it must not count
    pr[0, 6:8] = 2.0  # page 1: mean 2 over its real slots (-49 if the padding counted)
    pr[0, 8:12] = 1.5  # page 2
    pr[0, 12:16] = 1.0  # page 3
    keep = page_keep(pr, view(n, 12, 2, 0, n_pad=(6,)), page)[0].tolist()
    assert keep == list(range(4, 12)) + list(range(20, 24))


def test_select_keep_ties_go_to_the_newer_slot_whatever_the_batch():
    """Equal priorities (e.g. the prompt's 0 scores under decode-only windows, protect_prompt off; padding) are
    broken by slot, the newer first: a row keeps the same set alone and in any batch."""
    n, budget = 300, 40
    pr = torch.zeros(1, n)
    pr[0, [50, 120, 200]] = 1.0  # three clear winners, the rest of the middle ties
    expect = [0, 1] + [50, 120, 200] + list(range(n - 2 - (budget - 2 - 2 - 3), n - 2)) + [n - 2, n - 1]
    v1 = CacheView(length=n, budget=budget, token_data={}, n_pad=torch.tensor([0]), n_protect=torch.tensor([2]),
                   recent=2, keys=[], values=[], device=torch.device("cpu"))
    assert select_keep(pr, v1)[0].tolist() == sorted(expect)
    other = torch.randn(3, n, generator=torch.Generator().manual_seed(0))
    v4 = CacheView(length=n, budget=budget, token_data={}, n_pad=torch.zeros(4, dtype=torch.long),
                   n_protect=torch.full((4,), 2), recent=2, keys=[], values=[], device=torch.device("cpu"))
    assert select_keep(torch.cat([other, pr]), v4)[3].tolist() == sorted(expect)
    per_head = pr.expand(2, 3, n)[None]  # [batch, layers, heads, n]: the same rule per head
    assert (select_keep(per_head, v1)[0] == torch.tensor(sorted(expect))).all()
    # padding (a row with fewer real tokens than the budget): the newest padding is kept, right before the real ones
    vp = CacheView(length=20, budget=12, token_data={}, n_pad=torch.tensor([10]), n_protect=torch.tensor([2]),
                   recent=2, keys=[], values=[], device=torch.device("cpu"))
    assert select_keep(torch.zeros(1, 20), vp)[0].tolist() == list(range(8, 20))


def test_protected_pages_are_kept_whole():
    # prompt 5 slots: pages 0 and 1 (slots 5-7 are decode slots kept with the prompt's page); recent 6 of 42:
    # slots 36-41, pages 9 (36-39) and 10 (40-41, the newest, partial): kept whole whatever the scores
    n, page = 42, 4
    pr = torch.arange(n, dtype=torch.float32)[None].flip(-1)  # older = higher, newest lowest
    keep = page_keep(pr, view(n, 26, 6, 5), page)[0].tolist()
    got = pages_of(keep, page)
    assert {0, 1, 9, 10} <= set(got)
    assert all(len(v) == page for p, v in got.items() if p != 10) and got[10] == [40, 41]
    assert len(keep) == 26  # (J - 1) * 4 + 2 with J = (26 - 2) // 4 + 1 = 7: pages 0-4 by score (oldest first)
    assert sorted(got) == [0, 1, 2, 3, 4, 9, 10]


@pytest.mark.parametrize("page", [3, 8, 16])
def test_kept_count_between_budget_minus_page_and_budget(page):
    g = torch.Generator().manual_seed(page)
    for n in range(70, 160, 7):
        for budget in (48, 64, 67):
            pr = torch.randn(2, n, generator=g)
            keep = page_keep(pr, view(n, budget, 5, 3, n_pad=(0, 0)), page)
            m = keep.shape[-1]
            assert budget - page + 1 <= m <= budget, (n, budget, m)
            for row in keep.tolist():
                assert row == sorted(set(row)) and row[-1] == n - 1
                got = pages_of(row, page)
                newest = (n - 1) // page
                assert all(len(v) == page for p, v in got.items() if p != newest)
                assert len(got[newest]) == n - newest * page


def test_page_of_one_is_token_granularity():
    g = torch.Generator().manual_seed(0)
    for n in (40, 57, 90):
        pr = torch.randn(3, n, generator=g)
        v = view(n, 32, 6, 4, n_pad=(0, 0, 0))
        assert torch.equal(page_keep(pr, v, 1), select_keep(pr, v))


def test_left_padded_rows_share_boundaries_and_drop_padding_first():
    # row 0 has 6 padding slots (page 0 all padding, page 1 half), row 1 none; both keep the same count
    n, page = 48, 4
    pr = torch.full((2, n), -5.0)  # below 0, what a page of padding would average if padding were not excluded
    keep = page_keep(pr, view(n, 24, 4, 2, n_pad=(6, 0)), page)
    assert keep.shape == (2, 24)
    row0 = keep[0].tolist()
    assert 0 not in row0 and row0[:4] == [4, 5, 6, 7]  # padding-only page dropped; the prompt's page kept whole
    assert keep[1].tolist()[:4] == [0, 1, 2, 3]
    # a row with too few real pages keeps padding pages as filler (rectangular), the real ones all kept
    short = page_keep(torch.zeros(2, 24), view(24, 16, 4, 2, n_pad=(14, 0)), page)
    assert short.shape == (2, 16) and set(range(16, 24)) <= set(short[0].tolist())


def test_newest_page_kept_without_a_recency_window():
    # recent 0: the partial page being written (slots 40-41, the lowest scores) is still kept, and counted
    n, page = 42, 4
    pr = -torch.arange(n, dtype=torch.float32)[None]
    keep = page_keep(pr, view(n, 20, 0, 2), page)[0].tolist()
    assert keep == list(range(16)) + [40, 41]


def test_nan_scores_never_win_a_page():
    n, page = 32, 4
    pr = torch.zeros(1, n)
    pr[0, 8:12] = float("nan")
    pr[0, 12:16] = -100.0
    keep = page_keep(pr, view(n, 28, 4, 2), page)[0].tolist()
    assert 8 not in keep and 12 in keep


def test_budget_too_small_for_the_protected_pages():
    # prompt 5 -> pages 0, 1; recent 7 of 42 (slots 35-41) -> pages 8, 9, 10: 4 * 4 + 2 = 18 slots > 16, though
    # 5 + 7 tokens fit; with recent 6 (pages 9, 10) it fits
    with pytest.raises(EpiKVError, match="too small for pages of 4"):
        page_keep(torch.zeros(1, 42), view(42, 16, 7, 5), 4)
    assert page_keep(torch.zeros(1, 42), view(42, 16, 6, 5), 4).shape == (1, 14)


def _refuses_somewhere(budget, page, prot, recent, upto):
    for n in range(budget + 1, upto):
        try:
            page_keep(torch.zeros(1, n), view(n, budget, recent, prot), page)
        except EpiKVError as e:
            return str(e)
    return None


@pytest.mark.parametrize("budget, page, recent", [(16, 4, 6), (16, 4, 7), (128, 16, 32), (64, 8, 0), (40, 8, 13),
                                                  (42, 8, 5), (30, 4, 9), (45, 8, 11), (50, 16, 3)])
def test_page_overflow_up_front_agrees_with_page_keep(budget, page, recent):
    """The up-front check refuses exactly the protected lengths page_keep would refuse at some cache length (and
    with its line), so a served request is refused before admission instead of failing mid-answer."""
    for prot in range(0, budget - recent + 1):
        got = page_overflow(budget, page, prot, recent)
        want = _refuses_somewhere(budget, page, prot, recent, budget + prot + recent + 4 * page)
        assert (got is None) == (want is None), (prot, got, want)
        if got:
            assert "too small for pages of" in got
    # the case: 94 protected + 32 recent fit K = 128 in tokens, not in pages of 16 (6 + 3 pages > 8)
    assert "need 129 slots" in page_overflow(128, 16, 94, 32)
    pol = get_policy("epikv", page=16)
    assert pol.protected_overflow(128, 32, 94) == page_overflow(128, 16, 94, 32)
    assert get_policy("epikv").protected_overflow(128, 32, 94) is None  # token granularity: it fits


@pytest.mark.parametrize("tau", [1, 5])
def test_engine_evicts_whole_aligned_pages(tiny, tau):
    """Stored true positions: every full page of slots (from slot 0) is a run of consecutive positions, after every
    step; the cache stays within K and ends at least K - B + 1 after each eviction."""
    page, budget = 8, 64
    ids = torch.randint(5, 200, (1, 260), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        dec = Decoder(tiny.model, get_policy("epikv", tau=tau, page=page), budget)
        dec.prefill(ids[:, :11], [0])
        for t in range(11, 260, tau):
            before = dec.cache.evictions
            dec.step(ids[:, t : t + tau])
            pos = dec.cache.token_data["pos"][0]
            n = pos.shape[0]
            full = pos[: n - n % page].view(-1, page)  # [pages, page]
            assert bool((full.diff(dim=-1) == 1).all()), pos.tolist()
            assert pos[n - n % page:].diff().eq(1).all()  # the newest, partial page too
            if dec.cache.evictions > before:
                assert budget - page + 1 <= n <= budget
    assert dec.cache.evictions > 5
    assert pos[:11].tolist() == list(range(11)) and pos[-1].item() == 259  # prompt and newest kept
    first = dec.cache.token_data["pos"][0][: 2 * page].tolist()
    assert first == list(range(16))  # the prompt's pages (11 tokens -> 2 pages) kept whole


def test_engine_page_choice_follows_mean_scores(tiny):
    """The kept decode pages are the ones with the highest mean epikv score among those that competed: checked
    against page_keep on the scores the cache holds just before an eviction."""
    page, budget = 8, 48
    ids = torch.randint(5, 200, (1, 120), generator=torch.Generator().manual_seed(2))
    pol = get_policy("epikv", tau=1, page=page)
    seen = []
    orig = type(pol).keep

    def spy(self, state, v):
        out = orig(self, state, v)
        seen.append((v.token_data["score"].clone(), v.token_data["pos"].clone(), out))
        return out

    with torch.inference_mode():
        dec = Decoder(tiny.model, pol, budget)
        pol.keep = spy.__get__(pol)
        dec.prefill(ids[:, :6], [0])
        for t in range(6, 120):
            dec.step(ids[:, t : t + 1])
    assert seen
    for score, pos, keep in seen:
        n = score.shape[-1]
        means = [score[0, i : i + page].mean().item() for i in range(0, n - n % page, page)]
        kept_pages = sorted({s // page for s in keep[0].tolist()})
        recent_first = (n - dec.cache.recent) // page
        competing = [p for p in range(1, recent_first)]  # page 0 holds the prompt
        dropped = [p for p in competing if p not in kept_pages]
        kept = [p for p in competing if p in kept_pages]
        assert dropped and (not kept or min(means[p] for p in kept) >= max(means[p] for p in dropped))


def test_refusals():
    for name, why in (("h2o", "keeps per head"), ("tova", "keeps per layer"), ("full", "never evicts")):
        with pytest.raises(EpiKVError, match=why):
            get_policy(name, page=8)
    # Seg's own keep rule honours pages (seg_page_keep) when a page belongs to one segment; another own rule does not
    assert get_policy("epikv-seg-q", page=8).page == 8
    with pytest.raises(EpiKVError, match="multiple of the page size 12"):
        get_policy("epikv-seg", page=12)
    from epikv.policies.epikv_seg import EpiKVSeg

    class Own(EpiKVSeg):
        own_page_rule = False

    with pytest.raises(EpiKVError, match="own keep rule"):
        Own(page=8)
    with pytest.raises(EpiKVError, match="must not be negative"):
        get_policy("epikv", page=-1)
    assert get_policy("h2o", page=0).page == 0 and get_policy("epikv-seg").page == 0


def test_cli_setting_and_refusal(capsys):
    argv = ["generate", "--model", "random:tiny", "--prompt", "Hello there, my friend", "--raw", "--max-new-tokens", "40",
            "--budget", "32", "--recent", "4", "--json", "--set"]
    assert main(argv[:-1] + ["--policy", "epikv", "--set", "epikv.page=8"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["evictions"] > 0 and 32 - 8 + 1 <= out["final_cache_tokens"] <= 32
    try:
        code = main(argv[:-2] + ["--policy", "h2o", "--set", "h2o.page=8"])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.strip()]
    assert code == 2 and len(lines) == 1 and "page-granular eviction" in lines[0] and "Traceback" not in err
