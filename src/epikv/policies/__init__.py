"""The policy registry: one policy per file, looked up by name."""

from __future__ import annotations

import dataclasses

from ..errors import EpiKVError
from .base import CacheView, Observes, Policy, StepObservation, select_keep
from .epikv import EpiKVFlat
from .epikv_a import EpiKVBandA
from .epikv_band import EpiKVBand
from .epikv_raw import EpiKVRaw
from .epikv_seg import EpiKVSeg
from .epikv_seg_q import EpiKVSegQ
from .full import FullCache
from .kv_var import KVKeyVariance, KVValueVariance
from .lag_kv import LagKVVariant
from .lag_kv_key import LagKVKey
from .random_eviction import RandomEviction
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

REGISTRY: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (EpiKVFlat, EpiKVRaw, EpiKVBandA, EpiKVBand, LagKVVariant, EpiKVSeg, EpiKVSegQ, KVKeyVariance,
                KVValueVariance, LagKVKey, FullCache, StreamingLLM, RandomEviction,
                H2O, H2OGlobal, TOVA, SnapKV, RKV, RaaS, ThinKV, LagKV, KeyDiff, KNorm)
}


def policy_names() -> list[str]:
    return list(REGISTRY)


def get_policy(name: str | Policy, **settings) -> Policy:
    """A policy instance by name, with settings overriding its defaults (None values are ignored)."""
    if isinstance(name, Policy):
        return dataclasses.replace(name, **{k: v for k, v in settings.items() if v is not None}) if settings else name
    cls = REGISTRY.get(name)
    if cls is None:
        raise EpiKVError(f"unknown policy {name!r}; known: {', '.join(REGISTRY)}")
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(k for k, v in settings.items() if v is not None and k not in fields)
    if unknown:
        raise EpiKVError(f"policy {name!r} has no setting {', '.join(unknown)}; its settings: {', '.join(sorted(fields))}")
    return cls(**{k: v for k, v in settings.items() if v is not None})


__all__ = ["REGISTRY", "CacheView", "Observes", "Policy", "StepObservation", "get_policy", "policy_names", "select_keep"]
