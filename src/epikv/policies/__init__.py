"""The policy registry: one policy per file, looked up by name."""

from __future__ import annotations

import dataclasses
import re
import sys

from ..errors import EpiKVError
from .base import CacheView, Observes, Policy, StepObservation, select_keep
from .context_shift import ContextShift
from .epikv import EpiKVFlat
from .epikv_a import EpiKVBandA
from .epikv_band import EpiKVBand
from .epikv_raw import EpiKVRaw
from .epikv_seg import EpiKVSeg
from .epikv_seg_q import EpiKVSegQ
from .expected_attention import ExpectedAttention
from .full import FullCache
from .kv_var import KVKeyVariance, KVValueVariance
from .lag_kv import LagKVVariant
from .lag_kv_key import LagKVKey
from .learned import LearnedMean, LearnedScore
from .learned_age import LearnedAge
from .learned_decay import LearnedDecay
from .learned_window import LearnedWindow
from .random_eviction import RandomEviction
from .random_head import RandomHeadEviction
from .streaming import StreamingLLM
from .h2o import H2O
from .h2o_global import H2OGlobal
from .keydiff import KeyDiff
from .knorm import KNorm
from .lagkv import LagKV
from .raas import RaaS
from .rkv import RKV
from .snapkv import SnapKV
from .thinkv import ThinKV
from .tova import TOVA
from .triattention import TriAttention

REGISTRY: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (EpiKVFlat, EpiKVRaw, EpiKVBandA, EpiKVBand, LagKVVariant, EpiKVSeg, EpiKVSegQ, KVKeyVariance,
                KVValueVariance, LagKVKey, LearnedScore, LearnedMean, LearnedDecay, LearnedWindow, LearnedAge,
                FullCache, StreamingLLM, RandomEviction, ContextShift,
                RandomHeadEviction, H2O, H2OGlobal, TOVA, SnapKV, RKV, RaaS, ThinKV, LagKV, KeyDiff, KNorm,
                TriAttention, ExpectedAttention)
}
"""Every registered policy class by name (`register_policy` and users' plugins add to it)."""


# The default policy of every entry point (`epikv generate` / `eval`, `epikv.generate`, `EpiKVCache`, `press`,
# `Decoder`, llama.cpp's `generate` and `serve`): the per-token policy with the least answer-likelihood loss at
# K = 1,024 on whole reasoning traces through llama.cpp (benchmarks/whole_traces.py's RANK_BUDGETS; the order at
# K = 512 differs: docs/choosing.md prints both), among those the entry point runs (issue 57 item 4). Evidence:
# benchmarks/results/whole-traces/llamacpp/results.jsonl (the 28 shared R1 traces streamed to their end, answer-NLL
# increase against the same trace's whole cache), ranked by benchmarks/whole_traces.py and rendered in
# docs/choosing.md; tests/test_defaults.py fails when the constant and the ranking disagree. epikv-learned-decay reads
# the hidden state entering each layer (no attention weights, no q.K) through weights fitted per model by `epikv
# calibrate` (shipped for the embedded SmolLM2 and its GGUF); where none fit the model, FALLBACK_POLICY runs.
class DefaultName(str):
    """The default policy's name as an entry point receives it when its caller names none: equal to the plain name
    everywhere, but recognisable, so that an engine falls back (one warning line, `for_model`) where this model cannot
    run the default, while a policy the caller names (any plain string) is refused there instead."""

    __slots__ = ()


DEFAULT_POLICY = DefaultName("epikv-learned-decay")
"""The policy every entry point runs when none is named (where an entry point refuses it: ENTRY_DEFAULTS)."""
FALLBACK_POLICY = "streaming"
"""What runs, with one warning line, when no policy is named and the model cannot run DEFAULT_POLICY (learned weights
fitted on other models only, sliding-window layers): the best per-token policy of the whole-trace ranking that needs
no fitted weights and runs on every entry point and model, hybrid ones included (benchmarks/whole_traces.py;
tests/test_defaults.py)."""
# Entry points that refuse DEFAULT_POLICY (their check: epikv.support), each with the best measured policy it runs,
# from the same ranking. None today: every entry point runs epikv-learned-decay (the paged server at page granularity).
ENTRY_DEFAULTS: dict[str, str] = {}
"""Entry point (epikv.support.ENTRY_POINTS' keys) -> its own default, where it refuses DEFAULT_POLICY."""


