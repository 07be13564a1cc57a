"""The evicting cache's storage: preallocated per-layer key/value buffers that grow, compact and take moved slots
in place (`BufferLayer`, and `SlidingBufferLayer` for a hybrid model's sliding-window layers), the hole-filling
move plan, and the row selection of per-row policy state (beam search). Model-free tensor code."""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from .errors import EpiKVError



class BufferLayer(DynamicLayer):
    """One layer's keys and values in [batch, kv_heads, capacity, head_dim] buffers, `length` slots in use.

    `update` writes the new tokens in place and returns views of the used slots, so a decode step copies only the
    new token (DynamicLayer concatenates, copying the whole cache every step). Capacity grows geometrically when
    needed and shrinks back after an eviction that leaves it mostly empty, so evicted memory is really freed.
    """

    def __init__(self, capacity: int = 256) -> None:
        super().__init__()
        self.capacity_hint = max(1, capacity)
        self.length = 0  # stored slots (what attention reads)
        self.cumulative = 0  # tokens written since the start, evicted ones included (what generate() counts)
        self.off = 0  # first used slot: eviction may shift the kept run right instead of moving the tail left
        self._kbuf: torch.Tensor | None = None
        self._vbuf: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True
        self._allocate(max(self.capacity_hint, key_states.shape[-2]), key_states, value_states)

    def _allocate(self, capacity: int, k_like: torch.Tensor, v_like: torch.Tensor) -> None:
        """New buffers of `capacity` slots holding the used slots at offset 0."""
        b, h, _, dk = k_like.shape
        kbuf = k_like.new_empty(b, h, capacity, dk)
        vbuf = v_like.new_empty(b, h, capacity, v_like.shape[-1])
        if self.length:
            kbuf[:, :, : self.length].copy_(self.keys)
            vbuf[:, :, : self.length].copy_(self.values)
        self._kbuf, self._vbuf, self.off = kbuf, vbuf, 0
        self._refresh_views()

    def _refresh_views(self) -> None:
        end = self.off + self.length
        self.keys = self._kbuf[:, :, self.off : end]  # [batch, kv_heads, length, head_dim]
        self.values = self._vbuf[:, :, self.off : end]

    @property
    def capacity(self) -> int:
        return 0 if self._kbuf is None else self._kbuf.shape[2]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        t = key_states.shape[-2]
        need = self.length + t
        if self.off + need > self.capacity:
            # no room after the used run: back to offset 0 (amortised: the slack is a quarter of the budget), or grow
            self._allocate(self.capacity if need <= self.capacity else max(need, 2 * self.capacity),
                           key_states, value_states)
        end = self.off + self.length
        self._kbuf[:, :, end : end + t].copy_(key_states)
        self._vbuf[:, :, end : end + t].copy_(value_states)
        self.length = need
        self.cumulative += t
        self._refresh_views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        """Tokens seen, as in transformers' sliding-window layers: generate() slices the input ids by it, so a
        second turn feeds only the unseen suffix. The stored length is `length`."""
        return self.cumulative

    def get_mask_sizes(self, query_length, *args) -> tuple[int, int]:
        """(kv_length, kv_offset): attention reads the stored slots plus the new tokens; the offset puts them right
        before the queries (at tokens seen), so the causal mask holds. query_length is an int (transformers >= 5.?)
        or the cache_position tensor (older versions)."""
        q = query_length.shape[0] if isinstance(query_length, torch.Tensor) else int(query_length)
        return self.length + q, self.cumulative - self.length

    def select_rows(self, idx: torch.Tensor) -> None:
        """Keep / reorder / repeat batch rows: idx [new_batch] row indices."""
        if self._kbuf is not None:
            idx = idx.to(self._kbuf.device)
            self._kbuf, self._vbuf = self._kbuf.index_select(0, idx), self._vbuf.index_select(0, idx)
            self._refresh_views()

    def compact(self, keep: torch.Tensor, target_capacity: int, start: int = 0, still: int = 0) -> None:
        """Keep the slots `keep` ([batch, K] for every head, or [batch, kv_heads, K]) in this order.

        Either side of the evicted slots may stay in place: `start` kept slots at the front (keep[..., :start] is
        the identity) or `still` at the back (keep[..., K - still:] are the last slots). Only the shorter rest moves:
        the tail left, or the head right with the offset advancing (about a quarter of the cache on average at
        tau = 1, instead of a half)."""
        if keep.dim() == 2:
            keep = keep.unsqueeze(1)  # [batch, 1, K]
        b, h, n_old, dk = self.keys.shape
        k_new = keep.shape[-1]
        if self.capacity > 2 * target_capacity:  # release memory the budget no longer needs: move everything
            kept_k, kept_v = _take(self.keys, keep), _take(self.values, keep)
            self._kbuf = kept_k.new_empty(b, h, target_capacity, dk)
            self._vbuf = kept_v.new_empty(b, h, target_capacity, self._vbuf.shape[-1])
            self.off = 0
            self._kbuf[:, :, :k_new].copy_(kept_k)
            self._vbuf[:, :, :k_new].copy_(kept_v)
        elif still > start:  # the back stays: shift the head right, the run now starts later
            head = keep[..., : k_new - still]
            kept_k, kept_v = _take(self.keys, head), _take(self.values, head)
            self.off += n_old - k_new
            self._kbuf[:, :, self.off : self.off + head.shape[-1]].copy_(kept_k)
            self._vbuf[:, :, self.off : self.off + head.shape[-1]].copy_(kept_v)
        else:  # the front stays: move the tail left
            tail = keep[..., start:]
            kept_k, kept_v = _take(self.keys, tail), _take(self.values, tail)
            a = self.off + start
            self._kbuf[:, :, a : self.off + k_new].copy_(kept_k)
            self._vbuf[:, :, a : self.off + k_new].copy_(kept_v)
        self.length = k_new
        self._refresh_views()

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor, new_length: int) -> None:
        """Copy slot src[b, i] to dst[b, i] (both [batch, m], relative to the used run) for every head, then keep
        the first `new_length` slots: an eviction that refills its holes below new_length with the kept slots above
        it moves m slots instead of a quarter of the cache. Sources and destinations must be disjoint except for
        slots copied onto themselves."""
        b, h, _, _ = self.keys.shape
        m = src.shape[-1]
        for x in (self.keys, self.values):  # views of the buffers: written in place
            if b == 1:  # one row: plain index copies (fewer, cheaper ops at tau = 1)
                x.index_copy_(2, dst[0], x.index_select(2, src[0]))
                continue
            d = x.shape[-1]
            moved = x.gather(2, src[:, None, :, None].expand(b, h, m, d))  # read every source before any write
            x.scatter_(2, dst[:, None, :, None].expand(b, h, m, d), moved)
        self.length = new_length
        self._refresh_views()

    def reset(self) -> None:
        self.length = self.off = self.cumulative = 0
        self._kbuf = self._vbuf = None
        self.keys = self.values = None
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        raise EpiKVError("an evicting cache cannot be cropped (assisted or speculative decoding is not supported)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise EpiKVError("reorder rows through the EpiKVCache (reorder_cache, batch_select_indices, "
                         "batch_repeat_interleave), which keeps the per-row policy data aligned with the layers")

    batch_select_indices = reorder_cache = batch_repeat_interleave


class SlidingBufferLayer(BufferLayer):
    """A sliding-window attention layer (Gemma-3, GPT-OSS, Ministral): never evicted by the policy, it keeps the last
    `window - 1` tokens seen, as transformers' DynamicSlidingWindowLayer does (the sliding mask lets a query see
    itself and the window - 1 tokens before it). `update` returns the kept tokens plus the new ones (the new tokens
    see their own window) and then drops what falls out of it; get_mask_sizes (inherited) puts the stored slots at
    their true columns, seen - stored ... seen - 1, so the model's sliding mask stays exact whatever the full-attention
    layers evicted."""

    is_sliding = True

    def __init__(self, window: int) -> None:
        self.window = window
        self.keep_slots = max(1, window - 1)
        super().__init__(self.keep_slots + max(16, self.keep_slots // 4))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = super().update(key_states, value_states)  # views of every used slot, the new ones last
        drop = self.length - self.keep_slots
        if drop > 0:  # the returned views stay valid: nothing is written over them before the next update
            self.off += drop
            self.length = self.keep_slots
            self._refresh_views()
            if self.capacity > 2 * self.capacity_hint:  # after a long prompt: release the memory
                self._allocate(self.capacity_hint, key_states, value_states)
        return keys, values

    def get_max_length(self) -> int:
        return self.window


def hole_fill(kept: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Refill an eviction's holes in place: kept [batch, K] are the physical slots kept, in the policy's (true
    position) order. The kept slots at K or beyond move into the free slots below K, the i-th of them (in kept order)
    into the i-th free slot (ascending). m >= the number that move (the slots evicted, at most K).

    Returns (src, dst, new_kept): [batch, m] physical moves (padded with slots copied onto themselves, so every row
    has m entries without a host sync) and [batch, K] the kept slots' physical places after the moves."""
    b, k = kept.shape
    dev = kept.device
    stays = kept < k  # [batch, K]
    taken = torch.zeros(b, k + 1, dtype=torch.bool, device=dev)
    taken.scatter_(1, kept.clamp(max=k), True)  # column k collects every slot at or beyond K
    m = min(m, k)
    free = (taken[:, :k]).to(torch.int8).argsort(dim=1, stable=True)[:, :m]  # free slots first, ascending
    movers = stays.to(torch.int8).argsort(dim=1, stable=True)[:, :m]  # kept entries beyond K first, in order
    src = kept.gather(1, movers)
    dst = torch.where(stays.gather(1, movers), src, free)  # a non-mover (a row with fewer moves) stays put
    return src, dst, kept.scatter(1, movers, dst)


def _take(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [batch, heads, n, dim], idx [batch, 1 or heads, m] -> x's slots idx [batch, heads, m, dim].

    Row copies (index_select / advanced indexing) instead of an element-wise gather: about 3x faster on the CPU."""
    b, h = x.shape[:2]
    if idx.shape[1] == 1:
        if b == 1:
            return x.index_select(2, idx[0, 0])
        return x[torch.arange(b, device=x.device)[:, None], :, idx[:, 0]].transpose(1, 2)  # [b, m, h, d] -> [b, h, m, d]
    return x[torch.arange(b, device=x.device)[:, None, None], torch.arange(h, device=x.device)[None, :, None], idx]


def select_state_rows(obj: Any, idx: torch.Tensor, batch: int, _seen: set | None = None) -> Any:
    """A policy state with its rows selected by idx, as Policy.init_state's contract says: every tensor whose dim 0
    is the batch, reached through dicts, lists, tuples, dataclasses and plain objects, except under keys or
    attributes starting with an underscore. Containers are updated in place."""
    if isinstance(obj, torch.Tensor):
        return obj.index_select(0, idx.to(obj.device)) if obj.dim() and obj.shape[0] == batch else obj
    if obj is None or isinstance(obj, (str, bytes, int, float, bool, type, torch.nn.Module, torch.Generator)):
        return obj
    _seen = set() if _seen is None else _seen
    if id(obj) in _seen:
        return obj
    _seen.add(id(obj))
    sub = lambda v: select_state_rows(v, idx, batch, _seen)  # noqa: E731
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not str(k).startswith("_"):
                obj[k] = sub(v)
        return obj
    if isinstance(obj, list):
        obj[:] = [sub(v) for v in obj]
        return obj
    if isinstance(obj, tuple):
        vals = [sub(v) for v in obj]
        return type(obj)(*vals) if hasattr(obj, "_fields") else type(obj)(vals)
    attrs = getattr(obj, "__dict__", None)
    if attrs is not None and not callable(obj):
        for k, v in list(attrs.items()):
            if not k.startswith("_"):
                object.__setattr__(obj, k, sub(v))
    return obj
