"""One sequence's side of EPIKV inside llama.cpp, shared by the single-sequence decoder (engine.LlamaDecoder) and
the server's continuous batching (epikv.serving.llamacpp): the mirror of the sequence's cached tokens (true
position and per-token policy data, chronological), the policy fed the captured block outputs through its own
`on_tokens`, its own `keep` (policy_state.PolicyState, as every engine), and eviction by removing runs of positions
with `llama_memory_seq_rm`, checked against llama.cpp's bounds and cell count.

The caller owns the context and the decode; after each decode it hands this sequence its rows (`record`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..errors import EpiKVError
from ..policies import CacheView, Policy
from ..policy_state import PolicyState
from ..policies.hidden import HiddenStatePolicy
from . import lib
from .model import GGUFModel


@dataclass(frozen=True)
class CellCounter:
    """The exact number of cells a sequence holds in a llama.cpp context, read from the size of its saved state
    (`llama_state_seq_get_size`, a dry run that copies nothing): llama.cpp writes a fixed header, then the same
    bytes for every cell (its position, and its K and V rows in every layer), so size = base + per_cell x cells.
    `base` and `per_cell` are measured on the context itself by two probe tokens (engine.probe_context)."""

    ctx: object
    mem: object
    base: int
    per_cell: int

    def __call__(self, seq: int) -> int:
        ll = lib.load().ll
        if int(ll.llama_memory_seq_pos_max(self.mem, seq)) < 0:
            return 0
        n, rest = divmod(int(ll.llama_state_seq_get_size(self.ctx, seq)) - self.base, self.per_cell)
        if rest or n < 1:
            raise EpiKVError(f"llama.cpp's state of sequence {seq} is not a whole number of cells "
                             f"({self.base} + {self.per_cell} x n bytes expected)")
        return n


class SequenceCache:
    """The mirror and the policy of sequence `seq` in the llama.cpp memory `mem` (policy already checked;
    budget None for a policy that does not evict)."""

    def _init_sequence(self, ll, mem, seq: int, gm: GGUFModel, policy: Policy, budget: int | None,
                       blocks: list[int], cells: CellCounter | None = None) -> None:
        self._ll, self.mem, self.seq, self.gm = ll, mem, seq, gm
        self.cells = cells  # the exact cell count the mirror is checked against (None: bounds only)
        self.policy = policy
        self.budget = budget if policy.evicts else None
        self.tau = policy.tau
        self.recent = policy.recent_window(budget) if policy.evicts else 0
        if policy.evicts and self.recent < 1:
            raise EpiKVError("--engine llama.cpp keeps at least the newest token (its next token must follow the "
                             "sequence's highest position): the recent window must be >= 1")
        self.blocks = blocks
        # the policy's side (state, per-token data [1, n] per cached token in true order: the mirror, "pos" its
        # positions), as every engine keeps it
        self.ps = PolicyState(policy, self.budget, self.recent, torch.device("cpu"))
        self.seen = 0
        self.evicted_tokens = 0
        self.max_tokens = 0
        self.n_prompt = self.n_protect = 0
        self.on_evict: Callable[["SequenceCache", torch.Tensor], None] | None = None  # test hook: before seq_rm
        self._rows: list[dict[int, np.ndarray]] = []  # captured rows of the tokens not yet scored
        self._unscored = 0
        # the hidden-state policies' on_tokens reads only the step's own tokens, so their scoring may wait (flush);
        # any other policy is fed every step, as the torch engine does
        self._score_every = max(1, self.recent) if isinstance(policy, HiddenStatePolicy) else 1

    def start(self, n_prompt: int) -> None:
        """A prompt of n_prompt tokens is about to be fed: protect its head, refuse what cannot fit the budget."""
        if n_prompt < 1:
            raise EpiKVError("empty prompt: at least one token is needed")
        if self.seen:
            raise EpiKVError("this sequence has already been fed a prompt")
        why = self.policy.protected_overflow(self.budget, self.recent, n_prompt)
        if why:
            raise EpiKVError(why)
        self.n_prompt = n_prompt
        (self.n_protect,) = self.ps.begin([n_prompt], None, self.gm.depth)

    def record(self, t: int, rows: dict[int, np.ndarray] | None) -> None:
        """The sequence's next t tokens (positions seen .. seen + t - 1) were decoded; rows: block -> [t, dim] of
        their captured outputs (copied here). Scores when due and evicts when the policy says so."""
        p0 = self.seen
        pos = torch.arange(p0, p0 + t)[None, :]  # [1, T]
        self.token_data["pos"] = pos if "pos" not in self.token_data else torch.cat([self.token_data["pos"], pos], 1)
        if rows is not None:
            self._rows.append({blk: r.copy() for blk, r in rows.items()})  # [T, dim] each
        self._unscored += t
        self.seen += t
        if self._unscored >= self._score_every:
            self.flush()
        if self.ps.due(self.stored()):
            self.evict()
        self.max_tokens = max(self.max_tokens, self.stored())  # after the step, as the torch engine counts

    state = property(lambda self: self.ps.state)
    evictions = property(lambda self: self.ps.evictions)
    token_data = property(lambda self: self.ps.token_data,
                          lambda self, v: setattr(self.ps, "token_data", v))

    def drop(self) -> None:
        """Remove every cell of the sequence (finished, failed, cancelled or preempted) and forget the mirror."""
        self._ll.llama_memory_seq_rm(self.mem, self.seq, -1, -1)
        self.token_data, self._rows, self._unscored = {}, [], 0

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

    def cell_count(self) -> int | None:
        """The cells llama.cpp holds for this sequence, counted by llama.cpp (None without a counter)."""
        return self.cells(self.seq) if self.cells is not None else None

    def _check_mirror(self) -> None:
        """llama.cpp's cache against the mirror: the lowest and highest positions, and the number of cells (a
        removal that stops one short in a run keeps both bounds)."""
        pos = self.positions
        want = (int(pos[0]), int(pos[-1])) if pos.numel() else (-1, -1)
        got = self.cache_bounds()
        if got != want:
            raise EpiKVError(f"llama.cpp's cache holds positions {got[0]}..{got[1]} but epikv's mirror "
                             f"{want[0]}..{want[1]}: the cache and the policy disagree")
        n = self.cell_count()
        if n is not None and n != pos.numel():
            raise EpiKVError(f"llama.cpp's cache holds {n} cells of sequence {self.seq} but epikv's mirror "
                             f"{pos.numel()}: the cache and the policy disagree")

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
        # the positions are in the mirror already (record): the policy's own data is appended
        self.ps.observe(hidden=hidden, valid=torch.ones(1, u, dtype=torch.bool), positions=pos, n_old=n - u,
                        kv_heads=self.gm.n_head_kv, stored=stored, record_positions=False)
        self._rows, self._unscored = [], 0

    # -- eviction -----------------------------------------------------------------------------------------------------
    def view(self) -> CacheView:
        """The cache as the policy sees it; tokens not yet scored (all inside the protected recent window) carry
        zeros, which select_keep never reads."""
        data, u = self.token_data, self._unscored
        if u:
            data = {k: (v if k == "pos" else torch.cat([v, v.new_zeros(*v.shape[:-1], u)], -1))
                    for k, v in data.items()}
        return self.ps.view(self.stored(), token_data=data)

    def evict(self) -> torch.Tensor:
        """Cut the sequence back to the policy's keep set; returns the kept indices into the mirror [m]."""
        if self._unscored and len(self.token_data) == 1:  # nothing scored yet: the policy's data keys are unknown
            self.flush()
        view = self.view()
        keep = self.policy.keep(self.ps.state, view)[0]  # [m] sorted indices into the mirror
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
        # the unscored tail is all kept (checked above): the policy's data lacks it
        self.ps.select(keep[None], keep.numel(), unscored=u)
        self._check_mirror()
