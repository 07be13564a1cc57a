"""Eviction inside transformers' continuous batching (epikv.serving): replay equivalence with the library's own
batch-1 run, pages really returned, forks / cancel / finish, and the refusals."""

import time

import pytest
import torch

from epikv import EpiKVError, generate, load_model
from epikv.policies import get_policy
from epikv.serving import ServeSpec, ServingUnsupported, check_serving, run_batch, serving_stats, start_manager
from epikv.serving.checks import check_internals


@pytest.fixture(scope="module", autouse=True)
def cb_internals():
    """Skip (naming what is missing) only on a transformers without the continuous-batching internals used."""
    try:
        check_internals()
    except ServingUnsupported as e:
        pytest.skip(f"transformers lacks {e.missing}")


@pytest.fixture(scope="module")
def qwen2():
    return load_model("random:tiny-qwen2")


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in lengths]


LENGTHS = (20, 33, 9, 41, 27, 15, 36)  # 7 requests; 33, 36 and 41 exceed max_batch_tokens=32: chunked prefill
NEW = 100


def _replay(lm, policy, lengths=LENGTHS, budget=96, page=8, recency=16, new=NEW, num_blocks=96, tau=None):
    prompts = _prompts(lengths)
    spec = ServeSpec(policy=policy, budget=budget, page=page, num_blocks=num_blocks, max_batch_tokens=32,
                     recency=recency, tau=tau)
    outs, stats = run_batch(lm.model, spec, prompts, new)
    refs = [generate(lm.model, lm.tokenizer, [p], policy=policy, budget=budget, max_new_tokens=new, page=page,
                     recent=recency, tau=tau) for p in prompts]
    return prompts, outs, refs, stats


@pytest.mark.parametrize("policy, tau", [("epikv", None), ("streaming", None), ("kv-key", None), ("lag-kv", None),
                                         ("random", None), ("epikv", 5)])
def test_replay_equivalence(tiny, policy, tau):
    """Every request's tokens under continuous batching with page eviction equal the library's batch-1 run of the
    same policy at page granularity (greedy): same evictions at the same steps (tau), same tokens."""
    prompts, outs, refs, stats = _replay(tiny, policy, tau=tau)
    assert stats["preemptions"] == 0  # the cache holds every request: nothing re-prefilled
    assert stats["max_batch"] >= 6  # >= 6 requests in one forward
    assert stats["chunked_prefills"] >= 3  # prompts over max_batch_tokens=32 prefilled in chunks
    for p, o, r in zip(prompts, outs, refs):
        assert len(o) == len(r.token_ids[0])
        assert o == r.token_ids[0], f"prompt of {len(p)} tokens diverges"
    # every request evicted, the same number of tokens as the engine (whole pages)
    ev = stats["evicted"]
    for i, (p, r) in enumerate(zip(prompts, refs)):
        assert r.stats["evictions"] > 0
        assert ev[f"epikv-{i}"] == len(p) + len(r.token_ids[0]) - 1 - r.stats["final_cache_tokens"]
    assert stats["pages_freed"] * 8 == sum(ev.values())  # every dropped page went back to the pool


def test_replay_equivalence_qwen2(qwen2):
    prompts, outs, refs, stats = _replay(qwen2, "epikv")
    assert [o for o in outs] == [r.token_ids[0] for r in refs]
    assert stats["evictions"] >= len(prompts)


def test_eviction_changes_tokens(tiny):
    """The equivalence is not vacuous: the same requests without eviction, or evicted by another policy, give
    other tokens."""
    prompts = _prompts(LENGTHS)
    full, _ = run_batch(tiny.model, ServeSpec(policy="full", page=8, num_blocks=160, max_batch_tokens=32),
                        prompts, NEW)
    epi, _ = run_batch(tiny.model, ServeSpec(policy="epikv", budget=96, page=8, num_blocks=96, max_batch_tokens=32,
                                             recency=16), prompts, NEW)
    stream, _ = run_batch(tiny.model, ServeSpec(policy="streaming", budget=96, page=8, num_blocks=96,
                                                max_batch_tokens=32, recency=16), prompts, NEW)
    assert sum(a != b for a, b in zip(full, epi)) >= 3
    assert sum(a != b for a, b in zip(stream, epi)) >= 3
    for p, o in zip(prompts, full):  # and full itself is plain continuous batching
        assert o == generate(tiny.model, tiny.tokenizer, [p], policy="full", budget=None,
                             max_new_tokens=NEW).token_ids[0]


