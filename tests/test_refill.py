"""Eviction by refilling holes: the kept slots beyond K move into the evicted slots below K, so slot order is no
longer true-position order (the cache keeps the map). Attention must not notice: every step's logits equal the full
model's under a 4D mask of the tokens the cache held, for single tokens and multi-token chunks."""

import pytest
import torch

from epikv.cache import hole_fill
from epikv.engine import Decoder


def test_hole_fill_moves_only_the_tail_into_the_holes():
    k = 6
    kept = torch.tensor([[0, 2, 3, 5, 7, 8],  # holes 1, 4 <- 7, 8
                         [0, 1, 2, 3, 4, 9],  # hole 5 <- 9
                         [0, 1, 2, 3, 4, 5]])  # nothing moves
    buf = torch.arange(10).repeat(3, 1)  # slot s holds token s
    src, dst, new = hole_fill(kept, m=4)
    assert src.shape == dst.shape == (3, 4)
    buf.scatter_(1, dst, buf.gather(1, src))
    assert bool((new < k).all())
    assert torch.equal(buf.gather(1, new), kept)  # each kept token is where the map says
    assert new.tolist() == [[0, 2, 3, 5, 1, 4], [0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]]
    moved = (src != dst).sum(1).tolist()
    assert moved == [2, 1, 0]  # one move per evicted slot below K, not a compaction


def test_hole_fill_non_movers_stay_put_in_scrambled_rows():
    """After a refill the kept slots are in true order, not slot order: rows of scrambled physical slots with
    different move counts. Only slots at K or beyond move; every other kept slot keeps its place."""
    k = 6
    kept = torch.tensor([[4, 8, 0, 2, 9, 5],  # holes 1, 3 <- 8, 9
                         [5, 3, 1, 7, 0, 2],  # hole 4 <- 7
                         [3, 0, 5, 1, 4, 2],  # nothing moves
                         [9, 8, 7, 0, 1, 2]])  # holes 3, 4, 5 <- 9, 8, 7
    buf = torch.arange(10).repeat(4, 1)
    src, dst, new = hole_fill(kept, m=4)
    buf.scatter_(1, dst, buf.gather(1, src))
    assert torch.equal(buf.gather(1, new), kept) and bool((new < k).all())
    assert new.tolist() == [[4, 1, 0, 2, 3, 5], [5, 3, 1, 4, 0, 2], [3, 0, 5, 1, 4, 2], [3, 4, 5, 0, 1, 2]]
    assert (src != dst).sum(1).tolist() == [2, 1, 0, 3]
    stay = kept < k
    assert torch.equal(new[stay], kept[stay])  # a non-mover is where it was


def _oracle_logits(model, ids, allowed):
    """Logits of every fed position under a 4D mask: row t sees the positions in allowed[t]."""
    n = ids.shape[1]
    mask = torch.zeros(n, n, dtype=torch.bool)
    for t, ps in allowed.items():
        mask[t, list(ps)] = True
    rows = sorted(allowed)
    for t in range(n):  # rows we do not check: plain causal (they must not be all-masked)
        if t not in allowed:
            mask[t, : t + 1] = True
    return model(ids, attention_mask=mask[None, None]).logits[0, rows], rows


@pytest.mark.parametrize("policy", ["epikv", "streaming", "random", "kv-key", "kv-val"])
@pytest.mark.parametrize("tau,chunk", [(1, 1), (3, 1), (4, 4)])
def test_refilled_cache_equals_the_masked_full_model(tiny, policy, tau, chunk):
    m = tiny.model
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(10, 2000, (1, 90), generator=g)
    p, budget = 6, 20
    allowed, got = {}, {}
    reordered = False
    with torch.inference_mode():
        dec = Decoder(m, policy, budget=budget, tau=tau, recent=4)
        dec.prefill(ids[:, :p], [0])
        for s in range(p, ids.shape[1], chunk):
            before = dec.cache.token_data["pos"][0].tolist()
            logits = dec.step(ids[:, s : s + chunk], all_logits=True)[0]  # [chunk, vocab]
            for j in range(chunk):
                allowed[s + j] = set(before) | set(range(s, s + j + 1))
                got[s + j] = logits[j]
            phys = dec.cache._phys
            if phys is not None and not torch.equal(phys[0], phys[0].sort().values):
                reordered = True
        assert dec.cache.evictions > 10
        ref, rows = _oracle_logits(m, ids, allowed)
    assert reordered, "the refill path was never taken: slots stayed in true order"
    got = torch.stack([got[t] for t in rows])
    assert torch.allclose(got, ref, atol=1e-4), (got - ref).abs().max()


