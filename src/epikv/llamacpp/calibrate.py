"""`epikv calibrate --engine llama.cpp`: calibrate's runs (calibrate.ModelRuns) through llama.cpp on a GGUF, so a
user fits epikv-learned's score and decay map on the very model file they serve, with no transformers checkpoint.

One decode of a whole text (one micro-batch, one sequence, positions 0 .. T-1, an empty cache) captures, per layer
l, the hidden state entering it (block feature_block(l)'s output, `l_out-<b>`, as the llama.cpp engine scores it),
the rotated queries and keys (`Qcur-<l>` / `Kcur-<l>` after RoPE) and the values (`Vcur-<l>`). llama.cpp's flash
attention never forms the attention weights, so they are recomputed from those: A = softmax(q . k / sqrt(head_dim))
over keys 0 .. j of query j, per query head, each query head reading its KV head (GQA), in float32. That is the
attention of the architectures in ARCHS; another scale (Gemma's query_pre_attn_scalar, soft-capping, ALiBi) would
give other weights, so the rest are refused in one line. W_o is the GGUF's `blk.<l>.attn_output.weight`,
de-quantized by gguf-py. The fit (calibrate.calibrate) is the transformers engine's, on these tensors; the file
records the GGUF's fingerprint (gguf_file.gguf_fingerprint), which `--engine llama.cpp` looks for.

How close this is to transformers' eager run of the same weights (activations at llama.cpp's precision, e.g. Q8
for a Q4 model): tests/test_llamacpp_calibrate.py compares the two runs' targets on the embedded SmolLM2.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from ..errors import EpiKVError
from ..interrupts import interrupts_held
from . import lib
from .model import GGUFModel

# architectures whose attention weights are softmax(q . k / sqrt(head_dim)) over the causal keys
ARCHS = ("llama", "mistral", "qwen2", "qwen3", "smollm3", "olmo2", "granite")


def recompute_attention(q: np.ndarray, k: np.ndarray) -> torch.Tensor:
    """Causal softmax attention weights [heads, T, T] (query j, key i) from rotated queries [T, heads, d] and keys
    [T, kv_heads, d], scaled by 1 / sqrt(d), each query head reading its KV head (heads // kv_heads per KV head)."""
    qt = torch.from_numpy(np.ascontiguousarray(q)).float().transpose(0, 1)  # [heads, T, d]
    kt = torch.from_numpy(np.ascontiguousarray(k)).float().transpose(0, 1)  # [kv_heads, T, d]
    h, t, d = qt.shape
    kt = kt.repeat_interleave(h // kt.shape[0], dim=0)  # [heads, T, d]
    scores = qt @ kt.transpose(1, 2) / math.sqrt(d)  # [heads, T(query), T(key)]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    return scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)


def output_weights(path: str | Path, n_layers: int) -> list[torch.Tensor]:
    """Each layer's W_o [hidden, heads * head_dim] (transformers' o_proj.weight layout), de-quantized to float32."""
    import gguf

    r = gguf.GGUFReader(str(path))
    by_name = {t.name: t for t in r.tensors}
    out = []
    for l in range(n_layers):
        t = by_name.get(f"blk.{l}.attn_output.weight")
        if t is None:
            raise EpiKVError(f"calibrate: {Path(path).name} has no blk.{l}.attn_output.weight (an attention output "
                             "projection per layer is needed for the kvzap target; --target mean does without)")
        w = gguf.quants.dequantize(t.data, t.tensor_type)  # [out, in] rows as ggml stores them
        out.append(torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).reshape(int(t.shape[1]),
                                                                                      int(t.shape[0])))
    return out


def gguf_runs(gm: GGUFModel, path: str | Path, max_tokens: int, threads: int, need_wo: bool = True):
    """calibrate.ModelRuns on a loaded GGUF (`path` its file): a context of max_tokens cells whose one micro-batch
    holds a whole text, capturing what calibrate needs. Refused in one line for an architecture not in ARCHS or a
    model without attention KV."""
    from ..calibrate import ModelRuns
    from ..policies.learned import feature_block
    from .engine import make_context
    from .gguf_file import gguf_fingerprint, gguf_signature, read_header

    if gm.arch not in ARCHS or gm.recurrent:
        raise EpiKVError(f"calibrate --engine llama.cpp: {gm.arch} models are not supported (attention is recomputed "
                         f"as softmax(q.k / sqrt(head_dim)), the attention of {', '.join(ARCHS)})")
    n = gm.n_layers
    blocks = sorted({feature_block(l) for l in range(n)})
    every = list(range(n))
    wo = output_weights(path, n) if need_wo else [torch.zeros(0)] * n
    state: dict = {}

    def context():
        if "ctx" not in state:  # made on the first text: a run whose texts are all done loads nothing more
            state["ctx"], state["cap"], _ = make_context(gm, blocks, n_ctx=max_tokens, n_batch=max_tokens,
                                                         n_seq_max=1, threads=threads,
                                                         attn={"queries": every, "keys": every, "values": every})
        return state["ctx"], state["cap"]

    def layers(ids: torch.Tensor) -> list[tuple]:
        toks = [int(t) for t in ids[0]]
        t = len(toks)
        ctx, cap = context()
        ll = lib.load().ll
        b = ll.llama_batch_init(t, 0, 1)
        try:
            b.n_tokens = t
            for j, tok in enumerate(toks):
                b.token[j], b.pos[j], b.n_seq_id[j], b.logits[j] = tok, j, 1, int(j == t - 1)
                b.seq_id[j][0] = 0
            with interrupts_held():  # a decode and its capture are read whole or not at all
                cap.reset()
                rc = ll.llama_decode(ctx, b)
                if rc != 0:
                    raise EpiKVError(f"calibrate: llama_decode failed with status {rc} on a text of {t} tokens")
                rows = {blk: r.copy() for blk, r in cap.rows(t).items()}  # block -> [T, dim]
                attn = cap.attn_rows(t)  # kind -> layer -> [T, heads, d]
                qkv = {kind: {l: np.array(attn[kind][l]) for l in every} for kind in "qkv"}
        finally:
            ll.llama_batch_free(b)
            ll.llama_memory_clear(ll.llama_get_memory(ctx), True)  # the next text starts at cell 0
        res = []
        for l in every:
            v = torch.from_numpy(qkv["v"][l]).float().transpose(0, 1)  # [kv_heads, T, hd]
            res.append((torch.from_numpy(rows[feature_block(l)]), recompute_attention(qkv["q"][l], qkv["k"][l]), v,
                        wo[l]))
        return res

    def close() -> None:
        if "ctx" in state:
            lib.load().ll.llama_free(state.pop("ctx"))

    return ModelRuns(gguf_signature(read_header(path)), gguf_fingerprint(path),
                     lambda text: gm.tokenizer.encode(text, True), layers, close)
