"""What a policy is shown: what it observes (`Observes`), what one forward pass showed it (`StepObservation`) and
the cache at eviction time (`CacheView`). Plain data, shared by the keep rules (base.py, pages.py) and the engines.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .._lazy import torch


@dataclass(frozen=True)
class Observes:
    """What a policy reads; the cache captures only this."""

    hidden_layers: tuple[int, ...] = ()
    """Outputs of these decoder blocks (hidden_states[l + 1] in HF terms)."""
    attention_layers: tuple[int, ...] = ()
    """Softmax attention weights of these layers (forces eager attention)."""
    keys_values: bool = False
    """The cached keys / values at eviction time (and, in the torch engine, in on_tokens: every stored slot)."""
    kv_layers: tuple[int, ...] | None = None
    """With keys_values: the layers whose cached keys / values the keep rule reads (None: every layer; (): none, the
    policy takes its statistics on arrival and needs keys_values only to keep the cache in true order). The torch
    engine's view lists every layer anyway (views of its cache); the engines that copy keys (llama.cpp's mirror, the
    paged server's gather) hold only these and put None at every other layer of CacheView.keys / values."""
    arriving_kv: bool = False
    """The keys / values of the tokens just written, in on_tokens only: a statistic taken on arrival (keys and
    values never change once cached), so the cache may still refill its holes at eviction (see EpiKVCache). With
    keys_values too, on_tokens is handed every layer with the new tokens last (the torch engine: every stored slot;
    the engines that copy: the new ones only), so read `x[:, :, -T:]`."""
    queries: int = 0
    """The last w rotated query states per layer, recomputed from q_proj (main attention stays SDPA)."""
    query_layers: tuple[int, ...] = ()
    """The layers whose queries are recomputed; () = every layer."""
    pre_rope: bool = False
    """With queries: take them BEFORE the rotary embedding (as q_proj + q_norm leave them), and have the view carry
    the model's RoPE frequencies (CacheView.rope_inv_freq): what a score that rotates a query itself reads."""
    kv_parts: str = "kv"
    """With keys_values / arriving_kv: which of the keys ("k") and values ("v") the policy reads. The torch engine
    holds both anyway; the llama.cpp engine captures (and mirrors) only these."""

    def describe(self) -> str:
        parts = []
        if self.hidden_layers:
            parts.append("hidden states at blocks " + ",".join(map(str, self.hidden_layers)))
        if self.attention_layers:
            parts.append(f"attention weights at {len(self.attention_layers)} layers")
        what = {"k": "keys", "v": "values"}.get(self.kv_parts, "keys/values")
        if self.keys_values and self.kv_layers != ():
            where = (" at blocks " + ",".join(map(str, self.kv_layers))) if self.kv_layers else ""
            parts.append(f"cached {what}{where}")
        if self.arriving_kv:
            parts.append(f"{what} on arrival")
        if self.queries:
            where = (" at blocks " + ",".join(map(str, self.query_layers))) if self.query_layers else ""
            kind = "pre-RoPE query states" if self.pre_rope else "query states"
            parts.append(f"last {self.queries} {kind}{where} (recomputed)")
        return "; ".join(parts) or "nothing"


