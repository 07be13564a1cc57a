"""KV cell types of the llama.cpp engine (`--cache-type-k` / `--cache-type-v`, llama.cpp's own names), the bytes a
cell takes as llama.cpp stores it, a sequence's peak KV bytes (cells plus the buffers epikv keeps for the policy),
and `--kv-memory` sizing: the largest budget K whose planned peak fits.

Byte accounting (what `peak_kv_bytes` reports, per sequence):
- cells: the most cells the sequence holds at once, as llama.cpp stores them (ggml's row size of each layer's K and
  V rows: blocks of 32 values for the quantized types). An evicting policy holds at most K + tau - 1 cells between
  two steps; the step's own token is written before the eviction that follows it, so the peak is K + tau cells for
  one-token steps. `llama_state_seq_get_size` of a sequence is these rows plus 12 bytes a cell (position, seq-id
  count, seq id) and a fixed header: tests/test_llamacpp_quant.py checks the two against each other.
- buffers, in use at the same moment: the key/value mirror (cached keys / values of the layers the keep rule reads,
  F16 or F32: one row per cell), the rows waiting for their statistic (hidden-state rows of tokens not yet scored,
  float32, up to the recent window for the hidden-state policies; the arriving keys / values of every layer for the
  policies that take a statistic on arrival, at the mirror's F16 where the cells are F16 or quantized, scored at
  least every 16 tokens) and the query window. Allocation is not counted: llama.cpp allocates
  the context's n_ctx cells (rounded up to 256: `kv_bytes`), which the pool of a server shares.
- every buffer as allocated (SequenceCache.buffer_bytes, reported beside the peak as buffer_bytes /
  buffer_peak_bytes): the same buffers read from their arrays (the mirror's allocated rows, views counting their
  whole storage) and the policy's per-token scores and state, which the plan leaves out (a few bytes a token).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import EpiKVError

# llama.cpp's cache type names (common/arg.cpp's kv_cache_types) -> (ggml_type, values a block, bytes a block)
CACHE_TYPES: dict[str, tuple[int, int, int]] = {
    "f32": (0, 1, 4), "f16": (1, 1, 2), "bf16": (30, 1, 2),
    "q8_0": (8, 32, 34), "q5_1": (7, 32, 24), "q5_0": (6, 32, 22), "q4_1": (3, 32, 20), "q4_0": (2, 32, 18),
    "iq4_nl": (20, 32, 18),
}
CELL_META_BYTES = 12  # a saved cell besides its rows: llama_pos, the seq-id count, one seq id (state_write_meta)


def is_quantized(name: str) -> bool:
    return CACHE_TYPES[name][1] > 1


def check_type(name: str, flag: str = "--cache-type-k") -> str:
    """The type name, or a one-line refusal naming llama.cpp's types."""
    if name not in CACHE_TYPES:
        raise EpiKVError(f"{flag}: unknown cache type {name!r}; llama.cpp's types: {', '.join(CACHE_TYPES)}")
    return name


def row_bytes(name: str, n: int) -> int:
    """ggml_row_size: bytes of n values of a type (n a multiple of its block)."""
    _, blck, size = CACHE_TYPES[name]
    return n // blck * size


def cell_bytes(gm, type_k: str = "f16", type_v: str = "f16") -> int:
    """Bytes one cell takes over every layer as llama.cpp stores it (K and V rows of each layer's KV heads)."""
    return sum(row_bytes(type_k, h * gm.head_dim_k) + row_bytes(type_v, h * gm.head_dim_v)
               for h in gm.n_head_kv_layers)


def resolve_flash_attn(gm, type_k: str, type_v: str, flash_attn: bool | None) -> tuple[bool | None, str | None]:
    """(flash attention setting to pass, a one-line note or None) for these cell types, refused in one line where
    llama.cpp would refuse the context: a quantized V cache needs flash attention (auto is switched on, off is
    refused), and a quantized type's block must divide the model's key / value length."""
    check_type(type_k, "--cache-type-k")
    check_type(type_v, "--cache-type-v")
    for flag, name, dim in (("--cache-type-k", type_k, gm.head_dim_k), ("--cache-type-v", type_v, gm.head_dim_v)):
        blck = CACHE_TYPES[name][1]
        if dim and dim % blck:
            raise EpiKVError(f"{flag} {name}: its blocks of {blck} values do not divide {gm.name}'s "
                             f"{'key' if flag.endswith('k') else 'value'} length {dim}; use f16, bf16 or f32")
    if is_quantized(type_v):
        if flash_attn is False:
            raise EpiKVError(f"--cache-type-v {type_v} needs flash attention (llama.cpp refuses a quantized V cache "
                             "without it): leave --flash-attn at auto or set it on")
        if flash_attn is None:
            return True, f"flash attention switched on: llama.cpp requires it for the quantized V cache ({type_v})"
    return flash_attn, None


