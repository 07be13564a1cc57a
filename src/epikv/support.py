"""Which policy runs on which entry point, asked of the engines' own refusal checks (nothing listed by hand).

Each entry point maps to a function `refusal(policy) -> str | None`: the one-line error the engine raises for that
policy (None: it runs). `docs/policies.md`'s policy x entry-point matrix is rendered from these (benchmarks/render.py,
drift-tested), and the default policy of each entry point (`epikv.policies.default_policy`) is checked against them
(tests/test_defaults.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .errors import EpiKVError

N_LAYERS = 32  # the depth a policy is asked about (its observed blocks scale with depth; refusals do not)


def _refusal(check: Callable[[], object]) -> str | None:
    try:
        check()
    except EpiKVError as e:
        return str(e)
    return None


def torch_refusal(policy) -> str | None:
    """`epikv.generate`, `EpiKVCache`, `epikv.press`, `epikv generate` on a full-attention transformers model: every
    registered policy runs (one that reads attention weights switches the model to eager attention); what the cache
    checks on construction is the policy's own layer choice."""
    from .policies.base import check_true_positions
    from .signals import check_layers

    def check():
        check_true_positions(policy)
        obs = policy.observes(N_LAYERS)
        check_layers(obs.hidden_layers, N_LAYERS)
        check_layers(obs.attention_layers, N_LAYERS)
        if policy.evicts and len(policy.uncompressed_layers(N_LAYERS)) >= N_LAYERS:
            raise EpiKVError(f"{policy.name}: at least one layer must be compressed")

    return _refusal(check)


def hybrid_refusal(policy) -> str | None:
    """The same, on a model mixing sliding-window and full-attention layers (Gemma-3, GPT-OSS, Ministral)."""
    from .hooks import _check_hybrid_policy
    from .policies.base import check_true_positions

    return _refusal(lambda: (check_true_positions(policy),
                             _check_hybrid_policy(policy, policy.observes(N_LAYERS), N_LAYERS)))


def serve_torch_refusal(policy) -> str | None:
    """`epikv serve` (transformers' continuous batching over a paged cache): the server's own policy check."""
    from .serving.checks import ServeSpec, build_policy

    return _refusal(lambda: build_policy(ServeSpec(policy=policy.name, settings=_settings(policy))))


def llamacpp_refusal(policy) -> str | None:
    """`epikv generate --engine llama.cpp`, `epikv.llamacpp.generate` and `epikv serve --engine llama.cpp` (whose
    backend takes its policy through the same check)."""
    from .llamacpp.engine import check_policy

    return _refusal(lambda: check_policy(policy, N_LAYERS))


def _settings(policy) -> dict:
    """The fields of a policy object that differ from its class's defaults (so a check built from the name sees them)."""
    import dataclasses

    base = type(policy)()
    return {f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)
            if f.name != "page" and getattr(policy, f.name) != getattr(base, f.name)}


@dataclass(frozen=True)
class EntryPoint:
    key: str  # the key of epikv.policies.ENTRY_DEFAULTS
    label: str  # the matrix's column heading
    refusal: Callable[[object], str | None]
    has_default: bool = True  # takes a policy with a default (the hybrid column is a kind of model, not an entry point)


ENTRY_POINTS: tuple[EntryPoint, ...] = (
    EntryPoint("torch", "`generate` / `EpiKVCache` / `press` (torch)", torch_refusal),
    EntryPoint("torch-hybrid", "the same on a sliding-window hybrid (Gemma-3, GPT-OSS)", hybrid_refusal, False),
    EntryPoint("serve-torch", "`serve` (torch, paged)", serve_torch_refusal),
    EntryPoint("llama.cpp", "`generate --engine llama.cpp`", llamacpp_refusal),
    EntryPoint("serve-llama.cpp", "`serve --engine llama.cpp`", llamacpp_refusal),
)


def entry_point(key: str) -> EntryPoint:
    for e in ENTRY_POINTS:
        if e.key == key:
            return e
    raise EpiKVError(f"unknown entry point {key!r}; known: {', '.join(e.key for e in ENTRY_POINTS)}")


def refusal(key: str, policy) -> str | None:
    """Why entry point `key` refuses `policy` (a name or a Policy), in the engine's own words; None if it runs it."""
    from .policies import get_policy

    return entry_point(key).refusal(get_policy(policy))


__all__ = ["ENTRY_POINTS", "EntryPoint", "entry_point", "refusal"]
