"""The two paged-cache layouts of transformers' continuous batching that eviction knows, behind one small interface.

transformers 5.18+ (tested on 5.25) keeps a full-attention group's pages in `cache.cache_allocators
["full_attention"]`: a block table per request, a `BlockLedger` (reference counts) and a sector `pool`, with the
page size in the allocator (`tokens_per_page`) and per-layer token views of the KV tensors. transformers 5.17 keeps
them in `cache.group_cache_managers` (one `FullAttentionCacheAllocator` per layer group), a `BlockManager`
(`cache._block_manager`) and plain per-layer tensors `cache.key_cache[j]` of [(num_blocks + 2) * block_size,
kv_heads, head_dim], with `RequestState.allocated_blocks` counting a request's pages. Everything eviction does to
the cache goes through a `Layout`, so the scheduler, the evictor and the probe are the same code on both.
"""

from __future__ import annotations

import importlib
from typing import Any

from .internals import ServingUnsupported, need, params


class Layout:
    """One request-addressed view of the full-attention pages of a PagedAttentionCache."""

    name = ""
    page_field = ""  # ContinuousBatchingConfig's page-size field

    def __init__(self, cache) -> None:
        self.cache = cache

    # what subclasses give
    block_table: dict  # request id -> list of block ids, the allocator's own dict (edited in place)
    page_size: int
    num_blocks: int
    kv_heads: int
    layers: list  # the model layers whose KV lives in these pages

    def stride(self) -> int:  # physical slots per block id
        return self.page_size

    def free_count(self) -> int:
        raise NotImplementedError

    def kv(self, layer: int):  # (keys, values), each [slots, kv_heads, head_dim]
        raise NotImplementedError

    def read_indices(self, rid: str, n: int) -> list[int]:
        return self.alloc.get_read_indices(rid, 0, n)

    def write_indices(self, rid: str, past: int, t: int) -> list[int]:
        return self.alloc.get_write_indices(rid, past, t)

    def release(self, blocks: list[int]) -> int:
        raise NotImplementedError

    def allocate(self, rid: str, tokens: int) -> None:
        raise NotImplementedError

    def drop(self, rid: str, page_indices: list[int], state=None) -> int:
        """Take the pages at these positions of the request's block table out of it and give them back to the
        pool, as the allocator does for a whole finished request. Returns how many blocks went back."""
        table = self.block_table[rid]
        drop = set(page_indices)
        gone = [b for i, b in enumerate(table) if i in drop]
        table[:] = [b for i, b in enumerate(table) if i not in drop]  # in place: the allocator holds this list
        freed = self.release(gone)
        if state is not None and hasattr(state, "allocated_blocks") and self.counts_blocks:
            state.allocated_blocks -= len(gone)  # 5.17 plans its next allocation from this count
        return freed

    counts_blocks = False