def mirror_dtype(type_k: str, type_v: str):
    """The torch dtype of the key/value mirror: the cells' own where torch has it (f32, f16, bf16 cells, both kinds
    the same), F16 for quantized cells (their float rows before quantization; see docs/llamacpp.md)."""
    import torch

    if type_k == type_v and type_k in ("f32", "bf16"):
        return {"f32": torch.float32, "bf16": torch.bfloat16}[type_k]
    return torch.float16


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000 ** 2, "mb": 1000 ** 2, "g": 1000 ** 3, "gb": 1000 ** 3,
          "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30}


def parse_bytes(text: str) -> int:
    """'48MiB' -> 50331648; '1.5GB' -> 1500000000; a plain number is bytes. Raises ValueError on anything else."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"expected a size like 48MiB, 512KiB or 2GB, got {text!r}")
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n < 1:
        raise ValueError(f"expected a positive size, got {text!r}")
    return n


def fmt_bytes(n: float) -> str:
    return f"{n / 2 ** 20:.2f} MiB" if n >= 2 ** 20 else f"{n / 2 ** 10:.1f} KiB"


@dataclass(frozen=True)
class PeakPlan:
    """A sequence's planned peak: `cells` cells of `cell` bytes, the mirror's rows at that moment, the rows waiting
    for their statistic (at most `pending_tokens` tokens) and the query window."""

    budget: int
    cells: int
    cell: int
    mirror_cell: int
    pending: int
    queries: int
    prompt_moment: int = 0  # bytes at the prompt's last chunk (plan_peak), when more than the step's

    @property
    def kv(self) -> int:
        return self.cells * self.cell

    @property
    def buffers(self) -> int:
        return self.cells * self.mirror_cell + self.pending + self.queries

    @property
    def total(self) -> int:
        return max(self.kv + self.buffers, self.prompt_moment)

    def describe(self) -> str:
        at_prompt = (f"; {fmt_bytes(self.prompt_moment)} with the prompt's rows waiting"
                     if self.prompt_moment > self.kv + self.buffers else "")
        return (f"K = {self.budget} (peak {self.cells} cells: {fmt_bytes(self.kv)} of cells + "
                f"{fmt_bytes(self.buffers)} of policy buffers{at_prompt}; at most {fmt_bytes(self.total)})")


def peak_cells(policy, budget: int) -> int:
    """The most cells a sequence under `policy` holds at once in one-token steps (its prompt within what the budget
    protects): the policy's own `peak_cells` where it has one, else K + tau (K + tau - 1 between steps and the
    step's token, written before the eviction). `retention` feeds chunks of tau on the same grid (its first chunk
    ends where the cells reach K + tau), so the same holds there."""
    own = getattr(policy, "peak_cells", None)
    return own(budget) if own is not None else budget + policy.tau


def per_token_buffers(gm, policy, mirror_elem: int = 2, arriving_elem: int = 4) -> dict[str, int]:
    """Bytes a token takes in each policy buffer the llama.cpp engine keeps: the key/value mirror ("mirror", a cell's
    rows at `mirror_elem` bytes a value), hidden-state rows waiting to be scored ("hidden", float32) and arriving
    keys / values waiting for their statistic ("arriving", `arriving_elem` bytes a value: sequence.arriving_dtype);
    the query window's bytes in all ("queries")."""
    from .sequence import kv_plan

    obs = policy.observes(gm.depth)
    plan = kv_plan(obs, gm.n_layers)
    parts = [k for k in "kv" if k in obs.kv_parts] if plan["capture"] else []
    dims = {"k": gm.head_dim_k, "v": gm.head_dim_v}
    row = lambda layers, elem: sum(len(layers) * gm.n_head_kv * dims[p] * elem for p in parts)  # noqa: E731
    q_layers = sorted(obs.query_layers or range(gm.n_layers)) if obs.queries else []
    n_head = gm.n_embd // gm.head_dim_k if gm.head_dim_k else 0
    return {"mirror": row(plan["mirror"], mirror_elem),
            "arriving": row(plan["capture"], arriving_elem) if obs.arriving_kv else 0,
            "hidden": len(obs.hidden_layers) * gm.n_embd * 4,
            "queries": len(q_layers) * int(obs.queries) * n_head * gm.head_dim_k * 4}


