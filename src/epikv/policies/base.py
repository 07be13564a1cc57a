"""What every policy shares: eviction settings, what it observes, and the keep-set rule.

A policy is a small dataclass (its hyper-parameters are fields) plus pure tensor code. It never touches the model:
the cache captures exactly what `observes()` declares and hands it over.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .._lazy import torch

from ..errors import EpiKVError
from .pages import page_keep, page_overflow


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


@dataclass
class StepObservation:
    """What one forward pass over T new tokens showed the policy."""

    hidden: dict[int, torch.Tensor]
    """Block -> [batch, T, dim] (on that block's device)."""
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


@dataclass
class Policy:
    """Base of every policy. Subclasses set the class attributes and override the hooks they need."""

    tau: int = 1
    """Evict when the cache exceeds budget + tau - 1 tokens; 1 = every step."""
    recent: int | None = None
    """Protected newest tokens; None = min(128, budget // 4)."""
    protect_prompt: bool = True
    """Else only the first n_sink tokens are protected."""
    n_sink: int = 4
    """Tokens protected at the start when protect_prompt is False."""
    page: int = 0
    """> 0: evict whole pages of this many slots, as a paged engine must (policies/pages.py); 0 = tokens."""

    name: ClassVar[str] = ""
    """The registry name (`--policy NAME`)."""
    paper: ClassVar[str] = ""
    """The paper the rule comes from."""
    attention_free: ClassVar[bool] = True
    """Reads no attention scores at all: neither attention weights nor query-key products it recomputes (one rule,
    checked for every registered policy against what it observes: tests/test_cli.py)."""
    granularity: ClassVar[str] = "token"
    """'token': one keep set per sequence; 'head': one per layer and KV head; 'layer': one per layer."""
    evicts: ClassVar[bool] = True
    """False for `full`, which keeps every token."""
    renumbers_positions: ClassVar[bool] = False
    """True for a policy whose evictions renumber the survivors' positions (context-shift): only the llama.cpp engine
    runs it (llama_memory_seq_add re-rotates its cached keys); every other engine keeps true positions."""
    own_page_rule: ClassVar[bool] = False
    """A policy with its own keep rule that honours `page` itself (whole pages, e.g. EpiKV-Seg's page-level tier
    pass)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or v is None:
                continue
            if isinstance(v, (int, float)) and v < 0:
                raise EpiKVError(f"{self.name}: {f.name} must not be negative, got {v}")
        if self.tau < 1:
            raise EpiKVError(f"tau must be at least 1, got {self.tau}")
        if self.page and (not self.evicts or self.granularity != "token" or not self.pages_ok()):
            why = ("never evicts" if not self.evicts else f"keeps per {self.granularity}"
                   if self.granularity != "token" else "has its own keep rule")
            raise EpiKVError(f"{self.name}: page-granular eviction (page={self.page}) needs a token-granularity "
                             f"policy with the default keep rule; {self.name} {why}")

    def pages_ok(self) -> bool:
        """Whether the keep rule evicts whole pages when `page` is set: the default rule (page_keep) or a policy's
        own rule that honours `page` (own_page_rule)."""
        return type(self).keep is Policy.keep or type(self).own_page_rule

    # -- declared observations -------------------------------------------------------------------------------------
    def observes(self, n_layers: int) -> Observes:
        return Observes()

    # -- hooks -----------------------------------------------------------------------------------------------------
    def init_state(self, batch: int, n_layers: int, device: torch.device) -> Any:
        """Fresh per-generation state (no state lives on the policy object itself).

        Rows contract (beam search, num_return_sequences, batch selection reorder the cache's rows): every tensor in
        the state whose dim 0 has the batch size is per-row and is reordered with the rows (found through dicts,
        lists, tuples, dataclasses and plain objects); keep row-independent tensors under a key or attribute that
        starts with an underscore, which is never reordered."""
        return None

    def on_tokens(self, state: Any, obs: StepObservation) -> dict[str, torch.Tensor]:
        """Called after each forward. Returns per-token tensors [batch, ..., T] to append to the cache's token data
        (e.g. {"score": ...}), which the cache keeps aligned with the stored tokens through every eviction."""
        return {}

    def scores(self, state: Any, view: CacheView) -> torch.Tensor:
        """Priority of each stored token, [batch, length] (token) or [batch, layers, kv_heads, length] (head).
        Higher is kept. Protection and padding are applied by `select_keep`, not here."""
        raise NotImplementedError

    # -- shared rule -----------------------------------------------------------------------------------------------
    def should_evict(self, length: int, budget: int, steps: int, decode_slots: int) -> bool:
        """Whether the cache evicts after this step. length: stored slots; steps: slots stored since the last
        eviction (since the prompt before the first); decode_slots: stored slots after the (padded) protected prefix.
        Host integers only (no device sync). Default: over budget + tau - 1, i.e. every tau steps once full."""
        return length > budget + self.tau - 1

    def keep(self, state: Any, view: CacheView) -> torch.Tensor:
        """The slots to keep, [batch, m] or [batch, layers, kv_heads, m], sorted, the same m for every row (tensors
        stay rectangular). Default: exactly `budget` by `scores`; a policy may keep fewer (EpiKV-Seg's caps)."""
        if self.page:
            return page_keep(self.scores(state, view), view, self.page)
        return select_keep(self.scores(state, view), view)

    def uncompressed_layers(self, n_layers: int) -> tuple[int, ...]:
        """Layers this policy never evicts from (they keep every token; only unpadded batches allow it)."""
        return ()

    def recent_window(self, budget: int) -> int:
        return min(128, budget // 4) if self.recent is None else self.recent

    def protected(self, prompt_len: int) -> int:
        """How many of a prompt's tokens are never evicted: all of them, or with protect_prompt off its first n_sink."""
        return prompt_len if self.protect_prompt else min(self.n_sink, prompt_len)

    def protected_overflow(self, budget: int | None, recent: int, prompt_len: int) -> str | None:
        """Why `budget` cannot hold the protected part of a prompt of `prompt_len` tokens plus the `recent` window
        (one line, the same wherever it is checked: the cache, the serving scheduler), or None when it can."""
        prot = self.protected(prompt_len)
        if budget is None:
            return None
        if prot + recent > budget:
            what = "prompt" if self.protect_prompt else "sink tokens"
            return (f"budget {budget} is smaller than what is protected: {prot} {what} + {recent} recent tokens; "
                    "raise the budget or shorten the prompt")
        if self.page:  # whole pages: the pages they overlap must fit too (page_keep's own refusal, up front)
            return page_overflow(budget, self.page, prot, recent)
        return None

    def describe(self, n_layers: int = 30) -> dict[str, Any]:
        """What `epikv policies` lists; `observes` for a model of n_layers blocks (30: the embedded SmolLM2), as
        the engine reads them on a model without the authors' published blocks."""
        defaults = {f.name: _jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)}
        obs = self.observes(n_layers)
        return {
            "name": self.name,
            "attention_free": self.attention_free,
            # eager attention with its weights, or the model's own kernel (SDPA / FlashAttention) untouched
            "attention_kernel": "eager" if obs.attention_layers else "model's own",
            "granularity": self.granularity,
            "observes": obs.describe() + f" (for a {n_layers}-block model)",
            "observes_32_blocks": self.observes(32).describe(),
            "defaults": defaults,
            "paper": self.paper,
            "doc": (type(self).__doc__ or "").strip().splitlines()[0],
        }


def _jsonable(v):
    if isinstance(v, tuple):
        return [_jsonable(x) for x in v]
    return v


WINDOW_OVER = ("decode", "all")


def check_window_over(policy: str, value: str) -> None:
    if value not in WINDOW_OVER:
        raise EpiKVError(f"{policy}: window_over must be one of {', '.join(WINDOW_OVER)}, got {value!r}")


def window_tokens(obs: StepObservation, window_over: str) -> torch.Tensor:
    """[batch, T] bool: the tokens of this step that enter a rolling window (all real ones, or only those after
    the prompt)."""
    if window_over == "all" or obs.in_prompt is None:
        return obs.valid
    return obs.valid & ~obs.in_prompt.to(obs.valid.device)


def pool_query_heads(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[batch, heads, ...] -> [batch, kv_heads, ...]: mean over the query heads that share a KV head (GQA)."""
    b, h = x.shape[:2]
    return x.reshape(b, kv_heads, h // kv_heads, *x.shape[2:]).mean(2)


def select_keep(priority: torch.Tensor, view: CacheView) -> torch.Tensor:
    """Keep exactly `budget` slots per sequence (per layer and head for head-level priorities), in chronological order.

    Layout of a stored row: [padding][protected prefix][evictable middle][recent window]. Padding goes first
    (kept only when a row has fewer real tokens than the budget), protected and recent tokens always stay, the
    middle competes by priority; equal priorities go to the newer slot. priority: [batch, length] or
    [batch, layers, heads, length].
    """
    n = view.length
    idx = torch.arange(n, device=priority.device)
    shape = (-1,) + (1,) * (priority.dim() - 1)
    n_pad = view.n_pad.to(priority.device).view(shape)
    n_prot = view.n_protect.to(priority.device).view(shape)
    is_pad = idx < n_pad
    protected = (~is_pad) & ((idx < n_pad + n_prot) | (idx >= n - view.recent))
    pr = torch.nan_to_num(priority.float(), nan=-3e38)  # a NaN score must never win a slot
    pr = pr.masked_fill(protected, float("inf")).masked_fill(is_pad, float("-inf"))
    # a stable sort, not topk: among equal priorities the newer slot wins (the newest padding first, as a prefix
    # of the real tokens), so a row keeps the same set whatever its batch mates (topk breaks ties differently by
    # batch shape; decode-only windows give every prompt token 0)
    keep = (n - 1) - pr.flip(-1).argsort(dim=-1, descending=True, stable=True)[..., : view.budget]
    return keep.sort(dim=-1).values


def check_true_positions(policy) -> None:
    """Refuse, in one line, a policy that renumbers cached positions on an engine that keeps true ones (torch)."""
    if getattr(policy, "renumbers_positions", False):
        raise EpiKVError(f"policy {policy.name} renumbers the cached tokens' positions (llama.cpp's context shift, "
                         "which re-rotates cached keys with llama_memory_seq_add); the torch engine keeps every token "
                         "at its true position: run it with --engine llama.cpp")
