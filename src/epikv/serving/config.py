"""What `epikv serve` serves, as one typed value: `ServeConfig`.

The CLI (epikv.commands.serve) reads the options, refuses bad ones and fills in the defaults that depend on other
options (the policy by engine, its settings, the budget only for an evicting policy); everything below it (the
engine construction in serving/build.py, the Ray Serve deployment in serving/ray_serve.py) reads this dataclass,
never an argparse.Namespace. It is plain data (picklable), so Ray hands it to each replica as it is.

To add an option: a field here with its default, the flag in commands/serve.py, and the reader of the field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..models import DEFAULT_MODEL
from .guard import DEFAULT_MAX_REQUEST_BYTES


@dataclass(frozen=True)
class ServeConfig:
    # the model (torch: any `epikv.models.load_model` name; llama.cpp: smollm2 or a local .gguf)
    model: str = DEFAULT_MODEL
    device: str | None = None
    device_map: str | None = None
    dtype: str | None = None
    attn: str | None = None
    # eviction: the policy by name (the CLI resolves its default by engine), its settings, and the budget K (None: the
    # policy does not evict)
    policy: str = "full"
    settings: dict = field(default_factory=dict)
    budget: int | None = None
    tau: int | None = None
    recent: int | None = None
    # engine
    engine: str = "torch"  # "torch" | "llama.cpp"
    page: int = 16  # torch: tokens per page
    num_blocks: int | None = None  # torch: pages in the shared cache
    ctx: int | None = None  # llama.cpp: KV cells of the one context
    kv: str | None = None  # llama.cpp: "streams" | "unified" | None (the backend's default for the policy)
    sequences: int | None = None  # llama.cpp: sequences decoded at once
    flash_attn: bool | None = None  # llama.cpp: None = llama.cpp's choice
    cache_type_k: str = "f16"  # llama.cpp's cell types (a quantized V switches flash attention on)
    cache_type_v: str = "f16"
    kv_memory: int | None = None  # llama.cpp: a sequence's peak KV bytes; the budget is the largest that fits
    max_batch_tokens: int = 256
    threads: int | None = None
    # http
    host: str = "127.0.0.1"
    port: int = 8000
    max_tokens: int = 256
    reasoning_parser: str | None = None
    max_waiting: int | None = None
    request_timeout: float | None = None
    drain_timeout: float = 30.0
    log_level: str = "warning"
    served_model_names: tuple[str, ...] = ()  # the names a request may give, the first in answers; (): model
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # a larger body gets 413
    api_key: str | None = field(default=None, repr=False)  # the Bearer token /v1/ routes need; None: none
    # Ray Serve (--ray)
    ray: bool = False
    replicas: int | None = None
    min_replicas: int | None = None
    max_replicas: int | None = None
    ray_address: str | None = None
    ray_app_name: str | None = None  # None: a unique name is made when the server starts

    @property
    def served_names(self) -> tuple[str, ...]:
        return self.served_model_names or (self.model,)

    @property
    def evicts(self) -> bool:
        return self.budget is not None

    def replace(self, **changes) -> ServeConfig:
        return dataclasses.replace(self, **changes)
