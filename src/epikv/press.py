"""Press-style use: every `model.generate` inside a `with` block runs on a fresh evicting cache.

    with epikv.press(model, policy="epikv-seg-q", budget=1024) as p:
        out = model.generate(**inputs, max_new_tokens=512)            # or pipeline("text-generation", model=model)
    print(p.last_stats)                                               # evictions, max / final cache tokens

Nothing is copied from kvpress: the model's `generate` is wrapped on the instance for the duration of the block and
the wrapper hands the call a new `EpiKVCache` under the kwarg name this transformers version uses (`cache` or
`past_key_values`), unless the caller passed a cache of their own. The class is never touched, so other models are
unaffected, and the instance is restored on exit, also when the block raises.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

from .cache import EpiKVCache, cache_kwarg
from .engine import attention_for
from .policies import DEFAULT_POLICY, Policy, get_policy

_ABSENT = object()


class Press:
    """What `press` yields: its settings, how many generate calls it served, and the last call's cache statistics."""

    def __init__(self, model, policy: Policy, budget: int | None) -> None:
        self.model = model
        self.policy = policy
        self.budget = budget
        self.calls = 0  # generate calls that ran on a cache of this press
        self.last_stats: dict[str, Any] | None = None  # EpiKVCache.stats() of the latest such call

    def new_cache(self) -> EpiKVCache:
        return EpiKVCache(self.model, self.policy, self.budget)

    def __repr__(self) -> str:
        return f"Press(policy={self.policy.name!r}, budget={self.budget}, calls={self.calls})"


@contextlib.contextmanager
def press(model, policy: str | Policy = DEFAULT_POLICY, budget: int | None = 1024, tau: int | None = None,
          **policy_settings) -> Iterator[Press]:
    """Inside the block, `model.generate(...)` (and so a transformers text-generation pipeline built on this model)
    uses a fresh `EpiKVCache(model, policy, budget, tau, **policy_settings)` per call; a call that passes its own
    cache keeps it. Policies that read attention weights get eager attention for the call, as in `epikv.generate`.
    A policy object is used as it is (the same object for every call). Settings are checked on entry."""
    pol = get_policy(policy, tau=tau, **policy_settings)
    handle = Press(model, pol, budget)
    with attention_for(model, pol):
        handle.new_cache()  # refuse a bad budget, unsupported model or attention kernel before patching anything
    kw = cache_kwarg(model)
    before = model.__dict__.get("generate", _ABSENT)  # an instance attribute already (another press, a user patch)
    inner = model.generate

    @functools.wraps(inner)
    def generate(*args, **kwargs):
        if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
            return inner(*args, **kwargs)  # the caller's own cache (or an enclosing press's) wins
        with attention_for(model, pol):
            cache = handle.new_cache()
            kwargs[kw] = cache
            out = inner(*args, **kwargs)
        handle.calls += 1
        handle.last_stats = cache.stats()
        return out

    model.generate = generate
    try:
        yield handle
    finally:
        if before is _ABSENT:
            model.__dict__.pop("generate", None)  # the class's generate again
        else:
            model.generate = before


__all__ = ["Press", "press"]
