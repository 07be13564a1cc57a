"""One sequence's side of EPIKV inside llama.cpp, shared by the single-sequence decoder (engine.LlamaDecoder) and the
server's continuous batching (serving.py): the mirror of the sequence's cached tokens (true position and per-token
policy data, chronological), the policy fed the captured block outputs through its own `on_tokens`, its own `keep`,
and eviction by removing runs of positions with `llama_memory_seq_rm`, checked against `seq_pos_min` / `seq_pos_max`.

The caller owns the context and the decode; after each decode it hands this sequence its rows (`record`).

For the policies that read cached keys and values (Observes.keys_values: epikv-seg, epikv-seg-q, lag-kv, lag-kv-key)
the mirror also holds every cached token's key and / or value (Observes.kv_parts: what the policy reads) per layer and
KV head, as llama.cpp stores them (its type_k / type_v: F16 by default, F32 with type_kv="f32"; the captured float32
rows cast the same way), compacted with the positions at every eviction: the policy's view.keys / view.values are
[1, kv_heads, n, head_dim] views of it, in the torch engine's layout ([] for a part it does not read). Policies that
read the keys/values of arriving tokens only (kv-key, kv-val, the value reserve) get those rows in on_tokens and no
mirror. Policies that read queries (Observes.queries) get the last w
rotated queries of their layers, [1, heads, w, head_dim], the newest last, as the torch engine keeps them.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from ..errors import EpiKVError
from ..policies import CacheView, Policy, StepObservation
from ..policies.hidden import HiddenStatePolicy
from .model import GGUFModel


class SequenceCache:
    """The mirror and the policy of sequence `seq` in the llama.cpp memory `mem` (policy already checked;
    budget None for a policy that does not evict)."""

    def _init_sequence(self, ll, mem, seq: int, gm: GGUFModel, policy: Policy, budget: int | None,
                       blocks: list[int], kv_dtype: torch.dtype = torch.float16) -> None:
        self._ll, self.mem, self.seq, self.gm = ll, mem, seq, gm
        self.policy = policy
        self.budget = budget if policy.evicts else None
        self.tau = policy.tau
        self.recent = policy.recent_window(budget) if policy.evicts else 0
        if policy.evicts and self.recent < 1:
            raise EpiKVError("--engine llama.cpp keeps at least the newest token (its next token must follow the "
                             "sequence's highest position): the recent window must be >= 1")
        self.blocks = blocks
        self.token_data: dict[str, torch.Tensor] = {}  # [1, n] per cached token, chronological (the mirror)
        self.state = None
        self.seen = 0
        self.evictions = 0
        self.evicted_tokens = 0
        self.max_tokens = 0
        self.n_prompt = self.n_protect = 0
        self._len_after_evict = self._prefix = 0
        self.on_evict: Callable[["SequenceCache", torch.Tensor], None] | None = None  # test hook: before seq_rm
        self._rows: list[dict[int, np.ndarray]] = []  # captured rows of the tokens not yet scored
        self._unscored = 0
        self._n_protect_t = torch.zeros(1, dtype=torch.long)
        # the hidden-state policies' on_tokens reads only the step's own tokens, so their scoring may wait (flush);
        # any other policy is fed every step, as the torch engine does
        self._score_every = max(1, self.recent) if isinstance(policy, HiddenStatePolicy) else 1
        obs = policy.observes(gm.depth)
        n_layers = gm.n_layers
        self._needs_kv = bool(obs.keys_values)
        self._arriving_kv = bool(obs.arriving_kv) and not obs.keys_values
        self.kv_layers = list(range(n_layers)) if (obs.keys_values or obs.arriving_kv) else []
        self.kv_parts = "".join(k for k in "kv" if k in obs.kv_parts) if self.kv_layers else ""  # what is read
        self._n_queries = int(obs.queries)
        self.query_layers = sorted(obs.query_layers or range(n_layers)) if obs.queries else []
        self.kv_dtype = kv_dtype
        # [parts, layers, kv_heads, capacity, head_dim]: the keys and / or values the policy reads (the mirror)
        self._kv: torch.Tensor | None = None
        self.mirror_cells: int | None = None  # the most cells this sequence can hold (set by the caller): the capacity
        self._arriving: list[dict[str, dict[int, np.ndarray]]] = []  # captured K/V rows of the unscored tokens
        self._queries: dict[int, torch.Tensor] = {}  # layer -> [1, heads, <= w, head_dim]
        self._attended = 0  # tokens whose queries / keys / values `attend` took for the next `record`

    def start(self, n_prompt: int) -> None:
        """A prompt of n_prompt tokens is about to be fed: protect its head, refuse what cannot fit the budget."""
        if n_prompt < 1:
            raise EpiKVError("empty prompt: at least one token is needed")
        if self.seen:
            raise EpiKVError("this sequence has already been fed a prompt")
        self.n_prompt = n_prompt
        self.n_protect = self.policy.protected(n_prompt)
        self._n_protect_t = torch.tensor([self.n_protect])
        why = self.policy.protected_overflow(self.budget, self.recent, n_prompt)
        if why:
            raise EpiKVError(why)
        self.state = self.policy.init_state(1, self.gm.depth, torch.device("cpu"))
        self._prefix = self._len_after_evict = self.n_protect

    def attend(self, t: int, attn: dict[str, dict[int, np.ndarray]]) -> None:
        """Before `record` of the same t tokens, for the policies that read queries, keys or values: attn = "q" /
        "k" / "v" -> layer -> [t, heads, head_dim] of their captured rows (capture.attn_rows; copied here)."""
        if self.kv_layers or self.query_layers:
            self._take_attn(self.stored(), t, attn)
            self._attended = t

    def record(self, t: int, rows: dict[int, np.ndarray] | None) -> None:
        """The sequence's next t tokens (positions seen .. seen + t - 1) were decoded; rows: block -> [t, dim] of
        their captured outputs (copied here); their queries, keys and values were handed to `attend` first. Scores
        when due and evicts when the policy says so."""
        if (self.kv_layers or self.query_layers) and self._attended != t:
            raise EpiKVError(f"policy {self.policy.name} reads queries, keys or values but those of the {t} new "
                             "tokens were not captured")
        self._attended = 0
        p0 = self.seen
        pos = torch.arange(p0, p0 + t)[None, :]  # [1, T]
        self.token_data["pos"] = pos if "pos" not in self.token_data else torch.cat([self.token_data["pos"], pos], 1)
        if rows is not None:
            self._rows.append({blk: r.copy() for blk, r in rows.items()})  # [T, dim] each
        self._unscored += t
        self.seen += t
        if self._unscored >= self._score_every:
            self.flush()
        n = self.stored()
        if self.policy.evicts and self.policy.should_evict(n, self.budget, n - self._len_after_evict,
                                                           n - self._prefix):
            self.evict()
        self.max_tokens = max(self.max_tokens, self.stored())  # after the step, as the torch engine counts

    def drop(self) -> None:
        """Remove every cell of the sequence (finished, failed, cancelled or preempted) and forget the mirror."""
        self._ll.llama_memory_seq_rm(self.mem, self.seq, -1, -1)
        self.token_data, self._rows, self._unscored = {}, [], 0
        self._kv, self._arriving, self._queries = None, [], {}

    # -- keys, values and queries -------------------------------------------------------------------------------------
    def _take_attn(self, n_old: int, t: int, attn: dict[str, dict[int, np.ndarray]]) -> None:
        """Append the t new tokens' keys and values to the mirror (cast as llama.cpp stores them), or keep them
        for on_tokens (arriving only); roll the query window."""
        if self._needs_kv:
            kv = self._kv
            parts = self.kv_parts
            if kv is None or kv.shape[3] < n_old + t:
                _, heads, dim = attn[parts[0]][self.kv_layers[0]].shape
                cap = max(n_old + t, 2 * kv.shape[3] if kv is not None else self.mirror_cells or 0)
                grown = torch.zeros(len(parts), len(self.kv_layers), heads, cap, dim, dtype=self.kv_dtype)
                if kv is not None:
                    grown[:, :, :, :n_old] = kv[:, :, :, :n_old]
                self._kv = kv = grown
            new = np.stack([np.stack([attn[kind][l] for l in self.kv_layers]) for kind in parts])  # [P, L, t, H, d]
            kv[:, :, :, n_old : n_old + t] = torch.from_numpy(new).transpose(2, 3)  # cast to the cache's type
        elif self._arriving_kv:
            self._arriving.append({kind: {l: attn[kind][l].astype(np.float32, copy=True) for l in self.kv_layers}
                                   for kind in self.kv_parts})
        w = self._n_queries
        for l in self.query_layers:
            q = torch.from_numpy(attn["q"][l][-w:].copy()).transpose(0, 1)[None]  # [1, heads, <= w, dim]
            old = self._queries.get(l)
            self._queries[l] = q if old is None else torch.cat([old, q], dim=2)[:, :, -w:]

    def cached_kv(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The mirror's keys and values per layer, [1, kv_heads, n, head_dim] views in chronological order (the
        torch engine's layout), as llama.cpp stores them; [] for what the policy does not read (Observes.kv_parts)."""
        if not self._needs_kv or self._kv is None:
            return [], []
        n = self.stored()
        return tuple([self._kv[self.kv_parts.index(kind), j, None, :, :n] for j in range(len(self.kv_layers))]
                     if kind in self.kv_parts else [] for kind in "kv")

    def mirror_bytes(self) -> int:
        """Bytes this sequence's key/value mirror holds (0 for a policy that reads no cached keys/values)."""
        return 0 if self._kv is None else self._kv.numel() * self._kv.element_size()

    def _query_view(self) -> tuple[list, torch.Tensor | None]:
        if not self._n_queries:
            return [], None
        qs = [self._queries.get(l) for l in range(self.gm.n_layers)]
        w = min(self._n_queries, self.seen)
        return qs, torch.ones(1, w, dtype=torch.bool)

    # -- the mirror ---------------------------------------------------------------------------------------------------
    @property
    def positions(self) -> torch.Tensor:
        """True positions of the cached tokens, ascending [n] (the mirror)."""
        p = self.token_data.get("pos")
        return p[0] if p is not None else torch.zeros(0, dtype=torch.long)

    def stored(self) -> int:
        return int(self.positions.numel())

    def cache_bounds(self) -> tuple[int, int]:
        """(seq_pos_min, seq_pos_max) as llama.cpp reports them for this sequence."""
        return (int(self._ll.llama_memory_seq_pos_min(self.mem, self.seq)),
                int(self._ll.llama_memory_seq_pos_max(self.mem, self.seq)))

    def _check_mirror(self) -> None:
        pos = self.positions
        want = (int(pos[0]), int(pos[-1])) if pos.numel() else (-1, -1)
        got = self.cache_bounds()
        if got != want:
            raise EpiKVError(f"llama.cpp's cache holds positions {got[0]}..{got[1]} but epikv's mirror "
                             f"{want[0]}..{want[1]}: the cache and the policy disagree")

    # -- scoring --------------------------------------------------------------------------------------------------------
    def flush(self) -> None:
        """Feed the policy every token not yet scored, in one on_tokens call (for the hidden-state policies a chunk
        gives exactly what token-by-token calls give: tests/test_signals.py). Deferred up to the recent window: a
        token's score is first read when it leaves the window, so scoring the newest tokens in chunks changes no
        keep set and takes the policy's per-call overhead off most decode steps."""
        u = self._unscored
        if not u:
            return
        n = self.stored()
        pos = self.token_data["pos"][:, n - u:]  # [1, u]
        hidden = {}
        if self._rows:
            hidden = {blk: torch.from_numpy(np.concatenate([r[blk] for r in self._rows]))[None]
                      for blk in self.blocks}  # [1, u, dim]
        stored = {k: (v[..., : n - u] if k == "pos" else v) for k, v in self.token_data.items()}
        keys, values = self.cached_kv()
        if self._arriving:  # the u new tokens' keys / values, [1, kv_heads, u, head_dim] as the cache stores them
            keys, values = ([torch.from_numpy(np.concatenate([a[kind][l] for a in self._arriving]))
                             .transpose(0, 1)[None].to(self.kv_dtype) for l in self.kv_layers]
                            if kind in self.kv_parts else [] for kind in "kv")
        obs = StepObservation(hidden=hidden, attentions={}, valid=torch.ones(1, u, dtype=torch.bool), positions=pos,
                              stored=stored, n_protect=self._n_protect_t, in_prompt=pos < self.n_prompt,
                              kv_heads=self.gm.n_head_kv, keys=keys, values=values)
        new = self.policy.on_tokens(self.state, obs)
        for key, x in new.items():
            if key == "pos":
                continue
            if key in self.token_data and x.shape[-1] != n:  # new tokens only: append
                x = torch.cat([self.token_data[key], x], dim=-1)
            self.token_data[key] = x
        self._rows, self._unscored, self._arriving = [], 0, []

    # -- eviction -----------------------------------------------------------------------------------------------------
    def view(self) -> CacheView:
        """The cache as the policy sees it; tokens not yet scored (all inside the protected recent window) carry
        zeros, which select_keep never reads."""
        data, u = self.token_data, self._unscored
        if u:
            data = {k: (v if k == "pos" else torch.cat([v, v.new_zeros(*v.shape[:-1], u)], -1))
                    for k, v in data.items()}
        keys, values = self.cached_kv()
        queries, query_valid = self._query_view()
        return CacheView(length=self.stored(), budget=self.budget, token_data=data,
                         n_pad=torch.zeros(1, dtype=torch.long), n_protect=self._n_protect_t,
                         recent=self.recent, keys=keys, values=values, device=torch.device("cpu"),
                         queries=queries, query_valid=query_valid)

    def evict(self) -> torch.Tensor:
        """Cut the sequence back to the policy's keep set; returns the kept indices into the mirror [m]."""
        if self._unscored and len(self.token_data) == 1:  # nothing scored yet: the policy's data keys are unknown
            self.flush()
        keep = self.policy.keep(self.state, self.view())[0]  # [m] sorted indices into the mirror
        self.remove(keep)
        return keep

    def remove(self, keep: torch.Tensor) -> None:
        """Keep exactly the mirror entries `keep` (sorted indices), removing every other token from llama.cpp's
        cache in runs. Refused, before llama.cpp is called, when the newest token would go (or one not yet
        scored: the recent window must hold them)."""
        n = self.stored()
        keep = torch.as_tensor(keep, dtype=torch.long)
        gone = torch.ones(n, dtype=torch.bool)
        gone[keep] = False
        if bool(gone[-1]):
            raise EpiKVError(f"refused: evicting the newest token (position {int(self.positions[-1])}) would break "
                             "llama.cpp's sequence (the next token must follow its highest position)")
        u = self._unscored
        if u and bool(gone[n - u:].any()):
            raise EpiKVError("refused: the keep set evicts a token the policy has not scored yet (inside the recent "
                             "window)")
        if self.on_evict is not None:
            self.on_evict(self, keep)
        pos = self.positions
        idx = gone.nonzero().squeeze(-1).tolist()
        # maximal runs of consecutive evicted mirror entries: the positions between two of them are not cached
        runs, start = [], None
        for a, i in enumerate(idx):
            if start is None:
                start = i
            if a + 1 == len(idx) or idx[a + 1] != i + 1:
                runs.append((int(pos[start]), int(pos[i]) + 1))
                start = None
        self.evicted_tokens += len(idx)
        for p0, p1 in runs:
            if not self._ll.llama_memory_seq_rm(self.mem, self.seq, p0, p1):
                raise EpiKVError(f"llama.cpp refused to remove positions {p0}..{p1 - 1} of the sequence")
        scored = keep[: keep.numel() - u] if u else keep  # the unscored tail is all kept (checked above)
        for key, x in self.token_data.items():
            self.token_data[key] = x.index_select(-1, keep if key == "pos" else scored)
        if self._kv is not None:  # the key/value mirror follows the same keep set (moved from the first gap on)
            first = idx[0] if idx else keep.numel()
            m = keep.numel()
            self._kv[:, :, :, first:m] = self._kv.index_select(3, keep[first:])
        self.evictions += 1
        self._len_after_evict = self.stored()
        self._check_mirror()