class LedgerLayout(Layout):
    """transformers 5.18+: cache_allocators / BlockLedger / sector pool."""

    name = "cache_allocators"
    page_field = "page_size"

    def __init__(self, cache) -> None:
        super().__init__(cache)
        allocs = getattr(cache, "cache_allocators", None)
        if not isinstance(allocs, dict) or list(allocs) != ["full_attention"]:
            raise ServingUnsupported("PagedAttentionCache.cache_allocators == {'full_attention': ...}",
                                     f"found {list(allocs) if isinstance(allocs, dict) else type(allocs).__name__}")
        a = self.alloc = allocs["full_attention"]
        for n in ("block_table", "ledger", "pool", "index", "tokens_per_page", "block_physical_stride",
                  "blocks_per_sector", "_kv_token_views", "layer_indices", "num_blocks"):
            need(a, n, "FullAttentionCacheAllocator")
        self.pool = need(cache, "pool", "PagedAttentionCache")
        for m in ("free_blocks", "try_to_free_sectors", "count_free_blocks", "allocate_sector", "num_free_sectors"):
            need(self.pool, m, "CachePool")
        self.block_table = a.block_table
        self.page_size = a.tokens_per_page
        self.num_blocks = a.num_blocks
        self.kv_heads = getattr(a, "num_key_value_heads", 0)
        self.layers = list(a.layer_indices)

    def stride(self) -> int:
        return self.alloc.block_physical_stride

    def free_count(self) -> int:
        return self.pool.count_free_blocks(self.alloc.index) + self.pool.num_free_sectors * self.alloc.blocks_per_sector

    def kv(self, layer: int):
        return self.alloc._kv_token_views[layer]

    def release(self, blocks: list[int]) -> int:
        a = self.alloc
        freed = [b for b in blocks if a.ledger.release(b, no_cache=True)]
        a.pool.free_blocks(a.index, freed)
        self.cache.pool.try_to_free_sectors()
        return len(freed)

    def allocate(self, rid: str, tokens: int) -> None:
        while self.pool.count_free_blocks(self.alloc.index) < -(-tokens // self.page_size):
            if self.pool.num_free_sectors < 1:
                raise ServingUnsupported("CachePool.allocate_sector", "no sector left for the probe")
            self.pool.allocate_sector(self.alloc.index)
        self.alloc.allocate_cache_to_request(rid, 0, tokens)

    def tidy(self) -> None:
        self.pool.try_to_free_sectors()


class GroupLayout(Layout):
    """transformers 5.17: group_cache_managers / BlockManager / per-layer key_cache tensors."""

    name = "group_cache_managers"
    page_field = "block_size"
    counts_blocks = True

    def __init__(self, cache) -> None:
        super().__init__(cache)
        mod = importlib.import_module("transformers.generation.continuous_batching.cache_manager")
        full = need(mod, "FullAttentionCacheAllocator", "cache_manager")
        groups = need(cache, "group_cache_managers", "PagedAttentionCache")
        if not isinstance(groups, list) or len(groups) != 1 or not isinstance(groups[0], full):
            raise ServingUnsupported("PagedAttentionCache.group_cache_managers == [FullAttentionCacheAllocator]",
                                     f"found {[type(g).__name__ for g in groups] if isinstance(groups, list) else groups}")
        a = self.alloc = groups[0]
        for n in ("block_table", "block_size", "uses_block_sharing"):
            need(a, n, "FullAttentionCacheAllocator")
        for n in ("_block_manager", "key_cache", "value_cache", "layer_index_to_group_indices", "num_blocks",
                  "get_num_free_blocks", "free_blocks", "num_key_value_heads"):
            need(cache, n, "PagedAttentionCache")
        self.manager = cache._block_manager
        need(self.manager, "free_blocks", "BlockManager")
        need(self.manager, "get_free_blocks", "BlockManager")
        params(self.manager.free_blocks, "BlockManager.free_blocks", ("blocks", "shareable"))
        if a.uses_block_sharing:
            raise ServingUnsupported("FullAttentionCacheAllocator.uses_block_sharing == False")
        self.block_table = a.block_table
        self.page_size = a.block_size
        self.num_blocks = cache.num_blocks
        self.kv_heads = cache.num_key_value_heads
        self.index = {l: j for l, (g, j) in cache.layer_index_to_group_indices.items() if g == 0}
        self.layers = sorted(self.index)

    def free_count(self) -> int:
        return self.cache.get_num_free_blocks()

    def kv(self, layer: int):
        j = self.index[layer]
        return self.cache.key_cache[j], self.cache.value_cache[j]

    def release(self, blocks: list[int]) -> int:
        self.manager.free_blocks(list(blocks), shareable=False)
        return len(blocks)

    def allocate(self, rid: str, tokens: int) -> None:
        if self.alloc.allocate_blocks(-(-tokens // self.page_size), rid, self.manager) is None:
            raise ServingUnsupported("FullAttentionCacheAllocator.allocate_blocks", "no block left for the probe")

    def tidy(self) -> None:
        pass


def layout_kind() -> type[Layout]:
    """Which layout this transformers has, by the modules it ships (checked in full by the cache probe)."""
    try:
        importlib.import_module("transformers.generation.continuous_batching.cache_allocators.full_attention")
        return LedgerLayout
    except ImportError:
        pass
    try:
        importlib.import_module("transformers.generation.continuous_batching.cache_manager")
        return GroupLayout
    except ImportError:
        raise ServingUnsupported("continuous_batching.cache_allocators or continuous_batching.cache_manager") from None


def layout_for(cache) -> Any:
    return layout_kind()(cache)
