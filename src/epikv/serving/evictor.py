"""One request's eviction state inside the paged cache, fed the way EpiKVCache feeds a policy (batch of one).

The policy code is the library's own: `on_tokens` scores the new tokens from a StepObservation, `keep` (with
`page=B`, i.e. `policies.pages.page_keep`) picks whole pages. Here only the bookkeeping differs: the stored tokens
live in the request's pages of transformers' paged cache, so dropping a page is taking its id out of the request's
block table and giving it back to the pool (`Layout.drop`, serving/layout.py).
"""

from __future__ import annotations

import copy

import torch

from ..errors import EpiKVError
from ..policies import Policy
from ..policy_state import PolicyState, held_bytes

# the buffers a request keeps for its policy in the paged cache (policy_state.BUFFER_KINDS): its keys and values are
# read from its pages when needed, never copied, and its hidden states live for one forward only
TRACK_BUFFERS = ("queries", "token_data", "policy_state")


def _kv_rows(lay, request_id: str, start: int, stop: int, layers) -> tuple[list, list]:
    """The request's stored keys and values of slots start..stop-1, per layer [1, kv_heads, n, head_dim]."""
    idx = lay.read_indices(request_id, stop)[start:]
    k_views = [lay.kv(l) for l in layers]
    ix = torch.tensor(idx, dtype=torch.long, device=k_views[0][0].device)
    keys = [kv[0].index_select(0, ix).permute(1, 0, 2).unsqueeze(0) for kv in k_views]
    values = [kv[1].index_select(0, ix).permute(1, 0, 2).unsqueeze(0) for kv in k_views]
    return keys, values