@pytest.mark.parametrize("policy", ["h2o", "keydiff", "lag-kv"])
def test_policies_reading_the_cache_keep_true_order(tiny, policy):
    """Attention weights and keys are read in slot order: those policies keep the compacted, true-order layout."""
    m = tiny.model
    ids = torch.randint(10, 2000, (1, 60), generator=torch.Generator().manual_seed(2))
    from epikv.engine import attention_for
    from epikv.policies import get_policy

    pol = get_policy(policy, tau=1, recent=4)
    with torch.inference_mode(), attention_for(m, pol):
        dec = Decoder(m, pol, budget=20)
        dec.prefill(ids[:, :6], [0])
        for s in range(6, 60):
            dec.step(ids[:, s : s + 1])
        assert dec.cache.evictions > 10 and dec.cache._phys is None




def test_padded_batch_refills_and_masks_its_scattered_padding(tiny):
    """A left-padded batch refills too: evicted padding slots take real tokens, so the kept padding is no longer a
    prefix and the mask follows each slot. Every row's logits equal the row decoded alone."""
    tok = tiny.tokenizer
    rows = [tok("one two three four five six seven eight nine ten eleven twelve")["input_ids"],
            tok("hi")["input_ids"]]
    cont = torch.randint(10, 2000, (1, 40), generator=torch.Generator().manual_seed(4))
    kw = dict(budget=24, tau=1, recent=4)
    with torch.inference_mode():
        singles = []
        for r in rows:
            d = Decoder(tiny.model, "epikv", **kw)
            d.prefill(torch.tensor([r]), [0])
            singles.append(torch.stack([d.step(cont[:, t : t + 1])[0] for t in range(40)]))
        w = max(map(len, rows))
        pad = [w - len(r) for r in rows]
        ids = torch.tensor([[0] * p + r for p, r in zip(pad, rows)])
        d = Decoder(tiny.model, "epikv", **kw)
        d.prefill(ids, pad)
        both, scattered = [], False
        for t in range(40):
            both.append(d.step(cont.expand(2, -1)[:, t : t + 1]))
            ps = d.cache._pad_slots
            if ps is not None and bool(ps[1].any()):
                first_pad = int(ps[1].int().argmax())
                scattered |= bool((~ps[1][:first_pad]).any())  # a real token stored before kept padding
        both = torch.stack(both, dim=1)
    assert pad[1] > 0 and scattered, "the padded row never held padding behind a refilled slot"
    for i in range(2):
        assert torch.allclose(both[i], singles[i], atol=1e-4), (both[i] - singles[i]).abs().max()


def test_refill_after_a_prefill_that_outgrew_the_buffers(tiny):
    """A prompt longer than the buffers: the first eviction compacts (and frees the memory), later ones refill;
    logits stay those of the masked full model."""
    m = tiny.model
    ids = torch.randint(10, 2000, (1, 120), generator=torch.Generator().manual_seed(5))
    p = 80  # > 2 (budget + tau + 16) slots: the buffers grew at prefill, the first eviction frees them
    allowed, got = {}, {}
    with torch.inference_mode():
        dec = Decoder(m, "epikv", budget=20, tau=1, recent=4, protect_prompt=False, n_sink=2)
        dec.prefill(ids[:, :p], [0])
        # the prefill wrote p slots, then its eviction compacted into smaller buffers (true order, no map)
        assert dec.cache.evictions == 1 and dec.cache.layers[0].capacity < p and dec.cache._phys is None
        refilled = False
        for s in range(p, ids.shape[1]):
            before = dec.cache.token_data["pos"][0].tolist()
            got[s] = dec.step(ids[:, s : s + 1])[0]
            allowed[s] = set(before) | {s}
            refilled |= dec.cache._phys is not None
        assert refilled
        ref, rows = _oracle_logits(m, ids, allowed)
    got = torch.stack([got[t] for t in rows])
    assert torch.allclose(got, ref, atol=1e-4), (got - ref).abs().max()


