"""Issue 58, item 3: every byte counted. `/stats` of both servers (and the engines' JSON figures) give each buffer kept
for a policy, by kind, now and at the most, and their sum. Each test recounts the bytes here on its own, from every
tensor and array reachable from a sequence (its attributes walked, a storage counted once), not from the engine's
own accounting: a buffer the engine leaves out of its sum, or a new one it never learned to count, shows up as a
difference. The only things left out of the walk are what is not the sequence's (the model, the policy object, the
llama.cpp handles) and the policy state's "_" entries, shared by every sequence (the rows contract: a learned
policy's weights)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

# what a sequence refers to but does not own: the model, the policy, llama.cpp's handles and its context's capture
# (LlamaDecoder), its own figures
NOT_THE_SEQUENCES = {"gm", "policy", "_ll", "mem", "cells", "on_evict", "device", "ctx", "batch", "capture",
                     "buffers"}


def _walk(obj, out: dict, private: bool = True, depth: int = 0) -> None:
    """address -> bytes of every tensor / array storage reachable from obj (the test's own count)."""
    if obj is None or depth > 8 or isinstance(obj, (int, float, bool, str, bytes, type)):
        return
    if isinstance(obj, torch.Tensor):
        st = obj.untyped_storage()
        out[st.data_ptr()] = st.nbytes()
        return
    if isinstance(obj, np.ndarray):
        while isinstance(obj.base, np.ndarray):
            obj = obj.base
        out[obj.__array_interface__["data"][0]] = obj.nbytes
        return
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    elif hasattr(obj, "__dict__"):
        items = vars(obj).items()
    else:
        return
    for k, v in items:
        if isinstance(k, str) and (k in NOT_THE_SEQUENCES or (not private and k.startswith("_"))):
            continue
        _walk(v, out, k != "state" and private, depth + 1)  # the policy state's "_" entries are shared


def _bytes(*objs) -> int:
    out: dict = {}
    for o in objs:
        _walk(o, out)
    return sum(out.values())


def _every(seq) -> int:
    """Every byte a sequence (a llama.cpp SequenceCache, a paged server's Track) holds."""
    return _bytes(seq)


def _llama_kinds(seq) -> dict[str, int]:
    """The llama.cpp sequence's buffers by kind, recounted; policy_state is what is left of every byte."""
    kinds = {"mirror": _bytes(seq._kv), "waiting_hidden": _bytes(seq._rows), "waiting_kv": _bytes(seq._arriving),
             "queries": _bytes(seq._queries), "token_data": _bytes(seq.token_data)}
    kinds["policy_state"] = _every(seq) - sum(kinds.values())
    kinds["total"] = _every(seq)
    return kinds


def _sum(dicts: list[dict], keys) -> dict[str, int]:
    return {k: sum(d[k] for d in dicts) for k in keys}


@pytest.fixture(scope="module")
def gm():
    from epikv.llamacpp import available, load_gguf

    assert available(), "llama-cpp-python is missing: run `bash scripts/install.sh --llamacpp`"
    return load_gguf("smollm2")


# policy -> the buffer kinds it must hold at some moment (Seg-Q: a one-layer key mirror, every layer's keys waiting for
# their statistic, a query window; learned-mean: hidden-state rows waiting for one step)
HOLDS = {"epikv-seg-q": ("mirror", "waiting_kv", "queries", "token_data"),
         "epikv-learned-mean": ("waiting_hidden", "token_data")}


@pytest.mark.parametrize("policy", list(HOLDS))
def test_llamacpp_stats_count_every_array_of_every_sequence(gm, request, monkeypatch, policy):
    """`/stats` of the llama.cpp server (LlamaBackend.stats, its "engine" part) on two evicting sequences: after
    every step buffer_bytes, kind by kind and in all, equals every array the running sequences hold, recounted; each
    sequence's own figures equal its arrays at every moment it notes them (after a decode, a flush, an eviction);
    the peak is at least every figure seen and every sequence's own most, at most the sum of those, and
    kv_bytes_with_buffers_peak is the cells' bytes plus it. Mutants: buffer_bytes leaving waiting_kv out (Seg-Q) or
    waiting_hidden out (learned-mean); the arriving rows' running count not raised."""
    from epikv.llamacpp.sequence import SEQUENCE_BUFFERS, SequenceCache
    from epikv.serving.llamacpp import LlamaBackend

    keys = (*SEQUENCE_BUFFERS, "total")
    note = SequenceCache._note_buffers

    def checked(self):  # the running counts against the lists they count
        note(self)
        assert self.buffers.now == _llama_kinds(self)

    monkeypatch.setattr(SequenceCache, "_note_buffers", checked)
    recounts = _recount_at_changes(monkeypatch)
    be = LlamaBackend(gm, policy, 48, 8, sequences=2, max_batch_tokens=64, threads=1, flash_attn=False)
    request.addfinalizer(be.stop)
    seen, errors = [], []

    def on_step(b):  # the engine thread, after a step: what /stats reads against the arrays themselves
        try:
            want = _sum([_llama_kinds(r.seq) for r in b._running], keys)
            got = b.stats()["buffer_bytes"]
            assert got == want, (got, want)
            seen.append(got)
        except AssertionError as e:
            errors.append(e)

    be.on_step = on_step
    rng = np.random.default_rng(0)
    for k in range(3):
        be.submit(str(k), [int(t) for t in rng.integers(100, 40000, 10 + 5 * k)], 60, sampling=None, seed=k,
                  ignore_eos=True)
    done = 0
    while done < 3:
        o = be.next_output(120)
        assert o is not None and o.error is None
        done += o.finished
    assert not errors, errors[0]
    st = be.stats()
    moments: dict[int, list[dict]] = {}
    for m in recounts:
        moments.setdefault(m["seq"], []).append(m)
    assert st["evictions"] > 0 and len(seen) > 50 and len(moments) == 3
    assert st["buffer_bytes"] == dict.fromkeys(keys, 0)  # every sequence ended: nothing held
    peak = st["buffer_peak_bytes"]
    each = [{k: max(m[k] for m in ms) for k in keys} for ms in moments.values()]  # each sequence's most
    for k in keys:
        assert peak[k] >= max(s[k] for s in seen) and peak[k] >= max(e[k] for e in each), k
        assert peak[k] <= sum(e[k] for e in each), k
    assert peak["total"] <= sum(peak[k] for k in SEQUENCE_BUFFERS)
    assert all(peak[k] > 0 for k in HOLDS[policy])
    assert st["kv_bytes_with_buffers_peak"] == st["kv_bytes"] + peak["total"]


def _recount_at_changes(monkeypatch) -> list[dict]:
    """Recount every sequence's buffers, on the test's own, at each point they change: after a decode's rows are
    taken (SequenceCache._note_peak, called there), after a flush, after a removal. Returns the list it fills."""
    from epikv.llamacpp.sequence import SequenceCache

    moments: list[dict] = []
    tags = itertools.count()
    for name in ("_note_peak", "flush", "remove"):
        orig = getattr(SequenceCache, name)

        def wrapped(self, *a, _orig=orig, **kw):
            out = _orig(self, *a, **kw)
            tag = self.__dict__.setdefault("_test_tag", next(tags))  # (an id may be reused once a sequence is gone)
            moments.append({"seq": tag, **_llama_kinds(self)})
            return out

        monkeypatch.setattr(SequenceCache, name, wrapped)
    return moments


def test_llamacpp_generate_reports_every_buffer_at_the_end_and_at_the_most(gm, monkeypatch):
    """`epikv generate --engine llama.cpp --json`'s figures (llamacpp.generate's stats): buffer_peak_bytes is each
    kind's most and the largest sum, recounted here at every point the buffers change (after a decode, a flush, an
    eviction: Seg-Q's scores peak after a flush, before the eviction); buffer_bytes is every array the sequence holds
    at the end, also right after an eviction. Mutants: no note after a flush (the scores' peak is missed), no note
    after an eviction (the figures after it are stale)."""
    from epikv.llamacpp import LlamaDecoder, generate
    from epikv.llamacpp.sequence import SEQUENCE_BUFFERS

    keys = (*SEQUENCE_BUFFERS, "total")
    moments = _recount_at_changes(monkeypatch)
    res = generate(gm, "Count from one to fifty, one number a line.", policy="epikv-seg-q", budget=40, tau=8,
                   max_new_tokens=60, threads=1, flash_attn=False)
    st = res.stats
    assert st["evictions"] > 0
    assert st["buffer_peak_bytes"] == {k: max(m[k] for m in moments) for k in keys}
    assert all(st["buffer_peak_bytes"][k] > 0 for k in HOLDS["epikv-seg-q"])
    # a run whose flush falls on its eviction (prompt 17, K = 64, tau = 16, Seg-Q's recent window 16: scored at 17,
    # 33, 49, 65 and 80 cells, evicted at 80), so its scores peak after the flush, before the eviction (measured:
    # 960 bytes there, 896 at most after a decode); read right after an eviction
    moments.clear()
    dec = LlamaDecoder(gm, "epikv-seg-q", 64, tau=16, max_tokens=200, threads=1, flash_attn=False)
    try:
        assert dec.recent == 16
        logits = dec.prefill([int(t) for t in np.random.default_rng(0).integers(100, 40000, 17)])
        while dec.evictions < 2:
            logits = dec.step(int(np.argmax(logits)))
        rep = dec.peak_report()
        assert rep["buffer_bytes"] == _llama_kinds(dec)
        assert rep["buffer_peak_bytes"] == {k: max(m[k] for m in moments) for k in keys}
    finally:
        dec.close()


@pytest.fixture(scope="module")
def cb_internals():
    from epikv.serving import ServingUnsupported
    from epikv.serving.checks import check_internals

    try:
        check_internals()
    except ServingUnsupported as e:
        pytest.skip(f"transformers lacks {e.missing}")


def test_paged_server_stats_count_every_array_of_every_request(tiny, cb_internals, monkeypatch):
    """The transformers server's `/stats` (serving_stats): at every point it sums the requests' buffers, the sum is
    every array the requests' tracks hold, recounted (Seg-Q: its query window, its scores and positions, its state);
    the peak is the most of those sums, kind by kind and in all. Mutants: Track.buffer_bytes leaving the query window
    out; a track's figures not refreshed after its eviction."""
    from epikv.serving import ServeSpec, run_batch
    from epikv.serving.evictor import TRACK_BUFFERS
    from epikv.serving.scheduler import Runtime

    keys = (*TRACK_BUFFERS, "total")
    sums = []
    note = Runtime.note_buffers

    def checked(self):
        note(self)
        tracks = list(self.tracks.values())
        kinds = [{"queries": _bytes(t.queries), "token_data": _bytes(t.token_data), "total": _every(t)}
                 for t in tracks]
        for d in kinds:
            d["policy_state"] = d["total"] - d["queries"] - d["token_data"]
        want = _sum(kinds, keys)
        assert self.buffers_now == want
        sums.append(want)

    monkeypatch.setattr(Runtime, "note_buffers", checked)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (20, 33, 9, 41)]
    spec = ServeSpec(policy="epikv-seg-q", budget=32, page=4, num_blocks=96, max_batch_tokens=32, recency=4, tau=8)
    _, stats = run_batch(tiny.model, spec, prompts, 60)
    assert stats["evictions"] > 0 and len(sums) > 50
    assert stats["buffer_peak_bytes"] == {k: max(s[k] for s in sums) for k in keys}
    assert all(stats["buffer_peak_bytes"][k] > 0 for k in keys)