def plan_peak(gm, policy, budget: int, type_k: str = "f16", type_v: str = "f16", *, step_tokens: int = 1,
              prompt_tokens: int | None = None, n_batch: int | None = None) -> PeakPlan:
    """The planned peak KV bytes of one sequence under `policy` at budget K, for these cell types: the larger of two
    moments,
    - a step at the peak: peak_cells x (cell + mirror row), the rows waiting to be scored or for their statistic, the
      queries. Rows wait until a flush: up to the recent window for the hidden-state policies, whose scoring is
      deferred (sequence.flush), at most sequence.ARRIVING_EVERY where arriving keys / values wait too, one step's
      for the others; `step_tokens` tokens arrive a step (1 when generating, the chunk where `retention` feeds
      chunks: retention.llamacpp.feed_chunk), so at most (flush interval - 1 + step_tokens) rows wait;
    - the prompt's last micro-batch: the prompt's cells with the mirror's rows, and its rows still waiting (every
      prompt row, or with `n_batch` (the prefill's micro-batch) at most flush interval - 1 + n_batch of them).
    The prompt is `prompt_tokens` long where the caller knows it (`retention` knows its traces), else the longest a
    budget protects (K - recent): what a server must plan for."""
    import numpy as np

    from .sequence import arriving_dtype, score_every

    mirror = mirror_dtype(type_k, type_v)
    b = per_token_buffers(gm, policy, mirror.itemsize, np.dtype(arriving_dtype(mirror)).itemsize)
    cell = cell_bytes(gm, type_k, type_v)
    cells = peak_cells(policy, budget)
    recent = policy.recent_window(budget)
    every = score_every(policy, recent, policy.observes(gm.depth))  # as the sequence flushes
    row = b["hidden"] + b["arriving"]
    p = max(1, budget - recent) if prompt_tokens is None else max(1, min(prompt_tokens, budget - recent))
    waiting = p if n_batch is None else min(p, every - 1 + n_batch)
    prompt = p * (cell + b["mirror"]) + waiting * row + b["queries"]
    return PeakPlan(budget, cells, cell, b["mirror"], (every - 1 + step_tokens) * row, b["queries"], prompt)


def budget_for_memory(gm, policy, memory: int, type_k: str = "f16", type_v: str = "f16", **how) -> PeakPlan:
    """The largest budget K whose planned peak (plan_peak) fits in `memory` bytes; refused in one line when not even
    K = 1 fits (a memory below one cell per layer, or below the policy's buffers). `how`: plan_peak's step_tokens,
    prompt_tokens and n_batch."""
    one = cell_bytes(gm, type_k, type_v)
    if memory < one:
        per_layer = one // max(gm.n_layers, 1)
        raise EpiKVError(f"--kv-memory {memory} bytes is below one {type_k}/{type_v} cell of {gm.name} "
                         f"({one} bytes: {per_layer} a layer x {gm.n_layers} layers)")
    plan = lambda k: plan_peak(gm, policy, k, type_k, type_v, **how)  # noqa: E731
    if plan(1).total > memory:
        raise EpiKVError(f"--kv-memory {fmt_bytes(memory)} holds no budget for {policy.name}: even K = 1 peaks at "
                         f"{fmt_bytes(plan(1).total)} ({plan(1).cells} cells and the policy's buffers)")
    lo, hi = 1, 2
    while plan(hi).total <= memory:  # the peak grows with K: double, then bisect
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if plan(mid).total <= memory else (lo, mid)
    return plan(lo)
