"""EPIKV inside llama.cpp: one sequence decoded through llama-cpp-python's low-level API, its KV cache kept within
the budget by removing the policy's evicted tokens with `llama_memory_seq_rm`.

- The policy is the one the torch engine runs (epikv.policies): it is fed the captured block outputs (and, for the
  policies that read them, the rotated queries, keys and values: capture.py) through `on_tokens` and chooses with
  its own `keep` (the shared `select_keep` rule, or its own) over a mirror of the cache held here: the true position
  and per-token data of every cached token, in chronological order, and the cached keys / values it reads.
- Eviction removes runs of positions from the sequence. Every other cell keeps its position and its key, rotated
  when it was written, so kept tokens keep their true positions and new tokens continue at seen + 1. The newest
  token is never removed (llama.cpp requires the next token to follow the sequence's highest position): such a
  keep set is refused before llama.cpp sees it. After each eviction the mirror is checked against the cache's
  `seq_pos_min` / `seq_pos_max`.
- One unified KV stream (kv_unified): freed cells serve any sequence, and a micro-batch's rows are its tokens in
  batch order, which the capture relies on. The context holds budget + tau cells (prompt chunk included) for an
  evicting policy, so freed cells are reused and attention spans about K cells; `full` gets the whole generation.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Iterable, Sequence

import numpy as np
import torch

from ..errors import EpiKVError
from ..interrupts import interrupts_held
from ..policies import DEFAULT_POLICY, Policy, for_model, get_policy
from ..signals import check_layers
from . import lib
from .capture import BlockCapture
from .kvtypes import CACHE_TYPES, cell_bytes, check_type, mirror_dtype, resolve_flash_attn
from .model import GGUFModel
from .sequence import CellCounter, SequenceCache, kv_plan

# Policies llama.cpp runs: those that read hidden states or positions, and those that read rotated queries, cached
# keys/values or the keys/values of arriving tokens (captured from the graph: Qcur / Kcur / Vcur, with a key/value
# mirror); the others are refused with their reason (check_policy).
SUPPORTED = ("epikv", "epikv-raw", "epikv-a", "epikv-band", "streaming", "random", "full",
             "epikv-seg", "epikv-seg-q", "kv-key", "kv-val", "lag-kv", "lag-kv-key", "epikv-learned-mean",
             "epikv-learned-decay", "epikv-learned-window", "epikv-learned-age", "context-shift")
"""The built-in policies llama.cpp runs (exactly those `check_policy` lets through: tests/test_llamacpp.py)."""

KV_TYPES = {name: t for name, (t, _, _) in CACHE_TYPES.items()}  # ggml_type of each cache type name
ROPE_TYPE_NORM = 0  # llama_rope_type: RoPE on adjacent channel pairs


def kv_types(type_kv: str = "f16", type_k: str | None = None, type_v: str | None = None) -> tuple[str, str]:
    """(K type, V type): type_k / type_v where given, else type_kv for both (checked: kvtypes.CACHE_TYPES)."""
    k, v = type_k or type_kv, type_v or type_kv
    check_type(k, "--cache-type-k")
    check_type(v, "--cache-type-v")
    return k, v


def check_policy(policy: Policy, n_layers: int) -> None:
    """Refuse, in one line naming the policy and why, what llama.cpp cannot feed or evict: attention weights are
    not readable (its attention kernels never expose them), and a cell holds a token of every layer and head, so
    keep sets per head or layer cannot be expressed. Query states and keys/values are captured from the graph."""
    obs = policy.observes(n_layers)
    why = None
    if obs.attention_layers:
        why = "reads attention weights, which llama.cpp's attention kernels never expose"
    elif policy.granularity != "token":
        why = f"keeps a separate token set per {policy.granularity}; a llama.cpp cell holds a token of every layer"
    elif policy.evicts and policy.uncompressed_layers(n_layers):
        why = "leaves some layers uncompressed; llama.cpp removes a token from every layer"
    elif obs.queries and obs.pre_rope:
        why = "reads query states before RoPE; the capture takes them rotated (Qcur)"
    if why:
        raise EpiKVError(f"policy {policy.name} is not supported by --engine llama.cpp: it {why} "
                         f"(supported: {', '.join(SUPPORTED)})")


def default_threads() -> int:
    """Half the cores available (at least one), as llama-cpp-python's own default: ggml's threads spin while they
    wait for each other, so more threads than free cores slows a step down many times over."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:
        n = os.cpu_count() or 1
    return max(1, n // 2)


def check_model_policy(gm: GGUFModel, policy: Policy) -> None:
    """check_policy, and for a policy with learned weights the weights fitted on this very model (its GGUF
    fingerprint: gguf_file.py), chosen or checked by the policy (policies/learned.py), else refused in one line."""
    check_policy(policy, gm.depth)
    if getattr(policy, "check_model", None) is not None:
        policy.check_model(gm.fingerprint, gm.depth)


def checked_policy(gm: GGUFModel, policy: str | Policy, budget: int | None, tau: int | None,
                   **policy_settings) -> tuple[Policy, list[int]]:
    """The policy and the blocks it reads, refused in one line where llama.cpp or this model cannot run it."""
    pol = get_policy(policy, tau=tau, **policy_settings)
    if pol.evicts:
        gm.check_evictable()  # a model that cannot evict at all is refused before any weights are looked for
    # the default (no policy named) falls back where this model cannot run it; a named policy is refused
    pol = for_model(pol, lambda p: check_model_policy(gm, p), tau=tau)
    if pol.evicts:
        if budget is None or isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise EpiKVError(f"budget must be a positive integer, got {budget!r}")
        if pol.recent_window(budget) < 1:
            raise EpiKVError("--engine llama.cpp keeps at least the newest token (its next token must follow the "
                             "sequence's highest position): the recent window must be >= 1")
    blocks = sorted(pol.observes(gm.depth).hidden_layers)
    check_layers(blocks, gm.n_layers)
    return pol, blocks


def attn_shape(gm: GGUFModel) -> tuple[int, int, int]:
    """(n_head, n_head_kv, head_dim) of the model: the rows of its Qcur / Kcur / Vcur nodes."""
    from .model import _meta

    ll = lib.load().ll
    n_head = int(ll.llama_model_n_head(gm.ptr))
    dim = _meta(ll, gm.ptr, f"{gm.arch}.attention.key_length")
    return n_head, gm.n_head_kv, int(dim) if dim else gm.n_embd // max(n_head, 1)


def attn_plan(gm: GGUFModel, policy: Policy) -> dict[str, list[int]]:
    """The layers whose rotated queries ("queries") and keys and values ("keys", "values") the capture copies for
    this policy: exactly what it observes, nothing for a policy that reads none."""
    obs = policy.observes(gm.depth)
    q = sorted(obs.query_layers or range(gm.n_layers)) if obs.queries else []
    if q:
        check_layers(q, gm.n_layers)
    kv = kv_plan(obs, gm.n_layers)["capture"]
    return {"queries": q, "keys": kv if "k" in obs.kv_parts else [], "values": kv if "v" in obs.kv_parts else []}



def all_outputs(gm: GGUFModel, blocks: list[int]) -> bool:
    """Whether every token must be a logits row: the last block keeps only the output rows otherwise."""
    return bool(blocks) and blocks[-1] == gm.n_layers - 1


def make_context(gm: GGUFModel, blocks: list[int], *, n_ctx: int, n_batch: int, n_seq_max: int, threads: int,
                 capture: str = "auto", type_kv: str = "f16", flash_attn: bool | None = None,
                 attn: dict[str, list[int]] | None = None, kv_unified: bool = True, type_k: str | None = None,
                 type_v: str | None = None):
    """A llama.cpp context with one unified KV stream of n_ctx cells (freed cells serve any sequence, and a
    micro-batch's rows are its tokens in batch order: n_ubatch = n_batch), and the capture of `blocks` (and of the
    queries / keys / values of `attn`'s layers, attn_plan) wired into its eval callback, probed (probe_context).
    Returns (ctx, capture or None, CellCounter or None); keep the capture alive as long as the context.

    kv_unified=False: one stream per sequence id instead (n_ctx / n_seq_max cells each, rounded up by llama.cpp to
    a multiple of 256: llama_n_ctx_seq); a sequence attends only to its own stream. llama.cpp then splits a batch
    with split_equal (LLAMACPP.md section 9): the caller must hand llama_decode batches that form one micro-batch in
    batch order (serving/llamacpp.py: consecutive increasing sequence ids, the same number of tokens each, grouped
    by sequence), or the captured rows are not the batch's.

    type_k / type_v: the cells' types (llama.cpp's names, kvtypes.CACHE_TYPES; type_kv sets both): a quantized V
    cache needs flash attention, switched on where flash_attn is None and refused in one line where it is False."""
    ll = lib.load().ll
    type_k, type_v = kv_types(type_kv, type_k, type_v)
    flash_attn, _ = resolve_flash_attn(gm, type_k, type_v, flash_attn)
    attn = {k: v for k, v in (attn or {}).items() if v}
    # Llama GGUFs hold q/k weights permuted for ggml's pairwise RoPE (transformers' GGUF loader undoes it)
    interleaved = gm.arch == "llama" and int(ll.llama_model_rope_type(gm.ptr)) == ROPE_TYPE_NORM
    cap = (BlockCapture(blocks, gm.n_embd, n_batch, capture, heads=attn_shape(gm) if attn else (0, 0, 0),
                        interleaved=interleaved, **attn) if blocks or attn else None)
    cp = ll.llama_context_default_params()
    cp.n_ctx = n_ctx
    cp.n_batch = cp.n_ubatch = n_batch  # one micro-batch a decode: rows in batch order
    cp.n_seq_max = n_seq_max
    cp.kv_unified = bool(kv_unified)
    cp.n_threads = cp.n_threads_batch = threads
    cp.type_k, cp.type_v = CACHE_TYPES[type_k][0], CACHE_TYPES[type_v][0]
    cp.flash_attn_type = (ll.LLAMA_FLASH_ATTN_TYPE_AUTO if flash_attn is None else
                          ll.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else ll.LLAMA_FLASH_ATTN_TYPE_DISABLED)
    cp.no_perf = True
    if cap is not None:
        cp.cb_eval = cap.cb
        cp.cb_eval_user_data = cap.user_data
    ctx = ll.llama_init_from_model(gm.ptr, cp)
    if not ctx:
        raise EpiKVError(f"llama.cpp could not create a context of {n_ctx} cells for {gm.name}"
                         + (f" with {type_k} keys and {type_v} values" if (type_k, type_v) != ("f16", "f16") else ""))
    try:
        cells = probe_context(gm, ctx, cap)
    except BaseException:
        ll.llama_free(ctx)
        raise
    return ctx, cap, cells


def probe_context(gm: GGUFModel, ctx, cap: BlockCapture | None) -> CellCounter | None:
    """Two one-token decodes on sequence 0 of a new context, then the cache cleared: a model whose graph the
    capture cannot read is refused here, in one line, rather than on a first request; and the two state sizes
    calibrate the exact cell count (CellCounter; None where the state does not grow by cell: a recurrent model)."""
    ll = lib.load().ll
    mem = ll.llama_get_memory(ctx)
    bos = gm.tokenizer.bos_token_id
    tok = bos if 0 <= bos < gm.tokenizer.n_vocab else 0
    b = ll.llama_batch_init(1, 0, 1)
    sizes = []
    try:
        for pos in (0, 1):
            b.n_tokens = 1
            b.token[0], b.pos[0], b.n_seq_id[0], b.logits[0] = tok, pos, 1, 1
            b.seq_id[0][0] = 0
            with interrupts_held():  # as a step (LlamaDecoder._feed)
                if cap is not None:
                    cap.reset()
                rc = ll.llama_decode(ctx, b)
                if rc != 0:
                    raise EpiKVError(f"llama.cpp's probe decode on {gm.name} failed with status {rc}")
                if cap is not None:  # every node the policy reads is in this model's graph, of the expected shape
                    cap.rows(1)
                    if cap.attn_nodes:
                        cap.attn_rows(1)
            sizes.append(int(ll.llama_state_seq_get_size(ctx, 0)))
    finally:
        ll.llama_batch_free(b)
        ll.llama_memory_clear(mem, True)  # empty, and the next slot search starts at cell 0 again
    per_cell = sizes[1] - sizes[0]
    return CellCounter(ctx, mem, sizes[0] - per_cell, per_cell) if per_cell > 0 and not gm.recurrent else None


class LlamaDecoder(SequenceCache):
    """One sequence in a llama.cpp context under a policy. `prefill(ids)` then `step(token)`; both return the next
    token's logits as a float32 array [n_vocab] (a copy).

    n_ctx: cells of the context (default: budget + tau + the largest feed, or prompt + max_new_tokens for `full`,
    which llama.cpp rounds up to 256). n_seq_max > 1 leaves sequences 1.. free for a caller (the tests build an
    oracle there). type_kv: the K and V cells' type (llama.cpp's names: kvtypes.CACHE_TYPES; "f16" its default),
    type_k / type_v each on its own; flash_attn None = llama.cpp's choice (on for a quantized V cache).
    """

    def __init__(self, gm: GGUFModel, policy: str | Policy = DEFAULT_POLICY, budget: int | None = 1024,
                 tau: int | None = None, *, max_tokens: int, threads: int | None = None, n_batch: int = 512,
                 n_ctx: int | None = None, n_seq_max: int = 1, capture: str = "auto", type_kv: str = "f16",
                 flash_attn: bool | None = None, type_k: str | None = None, type_v: str | None = None,
                 **policy_settings) -> None:
        pol, blocks = checked_policy(gm, policy, budget, tau, **policy_settings)
        ev = pol.evicts
        self.n_batch = max(1, min(n_batch, max_tokens))
        if n_ctx is None:
            n_ctx = max_tokens if not ev else min(max_tokens, budget + pol.tau - 1 + self.n_batch)
        self.ctx = None
        self._ll = lib.load().ll
        self.threads = threads or default_threads()
        self.ctx, self.capture, cells = make_context(gm, blocks, n_ctx=n_ctx, n_batch=self.n_batch,
                                                     n_seq_max=n_seq_max, threads=self.threads, capture=capture,
                                                     type_k=type_k or type_kv, type_v=type_v or type_kv,
                                                     flash_attn=flash_attn, attn=attn_plan(gm, pol))
        ll = lib.load().ll
        self.all_outputs = all_outputs(gm, blocks)
        self.n_ctx = int(ll.llama_n_ctx(self.ctx))
        self.batch = ll.llama_batch_init(self.n_batch, 0, 1)
        self.n_vocab = gm.tokenizer.n_vocab
        self.type_k, self.type_v = kv_types(type_kv, type_k, type_v)
        self.type_kv = type_kv
        self._init_sequence(ll, ll.llama_get_memory(self.ctx), 0, gm, pol, budget, blocks, cells,
                            mirror_dtype(self.type_k, self.type_v), cell_bytes(gm, self.type_k, self.type_v))
        self.mirror_cells = self.n_ctx  # the mirror holds as many cells as the context (its keys and values again)

    # -- feeding ------------------------------------------------------------------------------------------------------
    def prefill(self, ids: Sequence[int]) -> np.ndarray:
        ids = [int(t) for t in ids]
        self.start(len(ids))
        logits = None
        for s in range(0, len(ids), self.n_batch):
            logits = self._feed(ids[s : s + self.n_batch])
        return logits

    def step(self, token: int) -> np.ndarray:
        return self._feed([int(token)])

    def feed(self, ids: Sequence[int], all_logits: bool = False) -> np.ndarray:
        """Feed several tokens as one micro-batch (evicting after it, as a step does); the last token's logits
        [n_vocab], or every token's [T, n_vocab] with all_logits (teacher forcing: `epikv retention`)."""
        ids = [int(t) for t in ids]
        if not ids or len(ids) > self.n_batch:
            raise EpiKVError(f"feed takes 1 to {self.n_batch} tokens (the micro-batch), got {len(ids)}")
        return self._feed(ids, all_logits)

    def _feed(self, toks: list[int], all_logits: bool = False) -> np.ndarray:
        ll, b = self._ll, self.batch
        t = len(toks)
        if self.stored() + t > self.n_ctx:
            raise EpiKVError(f"the llama.cpp context holds {self.n_ctx} cells and {self.stored()} are in use: "
                             f"{t} more do not fit")
        p0 = self.next_pos  # the seen count unless context-shift renumbered positions
        b.n_tokens = t
        for j, tok in enumerate(toks):
            b.token[j] = tok
            b.pos[j] = p0 + j
            b.n_seq_id[j] = 1
            b.seq_id[j][0] = self.seq
            b.logits[j] = 1 if (all_logits or self.all_outputs or j == t - 1) else 0
        cap = self.capture
        # Ctrl-C is held across the whole step and raised after it is recorded, whichever capture callback runs.
        # Unheld, Python runs the handler at its first bytecode after llama_decode returns (C callback, or none) and
        # the step is lost: llama.cpp holds a cell the sequence never recorded, and the next decode, at a position
        # it already has, fails. With the Python callback the handler would run at a callback's entry, before its
        # `try`, and the KeyboardInterrupt would escape into ctypes: ggml would skip the node or stop the graph.
        with interrupts_held():
            if cap is not None:
                cap.reset()
            rc = ll.llama_decode(self.ctx, b)
            if rc != 0:
                raise EpiKVError(f"llama_decode failed with status {rc} at position {p0} "
                                 f"({'no free KV cell' if rc == 1 else 'see llama.cpp log'})")
            if all_logits:  # every row is an output, in batch order
                logits = np.ctypeslib.as_array(ll.llama_get_logits(self.ctx), shape=(t, self.n_vocab)).copy()
            else:
                out = ll.llama_get_logits_ith(self.ctx, t - 1)
                logits = np.ctypeslib.as_array(out, shape=(self.n_vocab,)).copy()
            if cap is not None and cap.attn_nodes:
                self.attend(t, cap.attn_rows(t))
            self.record(t, cap.rows(t) if cap is not None and cap.blocks else None)
        return logits

    # -- lifetime -----------------------------------------------------------------------------------------------------
    def kv_bytes(self) -> int | None:
        """Bytes of the KV cache llama.cpp allocated for this context: n_ctx cells x every layer's K and V rows at
        the GGUF's own key / value lengths (None for a model without attention KV: a recurrent model's state is
        not a KV cache)."""
        per_cell = self.gm.kv_bytes_per_cell(self.type_k, self.type_v)
        return self.n_ctx * per_cell if per_cell > 0 and not self.gm.recurrent else None

    def close(self) -> None:
        if getattr(self, "ctx", None):
            self._ll.llama_batch_free(self.batch)
            self._ll.llama_free(self.ctx)
            self.ctx = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class _LoopDecoder:
    """A LlamaDecoder (one sequence) behind the interface of the shared decoding loop (epikv.engine.decode_loop):
    batch-of-one tensors in and out, statistics read from the mirror, every step's token read at once (the logits
    are on the host already)."""

    device = torch.device("cpu")
    host_sync = True

    def __init__(self, dec: LlamaDecoder) -> None:
        self.dec, self.policy, self.budget, self.tau = dec, dec.policy, dec.budget, dec.tau

    def prefill(self, ids: torch.Tensor, n_pad, chunk=None) -> torch.Tensor:
        return torch.from_numpy(self.dec.prefill(ids[0].tolist()))[None]  # [1, vocab]

    def step(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(self.dec.step(int(ids[0, 0])))[None]

    def cache_stats(self) -> dict:
        d = self.dec
        return {"max_cache_tokens": d.max_tokens, "final_cache_tokens": d.stored(), "evictions": d.evictions}


def generate(gm: GGUFModel, prompt: str | Sequence[int], *, policy: str | Policy = DEFAULT_POLICY, budget: int | None = 1024,
             tau: int | None = None, max_new_tokens: int = 256, sampling=None, stop: Iterable[str] = (),
             chat: bool = False, system: str | None = None, threads: int | None = None,
             on_step=None, seed: int | None = None, allow_beyond_context: bool = False, capture: str = "auto",
             type_kv: str = "f16", flash_attn: bool | None = None, type_k: str | None = None,
             type_v: str | None = None, **policy_settings):
    """Generate for one prompt with llama.cpp: the torch engine's own decoding loop (epikv.engine.decode_loop) over
    a LlamaDecoder, so the same result and statistics (plus the engine's own: threads, capture method, context
    cells and KV bytes)."""
    from ..engine import Sampling, check_context, decode_loop, encode_prompts

    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise EpiKVError(f"max new tokens must be a positive integer, got {max_new_tokens!r}")
    sampling = sampling or Sampling()
    seed = sampling.seed if seed is None else seed
    stop = [s for s in stop if s]
    tok = gm.tokenizer
    ids = encode_prompts(tok, [prompt], chat=chat, system=system)[0]
    pol = get_policy(policy, tau=tau, **policy_settings)
    # the default (no policy named) falls back where this model cannot run it; a named policy is refused
    pol = for_model(pol, lambda p: check_model_policy(gm, p), tau=tau)
    shim = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=gm.n_ctx_train or None))
    check_context(shim, pol, budget, len(ids), max_new_tokens, allow_beyond_context)
    # prompt chunks of at most 512 tokens, so an evicting context is about budget + prompt cells: freed cells are
    # then reused and attention spans about K cells (a larger context would spread the sequence over all of it)
    dec = LlamaDecoder(gm, pol, budget, max_tokens=len(ids) + max_new_tokens, threads=threads, capture=capture,
                       type_kv=type_kv, type_k=type_k, type_v=type_v, flash_attn=flash_attn,
                       n_batch=min(512, len(ids)))
    try:
        run = decode_loop(_LoopDecoder(dec), tok, torch.tensor([ids]), [0], sampling=sampling, seeds=[seed],
                          max_new_tokens=max_new_tokens, eos=tok.eog_ids(), stop=stop, pad_id=tok.pad_token_id,
                          on_step=on_step)
        fa, _ = resolve_flash_attn(gm, dec.type_k, dec.type_v, flash_attn)
        return run.result([len(ids)], [seed], engine="llama.cpp", threads=dec.threads,
                          flash_attn={None: "auto", True: "on", False: "off"}[fa],
                          capture=dec.capture.method if dec.capture else None, kv_cells=dec.n_ctx,
                          kv_bytes=dec.kv_bytes(), kv_mirror_bytes=dec.mirror_bytes(),
                          cache_type_k=dec.type_k, cache_type_v=dec.type_v, **dec.peak_report())
    finally:
        dec.close()