def default_policy(entry: str | None = None) -> str:
    """The policy an entry point uses when none is named: DEFAULT_POLICY, or where that entry point refuses it the
    one in ENTRY_DEFAULTS (keys: epikv.support.ENTRY_POINTS' keys; None: the torch engine)."""
    return DefaultName(ENTRY_DEFAULTS[entry]) if entry in ENTRY_DEFAULTS else DEFAULT_POLICY


def policy_names() -> list[str]:
    """Every registered policy, users' plugins included (a plugin that fails to import is reported by get_policy)."""
    try:
        load_policy_plugins()
    except EpiKVError:
        pass
    return list(REGISTRY)


def policy_class(name: str) -> type[Policy]:
    """The registered class of a policy name, users' plugins loaded first when the name is not built in. A name
    found nowhere is "unknown policy"; if a plugin failed to load, that failure is the message (the policy may be
    the one it would have registered)."""
    cls = REGISTRY.get(name)
    if cls is None:
        try:
            load_policy_plugins()
        except EpiKVError as e:
            raise EpiKVError(f"{e} (so policy {name!r} is not registered)") from None
        cls = REGISTRY.get(name)
    if cls is None:
        raise EpiKVError(f"unknown policy {name!r}; known: {', '.join(REGISTRY)}")
    return cls


def get_policy(name: str | Policy, **settings) -> Policy:
    """A policy instance by name, with settings overriding its defaults (None values are ignored).

    A policy object is used as it is: the same object comes back, so whatever its caller attached to it stays. Its
    settings are its fields; a setting that differs from the object's field is refused rather than silently applied
    to a copy (set it on the object, e.g. `dataclasses.replace(policy, tau=4)`, or pass the policy by name)."""
    given = {k: v for k, v in settings.items() if v is not None}
    if isinstance(name, Policy):
        fields = {f.name for f in dataclasses.fields(name)}
        unknown = sorted(set(given) - fields)
        if unknown:
            raise EpiKVError(f"policy {name.name!r} has no setting {', '.join(unknown)}; its settings: "
                             f"{', '.join(sorted(fields))}")
        differ = {k: v for k, v in given.items() if not _same(getattr(name, k), v)}
        if differ:
            have = ", ".join(f"{k}={getattr(name, k)!r}" for k in differ)
            want = ", ".join(f"{k}={v!r}" for k, v in differ.items())
            raise EpiKVError(f"the policy object {name.name!r} has {have}, but {want} was asked: a policy object "
                             "keeps its own settings; set them on it (dataclasses.replace(policy, ...)) or pass "
                             "the policy by name")
        return name
    cls = policy_class(name)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(k for k in given if k not in fields)
    if unknown:
        raise EpiKVError(f"policy {name!r} has no setting {', '.join(unknown)}; its settings: {', '.join(sorted(fields))}")
    pol = cls(**given)
    if isinstance(name, DefaultName) and not set(given) - _ENGINE_SETTINGS:  # its own settings: the caller chose it
        pol.fallback = FALLBACK_POLICY  # not a setting: where this model cannot run the default (for_model)
    return pol


_ENGINE_SETTINGS = {f.name for f in dataclasses.fields(Policy)}  # tau, recent, page ...: every policy has them


def for_model(policy: Policy, check, build=None, **settings) -> Policy:
    """`check(policy)` raises EpiKVError (one line) where this model cannot run the policy (the engines' model checks:
    learned weights fitted on this model, ...). A policy built from DEFAULT_POLICY with no name given
    (get_policy(DEFAULT_POLICY)) then falls back to FALLBACK_POLICY, built by `build(name)` (default: get_policy with
    `settings`, e.g. tau), with one DefaultFallbackWarning; any other policy is refused with the check's error."""
    import warnings

    from ..errors import DefaultFallbackWarning

    try:
        check(policy)
        return policy
    except EpiKVError as e:
        fb = getattr(policy, "fallback", None)
        if fb is None:
            raise
        why = str(e)
    out = build(fb) if build is not None else get_policy(fb, **settings)
    check(out)
    warnings.warn(DefaultFallbackWarning(f"the default policy {policy.name} cannot run on this model ({why}): running "
                                         f"{fb} instead, the best measured policy that runs on any model "
                                         "(docs/choosing.md); --policy chooses another"), stacklevel=3)
    return out