class Track:
    """Per-request policy state (policy_state.PolicyState, batch of one) and where the request's tokens are:
    created on admission, deep-copied on a fork, dropped at the end."""

    def __init__(self, policy: Policy, n_layers: int, device, prompt_len: int, budget: int | None,
                 recent: int) -> None:
        self.ps = PolicyState(policy, budget, recent, device)
        self.ps.begin([prompt_len], None, n_layers, init=policy.evicts)
        self.device = device
        self.evicted = 0  # tokens dropped so far: true position = stored slot + evicted
        self.scored = 0  # stored tokens the policy has seen (token_data length)
        # Observes.queries: the rotated queries of the newest w tokens per query layer [1, heads, <= w, head_dim]
        # (a rolling window across forwards and evictions, as the torch cache keeps it)
        self.queries: dict[int, torch.Tensor] = {}
        self.n_layers, self.w = n_layers, policy.observes(n_layers).queries
        self.bytes = self.buffer_bytes()  # as of its last change (observe, evict): the scheduler sums these

    token_data = property(lambda self: self.ps.token_data)
    evictions = property(lambda self: self.ps.evictions)

    def buffer_bytes(self) -> dict[str, int]:
        """Bytes of each buffer the request keeps for its policy (TRACK_BUFFERS), read from the arrays."""
        seen: set = set()
        return {"queries": held_bytes(self.queries, seen), **self.ps.buffer_bytes(seen)}

    def fork(self) -> "Track":
        return copy.deepcopy(self)

    # -- after a forward -------------------------------------------------------------------------------------------
    def observe(self, policy: Policy, hidden: dict[int, torch.Tensor], n_old: int, t: int, kv: "KVReader",
                queries: dict[int, torch.Tensor] | None = None) -> None:
        """The forward just stored t new tokens after n_old: score them (policy.on_tokens), as
        EpiKVCache._after_forward does for one row; queries: per query layer the newest min(w, t) tokens' rotated
        queries, appended to the rolling window."""
        if n_old != self.scored:
            raise EpiKVError(f"serving: request holds {n_old} stored tokens but its policy state has scored "
                             f"{self.scored} (a cache change the scheduler did not see)")
        dev = self.device
        valid = torch.ones(1, t, dtype=torch.bool, device=dev)
        pos = torch.arange(n_old + self.evicted, n_old + self.evicted + t, device=dev)[None]  # true positions
        keys, values = kv.step(n_old, t)
        for l, q in (queries or {}).items():
            old = self.queries.get(l)
            self.queries[l] = q if old is None else torch.cat([old, q.to(old.device)], dim=2)[:, :, -self.w:]
        self.ps.observe(hidden=hidden, valid=valid, positions=pos, n_old=n_old, kv_heads=kv.kv_heads, keys=keys,
                        values=values)
        self.scored = n_old + t
        self.bytes = self.buffer_bytes()

    # -- between steps ---------------------------------------------------------------------------------------------
    def due(self, policy: Policy, n: int, budget: int) -> bool:
        return self.ps.due(n)

    def evict(self, policy: Policy, lay, state, budget: int, recent: int, kv: "KVReader") -> int:
        """Drop the pages policy.keep leaves out; returns the blocks given back. `state` is transformers'
        RequestState, whose position_offset (the stored count, which slots, writes and admission follow) is lowered
        by the tokens dropped."""
        n = state.position_offset
        if n != self.scored:
            raise EpiKVError(f"serving: request {state.request_id} stores {n} tokens but {self.scored} were scored")
        page = policy.page
        keys, values = kv.all(n) if kv.needs_all else ([], [])
        qv = {}
        if self.queries:  # every query is a real token here (no padding): query_valid all true
            w = next(iter(self.queries.values())).shape[2]
            qv = dict(queries=[self.queries.get(l) for l in range(self.n_layers)],
                      query_valid=torch.ones(1, w, dtype=torch.bool, device=self.device))
        keep = self.ps.keep(n, keys=keys, values=values, **qv)  # [1, m] whole pages, the newest last
        m = keep.shape[-1]
        if m >= n:
            return 0
        n_pages = -(-n // page)
        kept = sorted(set((keep[0] // page).tolist()))
        last = n - (n_pages - 1) * page
        table = lay.block_table.get(state.request_id, [])
        # pages past the stored tokens (5.17 allocates a prefill chunk's pages ahead) stay at the table's end
        if len(table) < n_pages or kept[-1] != n_pages - 1 or m != (len(kept) - 1) * page + last:
            raise EpiKVError(f"serving: the keep set of request {state.request_id} is not whole pages of its "
                             f"{len(table)}-page table ({n} tokens, {m} kept)")
        kept_set = set(kept)
        freed = lay.drop(state.request_id, [p for p in range(n_pages) if p not in kept_set], state)
        state.position_offset = m
        self.ps.select(keep, m)
        self.evicted += n - m
        self.scored = m
        self.bytes = self.buffer_bytes()
        return freed


class KVReader:
    """What a policy reads of one request's keys / values in the paged cache (Observes.keys_values: every stored
    slot; arriving_kv: the new ones), as per-layer [1, kv_heads, n, head_dim] tensors."""

    def __init__(self, lay, request_id: str, obs, policy: Policy) -> None:
        self.lay, self.rid, self.layers = lay, request_id, lay.layers
        # the layers the keep rule reads at eviction (Observes.kv_layers; None: every one)
        self.read = list(self.layers) if obs.kv_layers is None else [l for l in self.layers if l in obs.kv_layers]
        self.needs_all = bool(obs.keys_values) and bool(self.read)
        self.arriving = bool(obs.arriving_kv)  # on_tokens gets the new slots only, even with keys_values
        # full keys at on_tokens only for a policy that scores on arrival (lag-kv reads them at eviction only)
        self.all_on_step = (bool(obs.keys_values) and not self.arriving
                            and type(policy).on_tokens is not Policy.on_tokens)
        self.kv_heads = lay.kv_heads

    def step(self, n_old: int, t: int) -> tuple[list, list]:
        if self.arriving:
            return _kv_rows(self.lay, self.rid, n_old, n_old + t, self.layers)
        if self.all_on_step:
            return _kv_rows(self.lay, self.rid, 0, n_old + t, self.layers)
        return [], []

    def all(self, n: int) -> tuple[list, list]:
        """Every stored slot of the layers the keep rule reads; None at the others (as CacheView.keys says)."""
        keys, values = _kv_rows(self.lay, self.rid, 0, n, self.read)
        at = dict(zip(self.read, range(len(self.read))))
        return tuple([rows[at[l]] if l in at else None for l in self.layers] for rows in (keys, values))