def test_pages_really_return(tiny):
    """Evicted pages go back to the pool: under the same num_blocks, epikv keeps more requests in the cache than
    full (which must preempt), one request never holds more than its budget's pages, and every request completes."""
    prompts = _prompts((10, 14, 9, 12, 16, 11, 13, 15))
    common = dict(page=8, num_blocks=72, max_batch_tokens=64)
    full_out, full = run_batch(tiny.model, ServeSpec(policy="full", **common), prompts, 200)
    epi_out, epi = run_batch(tiny.model, ServeSpec(policy="epikv", budget=64, recency=16, **common), prompts, 200)
    assert all(len(o) == 200 for o in full_out + epi_out)
    assert epi["pages_freed"] > 0 and epi["pages_freed"] * 8 == sum(epi["evicted"].values())
    assert epi["preemptions"] == 0 and full["preemptions"] > 0
    assert epi["in_flight_p50"] == len(prompts) and full["in_flight_p50"] <= len(prompts) // 2, (epi, full)
    assert epi["in_flight_mean"] > 1.5 * full["in_flight_mean"]
    assert epi["steps"] < full["steps"]
    assert full["pages_freed"] == 0 and full["evictions"] == 0
    # in flight while the cache was full: full's cache held requests back (preempted, waiting), epikv's never did
    # (its ramp-up forwards were full of prompt tokens, not short of pages)
    assert full["cache_full_steps"] > 0 and full["in_flight_cache_full_mean"] < len(prompts)
    assert epi["cache_full_steps"] == 0 and epi["in_flight_cache_full_mean"] is None
    # a cache too small even for epikv: requests are soft reset (re-prefilled from prompt + tokens so far, their
    # score state started over) and still all complete
    tight_out, tight = run_batch(tiny.model, ServeSpec(policy="epikv", budget=64, recency=16,
                                                       **{**common, "num_blocks": 40}), prompts, 200)
    assert tight["soft_resets"] > 0 and all(len(o) == 200 for o in tight_out)
    assert tight["cache_full_steps"] > 0 and 1 <= tight["in_flight_cache_full_mean"] < len(prompts)
    # one request alone: its pages never exceed budget + the page being written (+ the one tau fills)
    _, one = run_batch(tiny.model, ServeSpec(policy="epikv", budget=64, recency=16, **common), prompts[:1], 120)
    assert one["peak_pages"] <= 64 // 8 + 1
    _, one_full = run_batch(tiny.model, ServeSpec(policy="full", **common), prompts[:1], 120)
    assert one_full["peak_pages"] == -(-(10 + 120 - 1) // 8)


def _collect(manager, n, timeout=120):
    outs, end = {}, time.monotonic() + timeout
    while len(outs) < n and time.monotonic() < end:
        r = manager.get_result(timeout=0.5)
        if r is not None and r.is_finished():
            outs[r.request_id] = r
    return outs


def test_forks_copy_state(tiny):
    """num_return_sequences > 1: transformers forks a request after its prefill; each child continues from a copy
    of the parent's score state (greedy: every child equals the batch-1 run) and is dropped at its end."""
    from transformers import GenerationConfig

    spec = ServeSpec(policy="epikv", budget=64, page=8, num_blocks=96, max_batch_tokens=32, recency=16)
    # top_k=1 sampling is greedy (transformers refuses num_return_sequences > 1 with do_sample=False)
    gc = GenerationConfig(do_sample=True, top_k=1, max_new_tokens=80, eos_token_id=tiny.model.config.eos_token_id,
                          num_return_sequences=3)
    prompt = _prompts((30,))[0]
    manager = start_manager(tiny.model, spec, gc)
    try:
        manager.add_request(prompt, request_id="p", max_new_tokens=80)
        outs = _collect(manager, 3)
        stats = serving_stats(manager)
        rt = manager._epikv_runtime
        assert not rt.tracks  # every state dropped once its request finished
    finally:
        manager.stop(block=True, timeout=60)
    ref = generate(tiny.model, tiny.tokenizer, [prompt], policy="epikv", budget=64, max_new_tokens=80, page=8,
                   recent=16).token_ids[0]
    assert sorted(outs) == ["p", "p__child#0", "p__child#1"]
    assert all(o.generated_tokens == ref for o in outs.values())
    assert stats["forks"] == 2
    assert len({stats["evicted"][k] for k in outs}) == 1 and stats["evicted"]["p"] > 0


def test_cancel_and_finish_drop_state(tiny):
    spec = ServeSpec(policy="epikv", budget=64, page=8, num_blocks=64, max_batch_tokens=32, recency=16)
    from transformers import GenerationConfig

    gc = GenerationConfig(do_sample=False, max_new_tokens=400, eos_token_id=-1)
    manager = start_manager(tiny.model, spec, gc)
    rt = manager._epikv_runtime
    try:
        manager.add_request(_prompts((20,))[0], request_id="long", max_new_tokens=400, streaming=True)
        manager.add_request(_prompts((12,), seed=1)[0], request_id="short", max_new_tokens=10)
        end = time.monotonic() + 60
        while "long" not in rt.tracks and time.monotonic() < end:
            time.sleep(0.01)
        assert "long" in rt.tracks
        manager.cancel_request("long")
        while ("long" in rt.tracks or "short" in rt.tracks) and time.monotonic() < end:
            time.sleep(0.01)
        assert not rt.tracks
        assert rt.pages_in_use() == 0  # cancelled and finished requests hold no page
    finally:
        manager.stop(block=True, timeout=60)
    assert getattr(tiny.model, "_epikv_serving", None) is None  # hooks removed at stop


def test_stats_live_pages_and_bounded_history(tiny, monkeypatch):
    """/stats' pages_in_use is read live (pages return after the last scheduled step, when nothing else runs), and
    finished requests are kept in counters and a ring of the newest, never one entry per request ever served."""
    from transformers import GenerationConfig

    from epikv.serving import scheduler as sched

    monkeypatch.setattr(sched, "RECENT_FINISHED", 3)
    spec = ServeSpec(policy="epikv", budget=64, page=8, num_blocks=64, max_batch_tokens=32, recency=16)
    manager = start_manager(tiny.model, spec, GenerationConfig(do_sample=False, max_new_tokens=80, eos_token_id=-1))
    try:
        prompts = _prompts((12, 20, 9, 15, 11))
        for i, p in enumerate(prompts):
            manager.add_request(p, request_id=f"r{i}", max_new_tokens=80)
        _collect(manager, len(prompts))
        end = time.monotonic() + 10
        st = serving_stats(manager)
        while st["pages_in_use"] and time.monotonic() < end:  # the last request's pages return after its output
            time.sleep(0.05)
            st = serving_stats(manager)
        assert st["peak_pages"] > 0 and st["pages_in_use"] == 0 and st["pages_free"] == st["num_blocks"]
        assert st["finished"] == 5 and st["evicted_tokens"] > 0
        assert len(st["evicted"]) == 3  # the ring: the newest three finished requests
        assert st["evicted_tokens"] >= sum(st["evicted"].values())
    finally:
        manager.stop(block=True, timeout=60)


def test_manager_reset_drops_state(tiny):
    """A reset of the scheduler (transformers resets the batch processor when a kept manager restarts) drops every
    per-request state."""
    from transformers import GenerationConfig

    from epikv.serving.evictor import Track

    spec = ServeSpec(policy="epikv", budget=64, page=8, num_blocks=64, max_batch_tokens=32, recency=16)
    manager = start_manager(tiny.model, spec, GenerationConfig(do_sample=False, max_new_tokens=5, eos_token_id=-1))
    rt = manager._epikv_runtime
    manager.stop(block=True, timeout=60)
    rt.tracks["stale"] = Track(rt.policy, rt.depth, rt.device, 10, 64, 16)
    rt.scheduler.reset()
    assert not rt.tracks and rt.batch is None


def test_prompt_over_budget_is_evicted_inside_as_no_protect_prompt(tiny):
    """Prompts whose protection does not fit K (60 + 16 recent > 64; 150; 300) are served, evicted inside as
    `--no-protect-prompt` does: each request's tokens equal the library's batch-1 run with protect_prompt=False,
    while a prompt that fits (30) keeps its protection. Mutant: Policy.for_prompt returning self (the old refusal)
    fails the long ones; returning the unprotected policy always fails the short one."""
    prompts = _prompts((30, 60, 150, 300), seed=3)
    # every prompt whole in one forward (max_batch_tokens over their sum), as generate without prefill_chunk
    spec = ServeSpec(policy="epikv", budget=64, page=8, num_blocks=160, max_batch_tokens=600, recency=16)
    outs, stats = run_batch(tiny.model, spec, prompts, 40)
    assert stats["prompts_evicted"] == 3 and stats["refused"] == 0 and stats["preemptions"] == 0
    for p, o in zip(prompts, outs):
        ref = generate(tiny.model, tiny.tokenizer, [p], policy="epikv", budget=64, max_new_tokens=40, page=8,
                       recent=16, protect_prompt=len(p) + 16 <= 64)
        assert o == ref.token_ids[0], f"prompt of {len(p)} tokens"


def test_prompt_longer_than_the_cache_is_evicted_between_its_chunks(tiny):
    """300 prompt tokens in a cache of 16 pages of 8 (128 slots): prefilled in chunks of max_batch_tokens = 32 and
    evicted between them, the request never holds more than K + 32 slots, and its tokens equal the library's run
    with protect_prompt=False and the same prefill chunks (mutant: the old refusal fails the request)."""
    p = _prompts((300,), seed=3)
    spec = ServeSpec(policy="epikv", budget=64, page=8, num_blocks=16, max_batch_tokens=32, recency=16)
    (out,), stats = run_batch(tiny.model, spec, p, 40)
    ref = generate(tiny.model, tiny.tokenizer, p, policy="epikv", budget=64, max_new_tokens=40, page=8, recent=16,
                   protect_prompt=False, prefill_chunk=32)
    assert out == ref.token_ids[0] and stats["prompts_evicted"] == 1
    from epikv.serving.layout import layout_kind

    ahead = layout_kind().page_field == "block_size"  # 5.17 allocates the next chunk's first page before evicting
    assert stats["peak_pages"] <= (64 + 32) // 8 + ahead and stats["evictions"] >= 7


def test_prompt_refused_only_where_nothing_fits(tiny):
    """The up-front refusal (the server's 400) stays where even the prompt evicted inside cannot fit, naming the
    way out: sinks + recency over K, or a request's peak (K + tau - 1 + one prefill chunk) over the whole cache.
    Mutant: prompt_refusal without the capacity check answers None for the 200-token prompt."""
    from epikv.serving.scheduler import prompt_refusal

    spec = ServeSpec(policy="epikv", budget=32, page=8, num_blocks=8, max_batch_tokens=64, recency=8)
    manager = start_manager(tiny.model, spec)
    try:
        assert prompt_refusal(manager, 20) is None  # protected: 20 + 8 fit K = 32
        assert prompt_refusal(manager, 60) is None  # evicted inside; holds at most its 60 tokens, in 64 slots
        why = prompt_refusal(manager, 200)  # 32 + 64 > 64 slots of the cache
        assert "holds up to 96 tokens" in why and "raise --num-blocks or lower --max-batch-tokens" in why
        assert "\n" not in why
    finally:
        manager.stop(block=True, timeout=60)
    pol = get_policy("epikv", recent=30, page=8)
    assert pol.for_prompt(32, 30, 200).protected_overflow(32, 30, 200).endswith(
        "raise the budget or lower the recency window or n_sink")


def _one_line(fn):
    try:
        out = fn()
    except EpiKVError as e:
        msg = str(e)
        assert msg and "\n" not in msg
        return msg
    if hasattr(out, "stop"):  # a manager that should not have started: stop it, or its thread outlives the test
        out.stop(block=True, timeout=60)
    pytest.fail("no EpiKVError raised")


BASE = dict(policy="epikv", budget=64, page=8, num_blocks=32, max_batch_tokens=32)


@pytest.mark.parametrize("change, words", [
    (dict(cb={"allow_block_sharing": True}), "block sharing"),
    (dict(cb={"use_async_batching": True}), "async batching"),
    (dict(cb={"use_cuda_graph": True}), "CUDA graphs"),
    (dict(cb={"use_cuda_graph": (False, True)}), "CUDA graphs"),
    (dict(cb={"scheduler_type": "fifo"}), "scheduler_type"),
    (dict(cb={"default_compile_level": 2}), "compiled"),
    (dict(num_blocks=None), "num_blocks is required"),
    (dict(budget=24), "under 4 pages"),
    (dict(page=2), "at least 4"),
    (dict(settings={"page": 16}), "page size 8"),
    (dict(policy="h2o"), "h2o cannot serve"),
    (dict(policy="tova"), "tova cannot serve"),
    (dict(policy="snapkv"), "snapkv cannot serve"),
    (dict(policy="rkv"), "rkv cannot serve"),
    (dict(policy="raas"), "raas cannot serve"),
    (dict(policy="thinkv"), "thinkv cannot serve"),
    (dict(policy="knorm"), "knorm cannot serve"),
    (dict(policy="epikv-seg", settings={"segment": 12}), "segment 12 must be a multiple of the page size 8"),
    (dict(policy="nope"), "unknown policy"),
    (dict(settings={"recent": 8}, recency=16), "given twice"),
    (dict(cb={"no_such_setting": 1}), "no setting 'no_such_setting'"),
])
def test_refusals_one_line(tiny, change, words):
    spec = ServeSpec(**{**BASE, **change})
    msg = _one_line(lambda: check_serving(tiny.model, spec))
    assert words in msg, msg
    # start_manager refuses the same way, before anything starts
    assert _one_line(lambda: start_manager(tiny.model, spec)) == msg
    assert getattr(tiny.model, "_epikv_serving", None) is None


def test_refuses_sliding_window_model():
    lm = load_model("random:tiny-gemma3")
    assert "sliding-window" in _one_line(lambda: check_serving(lm.model, ServeSpec(**BASE)))


def test_served_policies_accepted(tiny):
    for name in ("epikv", "epikv-raw", "streaming", "random", "kv-key", "lag-kv", "epikv-seg", "epikv-seg-q", "full"):
        assert check_serving(tiny.model, ServeSpec(**{**BASE, "policy": name})).name == name


def test_internals_self_check(tiny, monkeypatch):
    """The start-up check looks at signatures and behaviour, not a version string (on either paged layout); a
    refused start leaves the model as it was (5.17 switches it to paged attention when the manager is made)."""
    attn = tiny.model.config._attn_implementation
    from epikv.serving.layout import LedgerLayout, layout_kind

    if layout_kind() is LedgerLayout:  # 5.18+
        from transformers.generation.continuous_batching.cache_allocators import cache_allocator, full_attention

        release, label = (cache_allocator.BlockLedger, "release"), "BlockLedger.release(no_cache=...)"
        fake = lambda self, block_id: True  # noqa: E731
    else:  # 5.17
        from transformers.generation.continuous_batching import cache_manager as full_attention

        release, label = (full_attention.BlockManager, "free_blocks"), "BlockManager.free_blocks(shareable=...)"
        fake = lambda self, blocks: None  # noqa: E731
    with monkeypatch.context() as mp:
        mp.setattr(*release, fake)
        msg = _one_line(lambda: start_manager(tiny.model, ServeSpec(**BASE)))
        assert label in msg, msg
    orig = full_attention.FullAttentionCacheAllocator.get_write_indices
    with monkeypatch.context() as mp:  # same signature, other behaviour: caught by the probe on the real cache
        mp.setattr(full_attention.FullAttentionCacheAllocator, "get_write_indices",
                   lambda self, request_id, past_length, query_length: [
                       i + 1 for i in orig(self, request_id, past_length, query_length)])
        msg = _one_line(lambda: start_manager(tiny.model, ServeSpec(**BASE)))
        assert "get_write_indices" in msg
    assert getattr(tiny.model, "_epikv_serving", None) is None
    assert tiny.model.config._attn_implementation == attn


def test_smollm2_equivalence(smollm2):
    """The embedded SmolLM2: three requests, 40 new tokens, a small budget; each equals the library's own run."""
    tok = smollm2.tokenizer
    texts = ["Solve step by step: 12 * 7 + 5 =", "The capital of France is", "List three prime numbers:"]
    prompts = [tok(t)["input_ids"] for t in texts]
    spec = ServeSpec(policy="epikv", budget=32, page=8, num_blocks=64, max_batch_tokens=16, recency=8)
    from transformers import GenerationConfig

    gc = GenerationConfig(do_sample=False, max_new_tokens=40, eos_token_id=-1)  # 40 tokens each, EOS or not
    outs, stats = run_batch(smollm2.model, spec, prompts, 40, generation_config=gc)
    assert stats["evictions"] >= 3 and all(len(o) == 40 for o in outs)
    for p, o in zip(prompts, outs):
        ref = generate(smollm2.model, tok, [p], policy="epikv", budget=32, max_new_tokens=40, page=8, recent=8,
                       eos_token_ids=[])
        assert o == ref.token_ids[0]


def test_cache_bound_forwards_and_their_histogram():
    """A forward counts as cache-bound only when it had room for more tokens and more requests (so a waiting request
    was held back by pages); the histogram's mean and median are the plain ones."""
    from types import SimpleNamespace as NS

    from epikv.serving.metrics import mean_p50 as _mean_p50
    from epikv.serving.scheduler import cache_bound

    fwd = [NS(query_length=1)] * 5 + [NS(query_length=40)]  # 5 decoding requests and one prefill chunk: 45 tokens
    assert cache_bound(fwd, 46, None) and cache_bound(fwd, 46, 7)
    assert not cache_bound(fwd, 45, None)  # the token budget was spent: a waiting prompt waits for tokens
    assert not cache_bound(fwd, 64, 6)  # as many requests as a batch may hold
    assert _mean_p50({}) == (None, None, 0)
    assert _mean_p50({3: 1, 5: 2, 9: 1}) == (5.5, 5, 4)
    assert _mean_p50({2: 3, 10: 1}) == (4.0, 2, 4)
    assert _mean_p50({2: 2, 10: 2}) == (6.0, 2, 4)  # the lower median, as the in-flight median always was
