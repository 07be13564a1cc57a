"""How epikv.serving finds a transformers continuous-batching internal it relies on, and the one error it raises when
one is missing or changed (shared by the up-front checks, checks.py, and the cache layouts, layout.py).
"""

from __future__ import annotations

import inspect

from ..errors import EpiKVError


class ServingUnsupported(EpiKVError):
    """This transformers version lacks (or changed) a continuous-batching internal epikv.serving relies on.
    `missing` names it."""

    def __init__(self, missing: str, why: str = "") -> None:
        self.missing = missing
        super().__init__(f"transformers' continuous batching here lacks {missing}{': ' + why if why else ''}; "
                         "serving with eviction needs the continuous-batching internals of transformers 5.17 or 5.25 "
                         "(the versions it is tested on)")


def need(obj, name: str, label: str):
    if not hasattr(obj, name):
        raise ServingUnsupported(f"{label}.{name}")
    return getattr(obj, name)


def params(fn, label: str, names: tuple[str, ...]) -> None:
    try:
        got = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        raise ServingUnsupported(label, "signature unreadable") from None
    for n in names:
        if n not in got:
            raise ServingUnsupported(f"{label}({n}=...)")
