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

import torch

from .policies import CacheView, Policy, StepObservation


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
