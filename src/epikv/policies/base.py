"""What every policy shares: eviction settings, what it observes, and the keep-set rule.

A policy is a small dataclass (its hyper-parameters are fields) plus pure tensor code. It never touches the model:
the cache captures exactly what `observes()` declares and hands it over.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from .._lazy import torch

from ..errors import EpiKVError
from .pages import page_keep, page_overflow
from .view import CacheView, Observes, StepObservation


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
    ages: ClassVar[bool] = False
    """True where a token's rank changes with its age after arrival (a decayed or age-penalised score): its score on
    arrival is then not what it is ranked by, and `epikv trace` shows its keep set instead."""
    evicts: ClassVar[bool] = True
    """False for `full`, which keeps every token."""
    renumbers_positions: ClassVar[bool] = False
    """True for a policy whose evictions renumber the survivors' positions (context-shift): only the llama.cpp engine
    runs it (llama_memory_seq_add re-rotates its cached keys); every other engine keeps true positions."""
    own_page_rule: ClassVar[bool] = False
    """A policy with its own keep rule that honours `page` itself (whole pages, e.g. EpiKV-Seg's page-level tier
    pass)."""

    signed: ClassVar[dict[str, int]] = {}
    """Fields that may go below zero, each with its least value (context-shift's n_keep = -1: the whole prompt)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in self.signed and isinstance(v, int) and v < self.signed[f.name]:
                raise EpiKVError(f"{self.name}: {f.name} must be at least {self.signed[f.name]}, got {v}")
            if isinstance(v, bool) or v is None or f.name in self.signed:
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
            if self.protect_prompt:
                return (f"budget {budget} is smaller than what is protected: {prot} prompt + {recent} recent "
                        "tokens; raise the budget or shorten the prompt")
            return (f"budget {budget} is smaller than what is protected: {prot} sink tokens + {recent} recent "
                    "tokens; raise the budget or lower the recency window or n_sink")
        if self.page:  # whole pages: the pages they overlap must fit too (page_keep's own refusal, up front)
            return page_overflow(budget, self.page, prot, recent)
        return None

    def for_prompt(self, budget: int | None, recent: int, prompt_len: int) -> "Policy":
        """The policy a server runs for one prompt of prompt_len tokens: itself where its protected prompt and the
        recency window fit the budget; else the same policy with prompt protection off, as `--no-protect-prompt`
        (only the prompt's first n_sink tokens protected, the rest of the prompt evicted by score with the answer,
        its newest `recent` tokens kept by the recency window), so a long prompt (multi-turn chat, RAG) is served
        rather than refused. Its `protected_overflow` says whether even that fits (then nothing can)."""
        if not self.evicts or not self.protect_prompt or self.protected_overflow(budget, recent, prompt_len) is None:
            return self
        return dataclasses.replace(self, protect_prompt=False)

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