def test_compaction_after_a_refill_resets_the_physical_map(tiny):
    """Refills scramble the slots (a map of physical places); a long later turn outgrows the buffers, so its
    eviction compacts into true order and the map must go. Logits stay those of the masked full model after it."""
    m = tiny.model
    ids = torch.randint(10, 2000, (1, 130), generator=torch.Generator().manual_seed(6))
    p, turn = 6, 60  # the turn: 20 + 60 slots > 2 (20 + 1 + 16) -> the buffers grow, the eviction compacts
    allowed, got = {}, {}
    with torch.inference_mode():
        dec = Decoder(m, "epikv", budget=20, tau=1, recent=4)
        dec.prefill(ids[:, :p], [0])
        feeds = [(s, 1) for s in range(p, 40)] + [(40, turn)] + [(s, 1) for s in range(40 + turn, ids.shape[1])]
        seen_map = compacted = False
        for s, t in feeds:
            before = dec.cache.token_data["pos"][0].tolist()
            logits = dec.step(ids[:, s : s + t], all_logits=True)[0]
            for j in range(t):
                allowed[s + j] = set(before) | set(range(s, s + j + 1))
                got[s + j] = logits[j]
            phys = dec.cache._phys
            if s < 40:
                seen_map |= phys is not None and not torch.equal(phys[0], phys[0].sort().values)
            elif t == turn:
                compacted = phys is None
        assert seen_map and compacted and dec.cache._phys is not None  # refilled, compacted, refilled again
        ref, rows = _oracle_logits(m, ids, allowed)
    got = torch.stack([got[t] for t in rows])
    assert torch.allclose(got, ref, atol=1e-4), (got - ref).abs().max()


def test_compaction_after_a_refill_resets_the_padding_map(tiny):
    """The same on a left-padded batch: the map of scattered padding slots goes with the compaction; every row's
    logits, through the long turn and after it, equal the row decoded alone."""
    tok = tiny.tokenizer
    rows = [tok("one two three four five six seven eight nine ten eleven twelve")["input_ids"],
            tok("hi")["input_ids"]]
    cont = torch.randint(10, 2000, (1, 100), generator=torch.Generator().manual_seed(7))
    feeds = [(s, 1) for s in range(20)] + [(20, 60)] + [(s, 1) for s in range(80, 100)]
    kw = dict(budget=24, tau=1, recent=4)

    def run(dec, ids, pad, batch):
        dec.prefill(ids, pad)
        out, maps = [], []
        for s, t in feeds:
            out.append(dec.step(cont.expand(batch, -1)[:, s : s + t], all_logits=True))
            maps.append(dec.cache._pad_slots is not None)
        return torch.cat(out, dim=1), maps

    with torch.inference_mode():
        singles = [run(Decoder(tiny.model, "epikv", **kw), torch.tensor([r]), [0], 1)[0][0] for r in rows]
        w = max(map(len, rows))
        pad = [w - len(r) for r in rows]
        ids = torch.tensor([[0] * p + r for p, r in zip(pad, rows)])
        both, maps = run(Decoder(tiny.model, "epikv", **kw), ids, pad, 2)
    assert any(maps[:20]) and not maps[20]  # refilled with padding mapped, then compacted
    for i in range(2):
        assert torch.allclose(both[i], singles[i], atol=1e-4), (both[i] - singles[i]).abs().max()