def _same(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:  # e.g. tensors of other shapes
        return a is b


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")  # usable in comma-separated lists and POLICY.SETTING=VALUE


def register_policy(cls: type[Policy] | None = None, *, replace: bool = False):
    """Register a policy class under its `name`, so every entry point finds it by name: `generate(policy=...)`,
    `EpiKVCache`, `epikv.press`, and the CLI's `--policy` (via a plugin module, see `load_policy_plugins`).

    Use it as a decorator above `@dataclass`, or call it. The class must subclass `Policy`, be a dataclass whose
    fields all have defaults, set `name`, and implement `scores` if it evicts. A name already taken by another
    class is refused unless `replace=True` (re-running the same class definition, as in a notebook, replaces it)."""
    if cls is None:
        return lambda c: register_policy(c, replace=replace)
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise EpiKVError(f"register_policy expects a subclass of epikv.policies.Policy, got {cls!r}")
    what = f"policy class {cls.__qualname__}"
    if "__dataclass_fields__" not in cls.__dict__:
        raise EpiKVError(f"{what} must be a @dataclass (put @register_policy above @dataclass)")
    name = cls.name
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise EpiKVError(f"{what} needs a class attribute name = '...' (letters, digits, '-', '_'), got {name!r}")
    if cls.evicts and cls.scores is Policy.scores:
        raise EpiKVError(f"{what} evicts but does not implement scores(state, view)")
    try:
        cls()
    except Exception as e:  # the CLI and `epikv policies` build it from its defaults
        raise EpiKVError(f"{what} cannot be built from its defaults: {type(e).__name__}: {e}") from e
    old = REGISTRY.get(name)
    redefined = old is not None and (old.__module__, old.__qualname__) == (cls.__module__, cls.__qualname__)
    if old is not None and old is not cls and not (replace or redefined):
        raise EpiKVError(f"policy name {name!r} is taken by {old.__module__}.{old.__qualname__}: choose another "
                         "name, or pass replace=True")
    REGISTRY[name] = cls
    return cls


PLUGIN_GROUP = "epikv.policies"
_loaded_plugins: set[str] = set()


def load_policy_plugins() -> None:
    """Import the modules that register users' policies, each once per process: the entry points of group
    `epikv.policies` (a module, or a Policy class, which is registered) and the modules or .py files named in the
    environment variable EPIKV_POLICIES (comma-separated). This is how the CLI sees a user's policy."""
    import importlib
    import importlib.util
    import os
    from importlib.metadata import entry_points

    todo: list[tuple[str, object]] = [(f"entry point {ep.name} = {ep.value}", ep)
                                      for ep in entry_points(group=PLUGIN_GROUP)]
    todo += [(f"EPIKV_POLICIES entry {s.strip()!r}", s.strip())
             for s in os.environ.get("EPIKV_POLICIES", "").split(",") if s.strip()]
    for label, src in todo:
        if label in _loaded_plugins:
            continue
        try:
            if isinstance(src, str) and src.endswith(".py"):
                mod_name = "epikv_plugin_" + re.sub(r"\W", "_", os.path.abspath(src))
                spec = importlib.util.spec_from_file_location(mod_name, src)
                if spec is None or not os.path.isfile(src):
                    raise FileNotFoundError(f"no such file {src}")
                module = importlib.util.module_from_spec(spec)
                sys.modules[mod_name] = module  # dataclasses look their module up while the file runs
                try:
                    spec.loader.exec_module(module)
                except BaseException:
                    del sys.modules[mod_name]
                    raise
            elif isinstance(src, str):
                importlib.import_module(src)
            else:
                obj = src.load()
                if isinstance(obj, type) and issubclass(obj, Policy):
                    register_policy(obj)
        except Exception as e:
            msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise EpiKVError(f"could not load policy plugin ({label}): {type(e).__name__}: {msg}") from e
        _loaded_plugins.add(label)


__all__ = ["DEFAULT_POLICY", "FALLBACK_POLICY", "DefaultName", "for_model", "ENTRY_DEFAULTS", "REGISTRY", "CacheView", "default_policy", "Observes", "Policy", "StepObservation", "get_policy", "policy_class",
           "load_policy_plugins", "policy_names", "register_policy", "select_keep"]