def _cache_kinds(cache) -> dict[str, int]:
    """The torch cache's buffers by kind, recounted (its keys and values are the cache itself, not a buffer)."""
    ps = cache.ps
    state: dict = {}
    _walk(ps.state, state, private=False)
    state.update(_arrays(ps.n_pad, ps.n_protect, ps.n_prompt))
    kinds = {"queries": _bytes(cache._queries, cache._query_valid), "token_data": _bytes(ps.token_data),
             "policy_state": sum(state.values()), "slot_map": _bytes(cache._phys, cache._pad_slots, cache.seen)}
    kinds["total"] = sum(kinds.values())
    return kinds


def _arrays(*objs) -> dict:
    out: dict = {}
    for o in objs:
        _walk(o, out)
    return out


@pytest.mark.parametrize("policy", ["epikv-seg-q", "epikv"])
def test_torch_engine_reports_every_buffer_now_and_at_the_most(tiny, monkeypatch, policy):
    """The torch engine's figures (EpiKVCache.stats, in `epikv generate --json`) on a padded batch of two: after every
    step buffer_bytes equals the arrays recounted (Seg-Q: its query window and its mask; epikv: the hidden-state
    delta and rolling windows of its state, and the slot map once eviction refills holes); buffer_peak_bytes is the
    most of those and of the moments before each eviction. Mutants: the query mask left out of the queries, the
    slot map left out of the sum."""
    from epikv.cache import CACHE_BUFFERS, EpiKVCache
    from epikv.engine import Decoder, left_pad

    keys = (*CACHE_BUFFERS, "total")
    moments = []
    evict = EpiKVCache.evict

    def counted(self):  # before the eviction (the scores of the forward in) and after it
        moments.append(_cache_kinds(self))
        out = evict(self)
        moments.append(_cache_kinds(self))
        return out

    monkeypatch.setattr(EpiKVCache, "evict", counted)
    g = torch.Generator().manual_seed(0)
    ids, n_pad = left_pad([torch.randint(3, 1000, (n,), generator=g).tolist() for n in (9, 14)], 0)
    with torch.inference_mode():
        dec = Decoder(tiny.model, policy, 24, tau=4)
        nxt = dec.prefill(ids, n_pad).argmax(-1)
        moments.append(_cache_kinds(dec.cache))
        for _ in range(40):
            nxt = dec.step(nxt[:, None]).argmax(-1)
            now = _cache_kinds(dec.cache)
            moments.append(now)
            assert dec.cache_stats()["buffer_bytes"] == now
    st = dec.cache_stats()
    assert st["evictions"] > 3
    assert st["buffer_peak_bytes"] == {k: max(m[k] for m in moments) for k in keys}
    want = ("queries", "token_data", "policy_state") if policy == "epikv-seg-q" else \
        ("token_data", "policy_state", "slot_map")
    assert all(st["buffer_peak_bytes"][k] > 0 for k in want)


def test_generate_json_carries_the_buffers(capsys):
    """`epikv generate --json` (torch engine) prints buffer_bytes (its total the sum of its kinds) and
    buffer_peak_bytes (its total at most the sum of the kinds' maxima). Mutant: generate's key list without
    buffer_peak_bytes."""
    import json

    from test_cli import run_cli

    code, out, _ = run_cli(capsys, "generate", "--model", "random:tiny", "--prompt", "Hello world", "--raw",
                           "--max-new-tokens", "12", "--budget", "8", "--tau", "2", "--json")
    d = json.loads(out)
    assert code == 0 and d["evictions"] > 0
    now, most = d["buffer_bytes"], d["buffer_peak_bytes"]
    assert now["total"] == sum(v for k, v in now.items() if k != "total") > 0
    assert now["total"] <= most["total"] <= sum(v for k, v in most.items() if k != "total")
