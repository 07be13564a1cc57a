"""Page-granular eviction: keep or drop whole aligned pages of B stored slots, as a paged KV engine must.

vLLM and SGLang store a sequence's keys and values in pages (vLLM "blocks", 16 tokens by default): page i holds the
tokens written in slots [iB, (i+1)B) of the sequence, prompt included, and memory is freed a page at a time. An
eviction policy inside such an engine can only free whole pages. `page_keep` is that rule on this library's
contiguous cache, so its retention cost can be measured here (docs/SERVING.md):

- Pages are groups of B consecutive stored slots counted from slot 0 (the first prompt token; in a left-padded
  batch, the row's first slot, padding included, so every row has the same boundaries and keeps the same count).
  Dropping whole pages keeps every surviving page whole and in order, so after compaction the groups of B slots
  from slot 0 are still exactly the pages an engine would hold, and new tokens fill the newest page, then new
  ones: the alignment is an invariant, not recomputed.
- A page's priority is the mean of its slots' priorities (padding slots left out; a page of padding only is
  dropped first). A page overlapping the protected prefix (prompt or sinks) or the recency window is kept whole,
  and so is the newest page (the one being written).
- Pages are kept by priority while the total stays within the budget K: exactly (J - 1) B + (size of the newest
  page) slots with J = (K - newest) // B + 1, so the cache ends between K - B + 1 and K after an eviction.
"""

from __future__ import annotations

from .._lazy import torch

from ..errors import EpiKVError
from .view import CacheView


def page_keep(priority: torch.Tensor, view: CacheView, page: int) -> torch.Tensor:
    """The slots to keep, [batch, m] sorted, made of whole pages of `page` slots; m <= budget (>= budget - page + 1
    when the cache is over budget). priority: [batch, length] (token granularity only)."""
    if priority.dim() != 2:
        raise EpiKVError("page-granular eviction needs one priority per token (a per-head policy keeps a different "
                         "set in every head, which a paged engine cannot free page by page)")
    if page < 1:
        raise EpiKVError(f"page size must be positive, got {page}")
    dev = priority.device
    b, n = priority.shape
    n_pages = -(-n // page)
    last = n - (n_pages - 1) * page  # size of the newest page, 1..page
    # [batch, pages, page] view of the slots, the newest page padded out with slot indices >= n
    slot = torch.arange(n_pages * page, device=dev).view(n_pages, page)
    real_slot = slot < n
    n_pad = view.n_pad.to(dev)[:, None, None]
    n_prot = view.n_protect.to(dev)[:, None, None]
    is_pad = slot[None] < n_pad  # [batch, pages, page]
    counted = real_slot[None] & ~is_pad  # real tokens (the slot exists and is not padding)
    protected = counted & ((slot[None] < n_pad + n_prot) | (slot[None] >= n - view.recent))
    pr = torch.nan_to_num(priority.float(), nan=-3e38)  # a NaN score must never win a page
    pr = torch.nn.functional.pad(pr, (0, n_pages * page - n)).view(b, n_pages, page)
    n_real = counted.sum(-1)  # [batch, pages]
    mean = (pr * counted).sum(-1) / n_real.clamp(min=1)
    page_pr = mean.masked_fill(n_real == 0, float("-inf"))  # padding only: dropped first
    keep_whole = protected.any(-1)
    keep_whole[:, -1] = True  # the page being written is never freed
    page_pr = page_pr.masked_fill(keep_whole, float("inf"))
    n_keep = min(n_pages, (view.budget - last) // page + 1)
    need = int(keep_whole.sum(-1).max())  # one host read per eviction: refusing beats silently evicting the prompt
    if need > n_keep:
        raise EpiKVError(_too_small(view.budget, page, (need - 1) * page + last))
    pages = page_pr.topk(n_keep, dim=-1, sorted=False).indices.sort(dim=-1).values  # [batch, J], newest last
    keep = (pages[:, :, None] * page + torch.arange(page, device=dev)).flatten(1)  # [batch, J * page]
    return keep[:, : (n_keep - 1) * page + last]  # the newest page is last: drop its slots past the end


def _too_small(budget: int, page: int, slots: int) -> str:
    return (f"budget {budget} is too small for pages of {page}: the pages holding the protected prompt and the "
            f"recency window need {slots} slots; raise the budget or lower the page size")


def page_overflow(budget: int, page: int, protected: int, recent: int) -> str | None:
    """Why `page_keep` would refuse, at some length, a sequence whose first `protected` slots and newest `recent`
    ones are kept (the same line it raises), or None when it never does. Checked up front, before any token is
    stored: the pages overlapping the protected prefix, the recency window and the newest page must fit the J pages
    page_keep keeps, for every length the cache can be evicted at (over K; the pattern repeats with the length's
    offset in its page once the two regions no longer share a page)."""
    first_pages = -(-protected // page)  # pages 0 .. first_pages - 1 overlap the protected prefix
    hi = max(budget + 1, first_pages * page + recent + page) + page
    for n in range(budget + 1, hi + 1):
        n_pages = -(-n // page)
        last = n - (n_pages - 1) * page
        lo_recent = max(0, n - recent) // page if recent else n_pages - 1  # first page the window (or newest) touches
        need = first_pages + n_pages - max(lo_recent, first_pages)  # protected pages + window pages past them
        if need > min(n_pages, (budget - last) // page + 1):
            return _too_small(budget, page, (need - 1) * page + last)
    return None
