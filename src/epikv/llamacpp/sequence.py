"""One sequence's side of EPIKV inside llama.cpp, shared by the single-sequence decoder (engine.LlamaDecoder) and
the server's continuous batching (epikv.serving.llamacpp): the mirror of the sequence's cached tokens (true
position and per-token policy data, chronological), the policy fed the captured block outputs through its own
`on_tokens`, its own `keep` (policy_state.PolicyState, as every engine), and eviction by removing runs of positions
with `llama_memory_seq_rm`, checked against llama.cpp's bounds and cell count.

The caller owns the context and the decode; after each decode it hands this sequence its rows (`record`).

For the policies that read cached keys and values (Observes.keys_values: epikv-seg, epikv-seg-q, lag-kv, lag-kv-key)
the mirror also holds every cached token's key and / or value (Observes.kv_parts: what the policy reads) per KV head
at the layers its keep rule reads (Observes.kv_layers: every one for lag-kv, block A+1 alone for Seg-Q, none for
Seg, whose statistics are taken on arrival), as llama.cpp stores them (its type_k / type_v: F16 by default, F32 with
type_kv="f32"; the captured float32 rows cast the same way), compacted with the positions at every eviction: the
policy's view.keys / view.values are [1, kv_heads, n, head_dim] views of it, in the torch engine's layout (None at
a layer not held, [] for a part it does not read). Policies that take a statistic on arrival (Observes.arriving_kv:
kv-key, kv-val, the value reserve, Seg and Seg-Q) get the new tokens' rows of every layer in on_tokens. Policies
that read queries (Observes.queries) get the last w rotated queries of their layers, [1, heads, w, head_dim], the
newest last, as the torch engine keeps them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..errors import EpiKVError
from ..policies import CacheView, Policy
from ..policies.view import HiddenStack
from ..policy_state import BufferBytes, PolicyState, held_bytes
from ..signals import check_layers
from ..policies.hidden import HiddenStatePolicy
from . import lib
from .capture import LayerRows
from .model import GGUFModel


# the buffers a llama.cpp sequence keeps for its policy (policy_state.BUFFER_KINDS)
SEQUENCE_BUFFERS = ("mirror", "waiting_hidden", "waiting_kv", "queries", "token_data", "policy_state")


# Arriving keys / values (every layer's, for a statistic taken on arrival: Seg, Seg-Q) are the largest buffer a
# token has (one F16 cell's worth a token at float32, for Seg-Q's keys): their scoring is due at least this often, however long the recent
# window that lets the hidden-state rows wait (flush: chunked scoring gives the same scores, tests/test_signals.py)
ARRIVING_EVERY = 16


def score_every(policy: Policy, recent: int, obs) -> int:
    """How many tokens wait for their scoring (sequence.flush): the recent window for the hidden-state policies, whose
    scores are first read when a token leaves it, at most ARRIVING_EVERY where arriving keys / values wait too; 1 (each
    step, as the torch engine) for any other policy."""
    every = max(1, recent) if isinstance(policy, HiddenStatePolicy) else 1
    return min(every, ARRIVING_EVERY) if obs.arriving_kv else every


def arriving_dtype(kv_dtype) -> type:
    """The numpy type arriving keys / values wait in: the mirror's F16 where the cells are F16 or quantized (the
    policy reads them cast to that type anyway, so storing them cast changes no score), float32 else (numpy has no
    bf16)."""
    return np.float16 if kv_dtype == torch.float16 else np.float32


def kv_plan(obs, n_layers: int) -> dict[str, list[int]]:
    """Which layers' keys / values a sequence mirrors ("mirror": Observes.keys_values at Observes.kv_layers, every
    layer when None) and which the capture copies at each decode ("capture": the mirror's, or every layer for a
    policy that takes a statistic on arrival, Observes.arriving_kv)."""
    mirror = (list(range(n_layers)) if obs.kv_layers is None else sorted(obs.kv_layers)) if obs.keys_values else []
    if mirror:
        check_layers(mirror, n_layers)
    return {"mirror": mirror, "capture": list(range(n_layers)) if obs.arriving_kv else mirror}


def _layers(rows, layers: list[int]) -> np.ndarray:
    """[len(layers), t, heads, head_dim] of a kind's captured rows (capture.LayerRows: one slice when every layer
    it holds is asked for; a plain layer -> rows dict: stacked)."""
    if isinstance(rows, LayerRows) and rows.layers == layers:
        return rows.stacked  # a view: callers copy or cast what they keep
    return np.stack([rows[l] for l in layers])


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
                       blocks: list[int], cells: CellCounter | None = None,
                       kv_dtype: torch.dtype = torch.float16, cell_bytes: int = 0) -> None:
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
        self.shifted = 0  # positions renumbered away by a policy that shifts (context-shift): next is seen - shifted
        self.shifts: list[dict] = []  # each shift: n_keep, n_discard and the token count (seen) it happened at
        self.evicted_tokens = 0
        self.max_tokens = 0
        self.n_prompt = self.n_protect = 0
        self.on_evict: Callable[["SequenceCache", torch.Tensor], None] | None = None  # test hook: before seq_rm
        self._rows: list[np.ndarray] = []  # captured rows of the tokens not yet scored, [blocks, T, dim] a step
        self._unscored = 0
        # peak KV bytes (kvtypes): the cells as llama.cpp stores them and the policy's buffers, at the moment of the
        # most bytes (after a decode, before the eviction that follows it)
        self.cell_bytes = cell_bytes
        # every buffer this sequence keeps for its policy, allocated bytes by kind (policy_state.BUFFER_KINDS), now
        # and at the most: noted after each decode (before its scoring and eviction), after a flush and an eviction;
        # _rows and _arriving are counted as they grow (their lists are long), the rest read from the arrays
        self.buffers = BufferBytes(SEQUENCE_BUFFERS)
        self._hidden_bytes = self._arriving_bytes = 0  # bytes of _rows, of _arriving
        self.peak: dict[str, int] = {"bytes": 0, "cells": 0, "cell_bytes": 0, "mirror_bytes": 0, "pending_bytes": 0,
                                     "query_bytes": 0}  # at the moment of the most bytes
        self.max_cells = 0  # the most cells held at once (after a decode, before its eviction)
        # the hidden-state policies' on_tokens reads only the step's own tokens, so their scoring may wait (flush);
        # any other policy is fed every step, as the torch engine does
        obs = policy.observes(gm.depth)
        self._score_every = score_every(policy, self.recent, obs)
        # the base on_tokens (streaming, random, full, context-shift) scores nothing: no observation to build a step
        self._scores_nothing = type(policy).on_tokens is Policy.on_tokens
        n_layers = gm.n_layers
        plan = kv_plan(obs, n_layers)
        self.mirror_layers = plan["mirror"]  # the layers whose keys / values the mirror holds (the keep rule's)
        self.kv_layers = plan["capture"]  # the layers captured at each decode (every one for arrival statistics)
        self._needs_kv = bool(self.mirror_layers)
        self._arriving_kv = bool(obs.arriving_kv)
        self._arriving_np = arriving_dtype(kv_dtype)  # the type arriving rows wait in (astype copies them)
        self.kv_parts = "".join(k for k in "kv" if k in obs.kv_parts) if self.kv_layers else ""  # what is read
        self._n_queries = int(obs.queries)
        self.query_layers = sorted(obs.query_layers or range(n_layers)) if obs.queries else []
        self.kv_dtype = kv_dtype
        # [parts, mirror layers, kv_heads, capacity, head_dim]: the keys and / or values the keep rule reads
        self._kv: torch.Tensor | None = None
        self._kv_np: np.ndarray | None = None  # a numpy view of _kv
        self.mirror_cells: int | None = None  # the most cells this sequence can hold (set by the caller): the capacity
        self._arriving: list[dict[str, np.ndarray]] = []  # captured K/V rows of the unscored tokens, [L, t, H, d]
        self._queries: dict[int, torch.Tensor] = {}  # layer -> [1, heads, <= w, head_dim]
        self._attended = 0  # tokens whose queries / keys / values `attend` took for the next `record`

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
        self._note_buffers()  # the policy's fresh state

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
        p0 = self.next_pos
        pos = torch.arange(p0, p0 + t)[None, :]  # [1, T]
        self.token_data["pos"] = pos if "pos" not in self.token_data else torch.cat([self.token_data["pos"], pos], 1)
        if rows is not None:  # [blocks, T, dim], one copy of every block's rows
            if isinstance(rows, LayerRows) and rows.layers == self.blocks:
                held = rows.stacked.copy()
            else:
                held = np.stack([rows[blk] for blk in self.blocks])
            self._rows.append(held)
            self._hidden_bytes += held.nbytes
        self._unscored += t
        self.seen += t
        self._note_peak()
        self._note_buffers()
        if self._unscored >= self._score_every:
            self.flush()
            self._note_buffers()
        if self.ps.due(self.stored()):
            self.evict()
            self._note_buffers()
        self.max_tokens = max(self.max_tokens, self.stored())  # after the step, as the torch engine counts

    @property
    def next_pos(self) -> int:
        """The position the sequence's next token takes: one past its highest (true positions, unless a policy
        renumbers them: context-shift)."""
        return self.seen - self.shifted

    def _note_peak(self) -> None:
        """Update the peak with the bytes held now: every cell, the mirror's rows of them, the rows waiting to be
        scored and the query window (kvtypes: what is counted and why)."""
        n = self.stored()
        kv = self._kv
        mirror = 0 if kv is None else n * (kv.numel() // kv.shape[3]) * kv.element_size()
        queries = sum(q.numel() * q.element_size() for q in self._queries.values())
        pending = self._hidden_bytes + self._arriving_bytes  # the rows waiting to be scored
        total = n * self.cell_bytes + mirror + pending + queries
        self.max_cells = max(self.max_cells, n)
        if total > self.peak["bytes"]:
            self.peak = {"bytes": total, "cells": n, "cell_bytes": n * self.cell_bytes, "mirror_bytes": mirror,
                         "pending_bytes": pending, "query_bytes": queries}

    def buffer_bytes(self, fresh: bool = False) -> dict[str, int]:
        """Bytes of each buffer this sequence keeps for its policy (SEQUENCE_BUFFERS), read from the arrays; the
        waiting rows from their running counts unless `fresh` (then summed over the lists: what the tests compare
        the counts with)."""
        seen: set = set()
        if fresh:
            hidden, arriving = held_bytes(self._rows, seen), held_bytes(self._arriving, seen)
        else:
            hidden, arriving = self._hidden_bytes, self._arriving_bytes
        return {"mirror": held_bytes(self._kv, seen), "waiting_hidden": hidden, "waiting_kv": arriving,
                "queries": held_bytes(self._queries, seen), **self.ps.buffer_bytes(seen)}

    def _note_buffers(self) -> None:
        self.buffers.note(self.buffer_bytes())

    def peak_report(self) -> dict:
        """The peak as reports carry it: kv_peak_bytes (cells + buffers) and its parts at that moment, and the most
        cells held at any moment (kv_peak_cells: K + tau for the default schedule; the byte peak may fall a step
        earlier, when more rows wait to be scored). These count the rows in use, as --kv-memory plans them; with
        them, buffer_bytes / buffer_peak_bytes: every buffer's allocated bytes by kind, now and at the most."""
        p = self.peak
        return {**self.buffers.report(), "kv_peak_bytes": p["bytes"], "kv_peak_cells": self.max_cells,
                "kv_peak_cell_bytes": p["cell_bytes"], "kv_peak_buffer_bytes": p["bytes"] - p["cell_bytes"], "kv_peak_mirror_bytes": p["mirror_bytes"],
                "kv_peak_pending_bytes": p["pending_bytes"], "kv_peak_query_bytes": p["query_bytes"]}

    state = property(lambda self: self.ps.state)
    evictions = property(lambda self: self.ps.evictions)
    token_data = property(lambda self: self.ps.token_data,
                          lambda self, v: setattr(self.ps, "token_data", v))

    def drop(self) -> None:
        """Remove every cell of the sequence (finished, failed, cancelled or preempted) and forget the mirror."""
        self._ll.llama_memory_seq_rm(self.mem, self.seq, -1, -1)
        self.token_data, self._rows, self._unscored = {}, [], 0
        self._kv, self._kv_np, self._arriving, self._queries = None, None, [], {}
        self._hidden_bytes = self._arriving_bytes = 0
        self.buffers.note({})

    # -- keys, values and queries -------------------------------------------------------------------------------------
    def _take_attn(self, n_old: int, t: int, attn: dict[str, dict[int, np.ndarray]]) -> None:
        """Append the t new tokens' keys and values to the mirror (cast as llama.cpp stores them) and / or keep
        them for on_tokens (a statistic taken on arrival); roll the query window."""
        if self._needs_kv:
            kv = self._kv
            parts, layers = self.kv_parts, self.mirror_layers
            if kv is None or kv.shape[3] < n_old + t:
                _, heads, dim = attn[parts[0]][layers[0]].shape
                cap = max(n_old + t, 2 * kv.shape[3] if kv is not None else self.mirror_cells or 0)
                grown = torch.zeros(len(parts), len(layers), heads, cap, dim, dtype=self.kv_dtype)
                if kv is not None:
                    grown[:, :, :, :n_old] = kv[:, :, :, :n_old]
                self._kv = kv = grown
                self._kv_np = grown.numpy()  # the same memory: numpy writes a step's rows in one call
            for p, kind in enumerate(parts):  # [L, t, H, d] -> [L, H, t, d], cast to the cache's type (round to even)
                self._kv_np[p, :, :, n_old : n_old + t] = _layers(attn[kind], layers).transpose(0, 2, 1, 3)
        if self._arriving_kv:
            at = self._arriving_np
            self._arriving.append({kind: _layers(attn[kind], self.kv_layers).astype(at) for kind in self.kv_parts})
            self._arriving_bytes += sum(a.nbytes for a in self._arriving[-1].values())
        w = self._n_queries
        for l in self.query_layers:
            q = torch.from_numpy(attn["q"][l][-w:].copy()).transpose(0, 1)[None]  # [1, heads, <= w, dim]
            old = self._queries.get(l)
            self._queries[l] = q if old is None else torch.cat([old, q], dim=2)[:, :, -w:]

    def cached_kv(self) -> tuple[list, list]:
        """The mirror's keys and values per layer, [1, kv_heads, n, head_dim] views in chronological order (the
        torch engine's layout), as llama.cpp stores them, None at a layer the keep rule does not read
        (Observes.kv_layers); [] for what the policy does not read (Observes.kv_parts)."""
        if not self._needs_kv or self._kv is None:
            return [], []
        n = self.stored()
        at = {l: j for j, l in enumerate(self.mirror_layers)}
        return tuple([self._kv[self.kv_parts.index(kind), at[l], None, :, :n] if l in at else None
                      for l in range(self.gm.n_layers)] if kind in self.kv_parts else [] for kind in "kv")

    def mirror_bytes(self) -> int:
        """Bytes this sequence's key/value mirror holds (0 for a policy that reads no cached keys/values)."""
        kv = self._kv  # one read: drop() may clear it
        return 0 if kv is None else kv.numel() * kv.element_size()

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

    def _renumber(self, n_before: int, gone: list[int]) -> None:
        """After a removal, shift each run of surviving positions down over the gaps below it
        (llama_memory_seq_add: llama.cpp re-rotates their cached keys on the next decode), so positions are
        contiguous from the first again, as llama.cpp's context shift leaves them; the next token follows."""
        pos = self.positions
        want = torch.arange(int(pos[0]), int(pos[0]) + pos.numel())
        delta = want - pos  # <= 0, non-increasing
        if not bool(delta.any()):
            return
        # runs of equal shift among the kept positions, lowest first (each moves into the gap below it)
        change = torch.nonzero(delta[1:] != delta[:-1]).squeeze(-1).tolist()
        starts = [0] + [c + 1 for c in change]
        ends = starts[1:] + [pos.numel()]
        for a, b in zip(starts, ends):
            d = int(delta[a])
            if d:
                self._ll.llama_memory_seq_add(self.mem, self.seq, int(pos[a]), int(pos[b - 1]) + 1, d)
        self.shifted -= int(delta[-1])
        self.token_data["pos"] = want[None].to(self.token_data["pos"].dtype)
        self.shifts.append({"n_keep": gone[0], "n_discard": len(gone), "at": self.seen, "cells": n_before})

    # -- scoring --------------------------------------------------------------------------------------------------------
    def flush(self) -> None:
        """Feed the policy every token not yet scored, in one on_tokens call (for the hidden-state policies a chunk
        gives exactly what token-by-token calls give: tests/test_signals.py). Deferred up to the recent window: a
        token's score is first read when it leaves the window, so scoring the newest tokens in chunks changes no
        keep set and takes the policy's per-call overhead off most decode steps."""
        u = self._unscored
        if not u:
            return
        if self._scores_nothing:  # on_tokens returns nothing and changes no state: observing is a no-op
            self._rows, self._unscored, self._arriving = [], 0, []
            self._hidden_bytes = self._arriving_bytes = 0
            return
        n = self.stored()
        pos = self.token_data["pos"][:, n - u:]  # [1, u]
        hidden = {}
        if self._rows:  # block -> [1, u, dim], views of one [1, blocks, u, dim] tensor
            rows = self._rows[0] if len(self._rows) == 1 else np.concatenate(self._rows, axis=1)
            hidden = HiddenStack(self.blocks, torch.from_numpy(rows)[None])
        stored = {k: (v[..., : n - u] if k == "pos" else v) for k, v in self.token_data.items()}
        keys, values = self.cached_kv()
        if self._arriving:  # the u new tokens' keys / values per layer, [1, kv_heads, u, head_dim] as stored
            keys, values = (list(torch.from_numpy(np.concatenate([a[kind] for a in self._arriving], axis=1))
                                 .to(self.kv_dtype).transpose(1, 2)[:, None]) if kind in self.kv_parts else []
                            for kind in "kv")
        # the positions are in the mirror already (record): the policy's own data is appended
        self.ps.observe(hidden=hidden, valid=torch.ones(1, u, dtype=torch.bool), positions=pos, n_old=n - u,
                        kv_heads=self.gm.n_head_kv, keys=keys, values=values, stored=stored,
                        record_positions=False)
        self._rows, self._unscored, self._arriving = [], 0, []
        self._hidden_bytes = self._arriving_bytes = 0

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
        return self.ps.view(self.stored(), token_data=data, keys=keys, values=values, queries=queries,
                            query_valid=query_valid)

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
        if self.policy.renumbers_positions and idx:
            self._renumber(n, idx)
        if self._kv is not None:  # the key/value mirror follows the same keep set (moved from the first gap on)
            first = idx[0] if idx else keep.numel()
            m = keep.numel()
            self._kv[:, :, :, first:m] = self._kv.index_select(3, keep[first:])
        self._check_mirror()
