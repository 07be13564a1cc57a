from __future__ import annotations

from dataclasses import dataclass

from .._lazy import torch

from ..errors import EpiKVError
from .base import CacheView, Observes
from .epikv import EpiKVFlat
from .kv_var import arrival_statistic, check_stat
from .pages import _too_small

RULES = ("pruned", "steps", "every")


def segment_tiers(stats: torch.Tensor) -> torch.Tensor:
    """Segment statistics [n_seg] -> tier per segment, 0 = R, 1 = E, 2 = T, by tertile.

    s = sorted ascending, t_low = s[n // 3], t_high = s[2n // 3]; R if >= t_high, else E if >= t_low, else T (a tie
    goes to the higher tier; a lone segment is R)."""
    n = stats.numel()
    s = stats.sort().values
    t_low, t_high = s[n // 3], s[2 * n // 3]
    two, one, zero = (torch.full_like(stats, v, dtype=torch.long) for v in (2, 1, 0))
    return torch.where(stats >= t_high, zero, torch.where(stats >= t_low, one, two))


def tier_pass(rank: torch.Tensor, seg_stat: torch.Tensor, first: int, prot_end: int, end: int, budget: int,
              segment: int, caps: tuple[int, int, int]) -> torch.Tensor:
    """One row's tier pass: bool [n] of the decode slots it keeps.

    rank, seg_stat: [n]. Segments are `segment`-slot blocks of [first, end) (first = the row's first real slot,
    end = the start of the recency window); decode slots are those >= prot_end. Oldest segment first, each keeps its
    top min(cap of its tier, its decode slots, remaining budget) decode slots by rank."""
    n, dev = rank.numel(), rank.device
    chosen = torch.zeros(n, dtype=torch.bool, device=dev)
    length = end - first
    if length <= 0 or budget <= 0:
        return chosen
    n_seg = -(-length // segment)
    pad = n_seg * segment - length
    slot = torch.arange(first, first + n_seg * segment, device=dev).view(n_seg, segment)  # [n_seg, segment]
    real = (slot < end)
    st = torch.nn.functional.pad(seg_stat[first:end].float(), (0, pad)).view(n_seg, segment)
    means = (st * real).sum(-1) / real.sum(-1)  # a partial last block is a segment: mean over its slots
    cap = torch.tensor(caps, device=dev)[segment_tiers(means)]  # [n_seg]
    decode = real & (slot >= prot_end)
    avail = torch.minimum(cap, decode.sum(-1))
    # sequential budget, oldest first: full takes until it runs out, then a partial one, then nothing
    before = avail.cumsum(0) - avail
    take = torch.minimum(avail, (budget - before).clamp(min=0))  # [n_seg]
    r = torch.nn.functional.pad(rank[first:end].float(), (0, pad)).view(n_seg, segment)
    r = torch.nan_to_num(r, nan=-3e38).masked_fill(~decode, float("-inf"))
    order = r.argsort(dim=-1, descending=True)  # [n_seg, segment]
    pick = torch.arange(segment, device=dev)[None, :] < take[:, None]  # the top `take` of each segment
    chosen[slot.gather(-1, order)[pick]] = True
    return chosen


def seg_keep(rank: torch.Tensor, seg_stat: torch.Tensor, view: CacheView, segment: int,
             caps: tuple[int, int, int], fill: bool = False, value: torch.Tensor | None = None,
             swap: int = 0) -> torch.Tensor:
    """EpiKV-Seg's keep set. rank, seg_stat, value: [batch, n]. Returns sorted indices [batch, m], m <= budget.

    Per row: [kept padding][protected prefix][tier pass (+ fill, + value swap)][recency window]. Left padding is
    kept as far as the budget allows (so the decode slots stay aligned across rows) and counts against it like the
    prompt. Rows of a batch must keep the same count: a row whose keep set is shorter than the longest row's is
    topped up with its best-ranked other decode slots outside the recency window (then its remaining padding);
    batch 1 keeps exactly the rule's set."""
    b, n = rank.shape
    dev = rank.device
    idx = torch.arange(n, device=dev)
    rank = torch.nan_to_num(rank.float(), nan=-3e38)
    keeps, extra = [], []
    for r in range(b):
        n_pad, n_prot = int(view.n_pad[r]), int(view.n_protect[r])
        end = max(n - view.recent, n_pad + n_prot)  # the recency window: the newest `recent` slots
        kp = max(0, min(n_pad, view.budget - n_prot - (n - end)))  # padding kept, the newest of it
        prot_end = n_pad + n_prot
        budget = view.budget - view.recent - n_prot - kp
        chosen = tier_pass(rank[r], seg_stat[r], n_pad, prot_end, end, budget, segment, caps)
        evictable = (idx >= prot_end) & (idx < end)
        if fill:
            left = budget - int(chosen.sum())
            if left > 0:
                cand = rank[r].masked_fill(~evictable | chosen, float("-inf"))
                top = cand.topk(min(left, int((evictable & ~chosen).sum())))
                chosen[top.indices] = True
        if swap and value is not None:
            out_pool = evictable & ~chosen
            m = min(swap, int(out_pool.sum()), int(chosen.sum()))
            if m > 0:
                gain = value[r].float().masked_fill(~out_pool, float("-inf")).topk(m).indices  # highest value out
                lose = rank[r].masked_fill(~chosen, float("inf")).topk(m, largest=False).indices  # lowest ranked in
                chosen[lose] = False
                chosen[gain] = True
        keep = chosen | ((idx >= n_pad - kp) & (idx < prot_end)) | (idx >= end)
        keeps.append(keep)
        # what may top the row up: other evictable slots by rank, then padding (newest first)
        pri = torch.where(evictable, rank[r], torch.where(idx < n_pad, -3.5e38 + idx.float(), float("-inf")))
        extra.append(pri.masked_fill(keep, float("-inf")))
    m = max(int(k.sum()) for k in keeps)
    out = []
    for keep, pri in zip(keeps, extra):
        short = m - int(keep.sum())
        if short > 0:
            keep = keep.clone()
            keep[pri.topk(short).indices] = True
        out.append(idx[keep])
    return torch.stack(out)


def seg_page_keep(rank: torch.Tensor, seg_stat: torch.Tensor, view: CacheView, page: int, segment: int,
                  caps: tuple[int, int, int], fill: bool = False, value: torch.Tensor | None = None,
                  swap: int = 0) -> torch.Tensor:
    """EpiKV-Seg's keep set in whole pages of `page` slots (a paged engine): seg_keep run on the pages.

    rank, seg_stat, value: [batch, n] per slot. Pages are `page`-slot blocks from slot 0 (policies/pages.py). A page
    overlapping the protected prompt or the recency window is kept whole, and so is the newest page (being written);
    every other page is a full page of decode slots. On the pages: rank, segment statistic and value are the means
    of their slots, a segment is segment // page pages (so its statistic is the mean over its slots, as per slot),
    a tier keeps up to cap // page pages, and the budget is the pages that fit in K beside the kept-whole ones. So
    the cache ends at most K, and with page = 1 this is seg_keep exactly (the newest slot, always in the recency
    window when recent >= 1, is kept). Unpadded rows only. Returns sorted slot indices [batch, m]."""
    b, n = rank.shape
    dev = rank.device
    if bool((view.n_pad > 0).any()):
        raise EpiKVError("epikv-seg at page granularity runs unpadded rows only (one prompt at a time)")
    if segment % page:
        raise EpiKVError(f"epikv-seg: segment {segment} must be a multiple of the page size {page}")
    n_pages = -(-n // page)
    last = n - (n_pages - 1) * page  # slots of the newest page, 1..page

    def per_page(x: torch.Tensor) -> torch.Tensor:  # [batch, n] -> [batch, n_pages]: mean over each page's slots
        x = torch.nn.functional.pad(x.float(), (0, n_pages * page - n)).view(b, n_pages, page)
        cnt = torch.full((n_pages,), page, device=dev, dtype=torch.float32)
        cnt[-1] = last
        return x.sum(-1) / cnt

    keeps = []
    for r in range(b):  # rows differ in prompt length, so in their kept-whole pages
        n_prot = int(view.n_protect[r])
        end = max(n - view.recent, n_prot)  # the slot recency window [end, n), as seg_keep
        first = -(-n_prot // page)  # pages overlapping the prompt
        recent_from = max(min(end // page, n_pages - 1), first)  # first page overlapping the window (or the newest)
        free = view.budget - (n - (recent_from - first) * page)  # slots left beside the kept-whole pages
        if free < 0:
            raise EpiKVError(_too_small(view.budget, page, n - (recent_from - first) * page))
        pv = CacheView(length=n_pages, budget=first + (n_pages - recent_from) + free // page, token_data={},
                       n_pad=view.n_pad[r : r + 1], n_protect=torch.tensor([first], device=view.n_protect.device),
                       recent=n_pages - recent_from, keys=[], values=[], device=dev)
        val = per_page(value[r : r + 1]) if value is not None else None
        pages = seg_keep(per_page(rank[r : r + 1]), per_page(seg_stat[r : r + 1]), pv, segment // page,
                         tuple(c // page for c in caps), fill, val, swap)[0]  # [m_pages], newest last
        slots = (pages[:, None] * page + torch.arange(page, device=dev)).flatten()
        keeps.append(slots[: slots.numel() - (page - last)])  # the newest page holds `last` slots
    m = {k.numel() for k in keeps}
    if len(m) > 1:
        raise EpiKVError("epikv-seg at page granularity keeps one row at a time (rows kept different counts)")
    return torch.stack(keeps)


@dataclass
class EpiKVSeg(EpiKVFlat):
    """EpiKV-Seg: key-variance segments in three tiers with 64/32/8 decode slots, ranked inside by the EPIKV score.

    The authors' `kv_seg_hs` (github stevenkolawole/epiphany-kv-cache, commit 121e62c; METHOD.md section 4). At each
    eviction the cache before the recency window is cut into `segment` = 128-slot blocks from the row's first real
    slot (prompt included; a partial last block is a segment). Segment statistic: mean over its slots of the key
    variance over head_dim (float32, unbiased), averaged over KV heads then layers. Tiers by tertile of the segment
    statistics (t_low = s[n//3], t_high = s[2n//3], ties up, a lone segment R): R keeps up to 64 decode slots, E 32,
    T 8 (`caps`). Segments are served oldest first from a budget of K - recent - prompt, each keeping its top slots
    by the HS score (z_A - z_B, frozen at arrival); when the caps bind first the cache ends below K. Options:
    `fill` (unused slots go to the best-ranked other decode slots: exactly K), `swap` = N with `swap_stat`
    range|var|norm (the N highest-value evicted decode slots replace the lowest-ranked kept ones; the authors ran it
    at tau = 1). Schedule (`rule`, period tau = 128): "pruned" (shipped) evicts when the cache is over K and its
    decode slots are a multiple of tau; "steps" when over K and tau slots were stored since the last eviction;
    "every" when over K + tau - 1. Every rule also evicts above K + tau - 1 (a multi-token chunk can step over a
    multiple of tau). Padded batches: padding counts like prompt; rows are topped up to the longest row's count.
    With `page` > 0 (a paged engine, `epikv serve`) the same rule runs on whole pages (seg_page_keep: page means,
    segment // page pages per segment, cap // page pages per tier; page 1 gives the slot rule's keep set).

    Choices where METHOD.md leaves one open: "decode slots" are the slots after the protected prefix (the prompt; with
    protect_prompt off, prompt slots after the sinks count as decode slots); "steps" counts slots stored since the last
    eviction (decode tokens before the first); segments start at the row's first real slot (left padding is in no
    segment); the caps and the value swap use the ranking score with NaN lowest; the swap only trades among decode
    slots outside the recency window and runs after the fill; a segment statistic is computed from the keys as
    taken per slot when the token is stored (keys never change, so it is the one an eviction would compute; the same
for the swap's value statistic), so an eviction reads no cached key.
    """

    tau: int = 128
    rule: str = "pruned"
    segment: int = 128
    caps: tuple[int, int, int] = (64, 32, 8)  # decode slots kept per R, E, T segment
    fill: bool = False
    swap: int = 0  # value swap N (0: off)
    swap_stat: str = "range"

    name = "epikv-seg"
    paper = "arXiv:2606.26472 (authors' later code)"
    own_page_rule = True  # page > 0: seg_page_keep (whole pages, as a paged engine frees them)

    def __post_init__(self):
        super().__post_init__()
        if self.rule not in RULES:
            raise EpiKVError(f"{self.name}: rule must be one of {', '.join(RULES)}, got {self.rule!r}")
        if self.segment < 1 or len(self.caps) != 3:
            raise EpiKVError(f"{self.name}: segment must be positive and caps three numbers (R, E, T)")
        if self.reserve:
            raise EpiKVError(f"{self.name}: the value reserve belongs to the flat policies; Seg has `swap`")
        check_stat(self.name, "swap_stat", self.swap_stat)
        if self.page and self.segment % self.page:
            raise EpiKVError(f"{self.name}: segment {self.segment} must be a multiple of the page size {self.page} "
                             "(a page belongs to one segment)")

    def observes(self, n_layers):
        # the statistics are taken on arrival (kv_stats): no layer's cached keys are read at eviction; keys_values
        # keeps the cache in true order (segments are runs of consecutive slots)
        return Observes(hidden_layers=super().observes(n_layers).hidden_layers, keys_values=True, kv_layers=(),
                        arriving_kv=True, kv_parts="kv" if self.swap else "k")  # values for the swap only

    def kv_stats(self, obs) -> dict[str, torch.Tensor]:
        """The new tokens' key variance ("kvar", the segment statistic's per-slot term) and, with the swap, their
        value statistic ("vstat"), [batch, T] each: taken when they are stored (keys and values never change), so
        an eviction reads no cached key."""
        t = obs.valid.shape[1]
        out = {"kvar": arrival_statistic(obs.keys, t, "var", obs.valid)}
        if self.swap:
            out["vstat"] = arrival_statistic(obs.values, t, self.swap_stat, obs.valid)
        return out

    def on_tokens(self, state, obs):
        return {**super().on_tokens(state, obs), **self.kv_stats(obs)}

    def should_evict(self, length, budget, steps, decode_slots):
        if length > budget + self.tau - 1:  # every rule: never more than K + tau - 1 between two steps
            return True
        if length <= budget or self.rule == "every":
            return False
        if self.rule == "pruned":
            return decode_slots % self.tau == 0
        return steps >= self.tau

    def ranking(self, state, view: CacheView) -> torch.Tensor:
        """The score that ranks decode slots inside segments, for the fill and the swap: [batch, n]."""
        return view.token_data["score"]

    def scores(self, state, view):
        return self.ranking(state, view)

    def keep(self, state, view):
        dev = view.device
        rank = self.ranking(state, view).to(dev)
        seg_stat = view.token_data["kvar"].to(dev)
        value = view.token_data["vstat"].to(dev) if self.swap else None
        if self.page:
            return seg_page_keep(rank, seg_stat, view, self.page, self.segment, tuple(self.caps), self.fill, value,
                                 self.swap)
        return seg_keep(rank, seg_stat, view, self.segment, tuple(self.caps), self.fill, value, self.swap)
