from __future__ import annotations

from dataclasses import dataclass

from .._lazy import torch

from ..errors import EpiKVError
from .base import CacheView, Observes
from .epikv_seg import EpiKVSeg
from .hidden import default_pair

MODES = ("replace", "add")


def query_relevance(q: torch.Tensor, k: torch.Tensor, q_valid: torch.Tensor, pos: torch.Tensor,
                    n_pad: torch.Tensor) -> torch.Tensor:
    """Mean softmax(q K^T / sqrt(d)) of the last w queries over every stored slot, averaged over heads and queries.

    q: [batch, heads, w, dim] rotated queries, the newest last (the newest is the newest stored slot's token); k:
    [batch, kv_heads, n, dim] rotated keys of the same layer (repeated for GQA); q_valid: [batch, w] real queries;
    pos: [batch, n] true positions of the slots; n_pad: [batch]. Causal by true position (= by slot while the w
    query tokens are the newest w slots) and padding masked. Returns [batch, n]."""
    b, h, w, d = q.shape
    n, dev = k.shape[2], k.device
    k = k.float().repeat_interleave(h // k.shape[1], dim=1)  # [batch, heads, n, dim]: KV head of each query head
    logits = q.to(dev).float() @ k.transpose(-1, -2) / d**0.5  # [batch, heads, w, n]
    q_pos = pos[:, -1:] - (w - 1 - torch.arange(w, device=dev))  # [batch, w]
    hide = (pos[:, None, :] > q_pos[:, :, None]) | (torch.arange(n, device=dev) < n_pad[:, None])[:, None, :]
    att = logits.masked_fill(hide[:, None], float("-inf")).softmax(-1).nan_to_num()  # over all slots
    qv = q_valid.to(dev).float()  # [batch, w]
    return (att.mean(1) * qv[:, :, None]).sum(1) / qv.sum(-1).clamp(min=1)[:, None]


def zscore_over(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Per row z-score over the finite entries where mask (sample std); NaN elsewhere. x, mask: [batch, n]."""
    x = x.float()
    ok = mask & torch.isfinite(x)
    cnt = ok.sum(-1, keepdim=True)
    mean = torch.where(ok, x, 0.0).sum(-1, keepdim=True) / cnt.clamp(min=1)
    var = (torch.where(ok, x - mean, 0.0) ** 2).sum(-1, keepdim=True) / (cnt - 1).clamp(min=1)
    return torch.where(ok, (x - mean) / (var.sqrt() + eps), float("nan"))


@dataclass
class EpiKVSegQ(EpiKVSeg):
    """EpiKV-Seg-Q: EpiKV-Seg with fill, the "steps" tau = 128 rule, ranked by a query relevance at eviction.

    The authors' tag `kv_seg_hs_fill_tau128steps_qk_w8rep` (github stevenkolawole/epiphany-kv-cache, commit 121e62c;
    METHOD.md section 4). When an eviction fires: the last `queries` = 8 tokens' queries at block A+1 (recomputed from
    block A's output through block A+1's input layernorm, q_proj and RoPE at their true positions, as each token
    passed) against block A+1's cached keys (KV heads repeated for GQA), scaled 1/sqrt(head_dim), causal, softmax
    over every slot, averaged over heads and queries; z-scored over the decode slots (prompt excluded, recency window
    included; sample std + 1e-6). mode "replace" (shipped): that z-score ranks the tier pass, the fill and any swap;
    "add": z(HS score) + weight * z(relevance), both z-scored the same way. Reads q.K for 8 queries of one layer, so
    it is not attention-free, but no attention matrix is materialised: SDPA / FlashAttention stay on.

    Choices where METHOD.md leaves one open: the queries are recomputed by a pre-hook on block A+1's attention at
    every forward (one q_proj row per token; block A+1's attention input is exactly layernorm(block A's output),
    q_norm included on Qwen3), the relevance only at eviction; the causal mask is by true position, so it stays
    right when some of the 8 query tokens were evicted (recent < 8 or tau < 8); before 8 decode tokens exist the
    newest prompt tokens fill the window; the z-score spans every decode slot, recency window included.
    """

    rule: str = "steps"
    fill: bool = True
    queries: int = 8
    mode: str = "replace"
    weight: float = 1.0

    name = "epikv-seg-q"
    attention_free = False

    def __post_init__(self):
        super().__post_init__()
        if self.mode not in MODES:
            raise EpiKVError(f"{self.name}: mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.queries < 1:
            raise EpiKVError(f"{self.name}: queries must be at least 1, got {self.queries}")

    def query_layer(self, n_layers: int) -> int:
        a = self.layers[0] if self.layers is not None else default_pair(n_layers)[0]
        return a + 1

    def observes(self, n_layers):
        hidden = super().observes(n_layers).hidden_layers if self.mode == "add" else ()
        qa = self.query_layer(n_layers)
        # at eviction: the cached keys of block A+1 only (the segment statistic is taken on arrival, kv_stats)
        return Observes(hidden_layers=hidden, keys_values=True, kv_layers=(qa,), arriving_kv=True,
                        kv_parts="kv" if self.swap else "k", queries=self.queries, query_layers=(qa,))

    def init_state(self, batch, n_layers, device):
        state = super().init_state(batch, n_layers, device)
        # resolved once, from the Depth the engine passes (it names the architecture, so the authors' published
        # layers apply): the same block observes() declared, whose queries the engine captures. A count such as
        # len(view.keys) carries no architecture and would fall back to the depth-scaled block
        (state["_qa"],) = self.observes(n_layers).query_layers
        return state

    def on_tokens(self, state, obs):
        return super().on_tokens(state, obs) if self.mode == "add" else self.kv_stats(obs)

    def ranking(self, state, view: CacheView) -> torch.Tensor:
        dev = view.device
        qa = state["_qa"]
        rel = query_relevance(view.queries[qa], view.keys[qa].to(dev), view.query_valid, view.token_data["pos"],
                              view.n_pad)
        decode = torch.arange(view.length, device=dev) >= (view.n_pad + view.n_protect)[:, None]
        z = zscore_over(rel, decode)
        if self.mode == "add":
            z = zscore_over(view.token_data["score"].to(dev), decode) + self.weight * z
        return z
