"""epikv with pages of 8, 16 and 32 slots under their own names, so one `epikv retention` run scores all of them
against one full-cache reference pass per trace (`--set epikv.page=B` in four runs would recompute the reference
each time). Each is exactly `get_policy("epikv", page=B)`: the class differs only in the default of `page`."""

from dataclasses import dataclass

from epikv.policies import register_policy
from epikv.policies.epikv import EpiKVFlat


@register_policy
@dataclass
class EpiKVPage8(EpiKVFlat):
    """epikv, evicting whole pages of 8 slots (= --set epikv.page=8)."""

    page: int = 8
    name = "epikv-page8"


@register_policy
@dataclass
class EpiKVPage16(EpiKVFlat):
    """epikv, evicting whole pages of 16 slots (= --set epikv.page=16)."""

    page: int = 16
    name = "epikv-page16"


@register_policy
@dataclass
class EpiKVPage32(EpiKVFlat):
    """epikv, evicting whole pages of 32 slots (= --set epikv.page=32)."""

    page: int = 32
    name = "epikv-page32"
