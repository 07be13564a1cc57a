"""The policy's side of one batch of sequences, shared by every engine: the torch cache (`cache.EpiKVCache`, a
batch of rows), the paged serving engine (`serving.evictor.Track`, one request) and llama.cpp
(`llamacpp.sequence.SequenceCache`, one sequence).

It holds what the policy needs between steps (its own state, the per-token data it returned, aligned with the
stored tokens, and the prompt's protected head) and does the four things every engine does the same way: feed a
step's observation to `on_tokens` and append what it returns, ask `should_evict`, ask `keep` over a CacheView, and
cut the per-token data to the keep set. Each engine keeps its own storage (tensors, pages, llama.cpp cells) and
moves it to the same keep set; nothing here touches a model.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .policies import CacheView, Policy, StepObservation

# The per-sequence buffers an engine keeps for its policy besides the cached tokens themselves, by kind (each engine
# reports the kinds it has; "total" is their sum). Bytes are what the arrays' memory holds (a view counts its whole
# storage, a storage shared by two of them once), read from the arrays, not planned:
#   mirror          llama.cpp: the cached keys / values the keep rule reads, copied out of llama.cpp (allocated rows)
#   waiting_hidden  llama.cpp: hidden-state rows of tokens not yet scored (the deferred scoring's chunk)
#   waiting_kv      llama.cpp: keys / values of tokens waiting for their statistic (taken on arrival)
#   queries         the window of the newest w rotated queries (and, in the torch engine, its validity mask)
#   token_data      the policy's per-token data: its scores and the true positions, one entry per cached token
#   policy_state    the policy's own state (hidden-state deltas, rolling-statistic windows, ...) except the entries
#                   the rows contract marks shared with "_" (a learned policy's weights: held once, not per sequence),
#                   and the prompt's bookkeeping (PolicyState's n_pad, n_protect, n_prompt)
#   slot_map        the torch engine's physical slot of each token and padding map (once eviction refilled holes)
#                   and its tokens seen
BUFFER_KINDS = ("mirror", "waiting_hidden", "waiting_kv", "queries", "token_data", "policy_state", "slot_map")


def held_bytes(obj, seen: set | None = None, skip_private: bool = False, _depth: int = 0) -> int:
    """Bytes the tensors and arrays in `obj` hold (dicts, lists, tuples and plain objects' attributes walked),
    each storage counted once across calls sharing `seen`; skip_private: leave out dict keys and attributes that
    start with "_". A torch tensor counts its storage, a numpy array its base array (a view holds all of it).
    Called every step by the engines: tensors first, and no generator (a few microseconds a tensor)."""
    if seen is None:
        seen = set()
    if isinstance(obj, torch.Tensor):
        st = obj.untyped_storage()
        key = (obj.is_cuda, st.data_ptr())  # (an accelerator's addresses apart from the host's)
        if key in seen:
            return 0
        seen.add(key)
        return st.nbytes()
    if isinstance(obj, np.ndarray):
        while isinstance(obj.base, np.ndarray):
            obj = obj.base
        key = (False, obj.__array_interface__["data"][0])
        if key in seen:
            return 0
        seen.add(key)
        return obj.nbytes
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    elif obj is None or isinstance(obj, (int, float, str, bytes, type)) or not hasattr(obj, "__dict__"):
        return 0
    else:
        items = vars(obj).items()
    if _depth > 6:
        return 0
    n = 0
    for k, v in items:
        if v is None or (skip_private and isinstance(k, str) and k.startswith("_")):
            continue
        n += held_bytes(v, seen, skip_private, _depth + 1)
    return n


class BufferBytes:
    """The bytes of one owner's buffers by kind (`note`: the figures now), and the most held: per kind its own
    maximum, and "total" the largest sum at any one moment noted (so at most the sum of the kinds' maxima).
    `window` holds the same maxima since the last `take_window` (a server sums its sequences' windows)."""

    def __init__(self, kinds: tuple[str, ...]) -> None:
        self.kinds = kinds
        self.now = self._zero()
        self.peak = self._zero()
        self.window = self._zero()

    def _zero(self) -> dict[str, int]:
        return dict.fromkeys((*self.kinds, "total"), 0)

    def note(self, now: dict[str, int]) -> None:
        now = {k: int(now.get(k, 0)) for k in self.kinds}
        now["total"] = sum(now.values())
        self.now = now
        for d in (self.peak, self.window):
            for k, v in now.items():
                if v > d[k]:
                    d[k] = v

    def take_window(self) -> dict[str, int]:
        """The maxima since the last call (at least what is held now), and a fresh window from now."""
        w, self.window = self.window, dict(self.now)
        return w

    def report(self) -> dict[str, dict[str, int]]:
        return {"buffer_bytes": dict(self.now), "buffer_peak_bytes": dict(self.peak)}


class PolicyState:
    """Per-row policy bookkeeping: `begin` once per prompt, `observe` after each forward, `due` / `keep` / `select`
    between steps. token_data: key -> [batch, ..., n] per stored token in true order, "pos" the true positions."""

    def __init__(self, policy: Policy, budget: int | None, recent: int, device) -> None:
        self.policy, self.budget, self.recent, self.device = policy, budget, recent, device
        self.state: Any = None
        self.token_data: dict[str, torch.Tensor] = {}
        self.n_prompt = self.n_protect = self.n_pad = None  # [batch] each
        self.prefix = self.len_after_evict = 0  # host ints for should_evict
        self.evictions = 0

    def begin(self, prompt_lens: list[int], n_pad: list[int] | None, n_layers, init: bool = True) -> list[int]:
        """A batch of prompts (real tokens and left padding per row); returns each row's protected tokens."""
        n_pad = n_pad or [0] * len(prompt_lens)
        prot = [self.policy.protected(p) for p in prompt_lens]
        dev = self.device
        self.n_pad = torch.tensor(n_pad, dtype=torch.long, device=dev)
        self.n_protect = torch.tensor(prot, dtype=torch.long, device=dev)
        self.n_prompt = torch.tensor(prompt_lens, dtype=torch.long, device=dev)
        self.state = self.policy.init_state(len(prompt_lens), n_layers, dev) if init else None
        self.prefix = self.len_after_evict = max(p + q for p, q in zip(prot, n_pad))
        return prot

    def observe(self, *, hidden: dict, valid: torch.Tensor, positions: torch.Tensor, n_old: int, kv_heads: int,
                attentions: dict | None = None, keys=(), values=(), stored: dict | None = None,
                record_positions: bool = True) -> dict:
        """A forward stored valid.shape[1] new tokens after n_old: score them with the policy's on_tokens and append
        what it returns (a key returned whole, n_old + t long, replaces the stored one). stored: what the
        observation shows as the stored data (default token_data). Returns the policy's new data."""
        obs = StepObservation(hidden=hidden, attentions=attentions or {}, valid=valid, positions=positions,
                              stored=self.token_data if stored is None else stored, n_protect=self.n_protect,
                              in_prompt=valid & (positions < self.n_prompt[:, None]), kv_heads=kv_heads,
                              keys=list(keys), values=list(values))
        # a policy that never evicts, given no state (the paged engine's `full`), scores nothing
        new = self.policy.on_tokens(self.state, obs) if self.policy.evicts or self.state is not None else {}
        if record_positions:
            new["pos"] = positions  # true position of every stored token, kept aligned through evictions
        self.append(new, n_old + valid.shape[1])
        return new

    def append(self, new: dict[str, torch.Tensor], n: int) -> None:
        """Per-token data of new tokens (appended) or of all n stored tokens (replacing)."""
        for key, x in new.items():
            x = x.to(self.device)
            if key in self.token_data and x.shape[-1] != n:  # new tokens only: append
                x = torch.cat([self.token_data[key], x], dim=-1)
            self.token_data[key] = x

    def buffer_bytes(self, seen: set | None = None) -> dict[str, int]:
        """Bytes of the per-token data (scores, positions) and of the policy's own state (BUFFER_KINDS)."""
        seen = set() if seen is None else seen
        return {"token_data": held_bytes(self.token_data, seen),
                "policy_state": held_bytes(self.state, seen, skip_private=True)
                + held_bytes([self.n_pad, self.n_protect, self.n_prompt], seen)}

    def due(self, n: int) -> bool:
        """Whether the policy evicts now, with n tokens stored (its schedule: by default over budget + tau - 1)."""
        return self.policy.evicts and self.policy.should_evict(n, self.budget, n - self.len_after_evict,
                                                               n - self.prefix)

    def view(self, length: int, token_data: dict | None = None, **kv) -> CacheView:
        return CacheView(length=length, budget=self.budget,
                         token_data=self.token_data if token_data is None else token_data, n_pad=self.n_pad,
                         n_protect=self.n_protect, recent=self.recent, device=self.device,
                         **{"keys": [], "values": [], **kv})

    def keep(self, length: int, token_data: dict | None = None, **kv) -> torch.Tensor:
        """The policy's keep set over `length` stored tokens: [batch, K] indices in true order (or
        [batch, layers, heads, K] for a per-head policy). kv: keys / values / queries / query_valid for the view."""
        return self.policy.keep(self.state, self.view(length, token_data, **kv))

    def select(self, keep: torch.Tensor, stored_after: int, ref_layer: int = 0, unscored: int = 0) -> None:
        """Cut the per-token data to the keep set, which the engine has just applied to its storage. unscored: the
        newest tokens not yet scored (llama.cpp scores in chunks), all kept (the engine checked), the newest last:
        every key but "pos" lacks them. Per-token data [batch, n] follows head 0 of layer ref_layer under a
        per-head keep, [batch, layers, heads, n] data its own head."""
        per_head = keep.dim() == 4
        first = keep[:, ref_layer, 0] if per_head else keep  # [batch, K]
        for key, x in self.token_data.items():
            idx = keep if keep.dim() <= x.dim() else first
            if unscored and key != "pos":
                idx = idx[..., : idx.shape[-1] - unscored]
            idx = idx.to(x.device)
            while idx.dim() < x.dim():  # token keep [batch, K] against [batch, ..., n] data
                idx = idx.unsqueeze(1)
            self.token_data[key] = x.gather(-1, idx.expand(*x.shape[:-1], idx.shape[-1]))
        self.evictions += 1
        self.len_after_evict = stored_after