@functools.lru_cache(maxsize=64)
def _index(at: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor(at, dtype=torch.long)


class HiddenStack(Mapping):
    """StepObservation.hidden backed by one tensor: block -> [batch, T, dim] views of `stacked` [batch, blocks, T,
    dim] (blocks in `blocks` order). The llama.cpp engine captures every block it reads into one buffer, so it hands
    the policy one array rather than a tensor per block; a policy that reads many blocks takes them with `layers`
    in one gather instead of stacking one view per block (policies/learned.py)."""

    def __init__(self, blocks: list[int], stacked: torch.Tensor) -> None:
        self.blocks, self.stacked = list(blocks), stacked
        self._at = {b: j for j, b in enumerate(self.blocks)}

    def __getitem__(self, block: int) -> torch.Tensor:
        return self.stacked[:, self._at[block]]

    def __iter__(self):
        return iter(self.blocks)

    def __len__(self) -> int:
        return len(self.blocks)

    def layers(self, blocks: Sequence[int]) -> torch.Tensor:
        """[batch, len(blocks), T, dim]: torch.stack([self[b] for b in blocks], dim=1) in one gather."""
        at = tuple(self._at[b] for b in blocks)
        return self.stacked.index_select(1, _index(at).to(self.stacked.device))


@dataclass
class StepObservation:
    """What one forward pass over T new tokens showed the policy."""

    hidden: Mapping[int, torch.Tensor]
    """Block -> [batch, T, dim] (on that block's device): a dict, or a HiddenStack."""
    attentions: dict[int, torch.Tensor]
    """Layer -> [batch, heads, T, kv_len]."""
    valid: torch.Tensor
    """[batch, T] bool: real tokens (False for left padding)."""
    positions: torch.Tensor
    """[batch, T] true positions."""
    stored: dict[str, torch.Tensor] = field(default_factory=dict)
    """Token data of the tokens stored before this step ([batch, ..., n_old]); a policy may return a key with n_old
    + T entries to replace it (e.g. attention accumulated onto old tokens) instead of n_new to append."""
    n_protect: torch.Tensor | None = None
    """[batch] protected real tokens (the prompt when it is protected)."""
    in_prompt: torch.Tensor | None = None
    """[batch, T] bool: tokens of the first prompt (None: no prompt tokens)."""
    kv_heads: int = 0
    """KV heads per layer (per-head token data is [batch, layers, kv_heads, n])."""
    keys: list[torch.Tensor] = field(default_factory=list)
    """Observes.keys_values: per layer the stored keys / values [batch, kv_heads, n_old + T, head_dim], the T new
    tokens last (views, do not modify): what a score computed at arrival reads. On a hybrid model only its
    full-attention layers are listed (sliding-window layers hold their window, are never evicted).
    Observes.arriving_kv alone: the T new tokens only, [batch, kv_heads, T, head_dim] (the stored slots may be out
    of true order then)."""
    values: list[torch.Tensor] = field(default_factory=list)
    """The values, as `keys`."""


@dataclass
class CacheView:
    """The cache as a policy sees it at eviction time."""

    length: int
    """Stored tokens per sequence (physical)."""
    budget: int
    """K: the tokens a sequence keeps after an eviction."""
    token_data: dict[str, torch.Tensor]
    """Per-token tensors aligned with the cache, [batch, ..., length]."""
    n_pad: torch.Tensor
    """[batch] left-padding slots at the front."""
    n_protect: torch.Tensor
    """[batch] protected real tokens right after the padding (prompt or sinks)."""
    recent: int
    """Protected newest tokens."""
    keys: list[torch.Tensor]
    """Per layer [batch, kv_heads, length, head_dim] (views, do not modify); a hybrid model's full-attention layers
    only (its sliding-window layers are never evicted)."""
    values: list[torch.Tensor]
    """The values, as `keys`."""
    device: torch.device
    """Where the cache's per-token data lives."""
    queries: list[torch.Tensor] = field(default_factory=list)
    """Observes.queries > 0: per layer the last w rotated queries [batch, heads, w, head_dim] (the newest last;
    None for a layer outside Observes.query_layers) and which of them are real tokens [batch, w]."""
    query_valid: torch.Tensor | None = None
    """[batch, w] bool: which of `queries` are real tokens."""
    rope_inv_freq: torch.Tensor | None = None
    """Observes.pre_rope: the rotary embedding's inverse frequencies [head_dim // 2] (channel f pairs with channel
    f + head_dim / 2, transformers' rotate_half layout)."""
    rope_scaling: float = 1.0
    """Observes.pre_rope: the factor the rotary embedding scales cos / sin by."""
