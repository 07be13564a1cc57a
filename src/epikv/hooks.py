"""What the evicting cache reads of a transformers model: its decoder blocks, which of them slide, the name of its
cache argument, and the forward hooks that capture hidden states, attention weights and rotated queries for the
policy, and open / close each forward of the stack (`cache.EpiKVCache` installs them)."""

from __future__ import annotations

import sys
from typing import Any

import torch

from .errors import EpiKVError
from .policies import Policy

def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder blocks of a causal LM (model.model.layers for Llama, Qwen2/3, Mistral ...)."""
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        raise EpiKVError(f"{type(model).__name__} has no decoder layers at model.model.layers: not a supported causal LM")
    return layers


def attention_layout(model, n_layers: int) -> tuple[frozenset[int], int | None]:
    """(the sliding-window layers, their window) from the model's config, as transformers reads it: `layer_types`
    ("sliding_attention" / "full_attention"), or without it every layer slides when the config has a sliding_window
    (Mistral v0.1). Any other kind of layer (linear attention, chunked attention ...) is refused."""
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    window = getattr(cfg, "sliding_window", None)
    if getattr(cfg, "use_sliding_window", True) is False:  # Qwen2's switch: the window size is kept but unused
        window = None
    types = list(getattr(cfg, "layer_types", None) or ["sliding_attention" if window else "full_attention"] * n_layers)
    other = sorted({t for t in types if t not in ("full_attention", "sliding_attention")})
    if other:
        raise EpiKVError(f"models with {', '.join(map(str, other))} layers are not supported (linear-attention and "
                         "other non-softmax layers hold no per-token cache to evict): only full and sliding-window "
                         "attention layers")
    sliding = frozenset(i for i, t in enumerate(types) if t == "sliding_attention")
    if len(types) != n_layers or (sliding and not (isinstance(window, int) and window >= 1)):
        raise EpiKVError(f"the model's config declares {len(types)} layer types for {n_layers} decoder layers "
                         f"and sliding_window={window!r}: cannot tell which layers slide")
    return sliding, (window if sliding else None)


def cache_kwarg(model) -> str:
    """transformers 5.x calls it `cache`; older versions `past_key_values`."""
    import inspect

    params = inspect.signature(type(model).forward).parameters  # the class's, robust to patched instances
    return "cache" if "cache" in params else "past_key_values"


def _ours(cache) -> bool:
    """Whether a forward's cache is an EpiKVCache (the class says so: this module sits below it)."""
    return getattr(type(cache), "EPIKV_HOOKED", False)


def _cache_from(kwargs: dict) -> Any:
    c = kwargs.get("cache")
    return c if c is not None else kwargs.get("past_key_values")


def _hidden_hook(layer_idx: int):
    def hook(module, args, kwargs, output):
        cache = _cache_from(kwargs)
        if _ours(cache) and layer_idx in cache._capture_hidden:
            cache._hidden[layer_idx] = output[0] if isinstance(output, tuple) else output

    return hook


def _attention_hook(layer_idx: int):
    def hook(module, args, kwargs, output):
        cache = _cache_from(kwargs)
        if _ours(cache) and layer_idx in cache._capture_attn:
            weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
            if weights is None:
                raise EpiKVError(f"{cache.policy.name} needs attention weights, but layer {layer_idx} returned none: "
                                 "it needs eager attention")
            cache._attn[layer_idx] = weights

    return hook


def _query_hook(layer_idx: int):
    """Recompute the rotated queries of the newest tokens from q_proj (+ q_norm) and the rotary embedding the
    layer receives (not rotated when the policy observes pre_rope), keeping a rolling window of w per layer: R-KV / SnapKV score with the queries they cache,
    so the main attention can stay SDPA."""

    def hook(module, args, kwargs):
        cache = _cache_from(kwargs)
        if not (_ours(cache) and cache._n_queries and layer_idx in cache._query_layers):
            return
        w = cache._n_queries
        h = kwargs.get("hidden_states", args[0] if args else None)[:, -w:]  # [batch, t, hidden]
        cos, sin = kwargs["position_embeddings"]
        # Observes.pre_rope: the policy rotates them itself
        q = rotated_queries(module, h, cos[:, -h.shape[1]:], sin[:, -h.shape[1]:], rotate=not cache._queries_pre_rope)
        old = cache._queries.get(layer_idx)
        cache._queries[layer_idx] = q if old is None else torch.cat([old, q], dim=2)[:, :, -w:]
        cache._queries_fresh.add(layer_idx)

    return hook


def rotated_queries(module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    rotate: bool = True) -> torch.Tensor:
    """The rotated queries an attention module computes from its input h [batch, t, hidden] (q_proj, q_norm when it
    has one, RoPE with the cos / sin [batch, t, rot] it receives): [batch, heads, t, head_dim]. Shared by the torch
    cache's query hook and the paged server's, so both engines rank with the same queries. rotate=False: before
    the rotary embedding (Observes.pre_rope)."""
    q = module.q_proj(h).view(*h.shape[:-1], -1, module.head_dim)
    if getattr(module, "q_norm", None) is not None:
        q = module.q_norm(q)
    q = q.transpose(1, 2)  # [batch, heads, t, head_dim]
    if not rotate:
        return q
    rope = getattr(sys.modules[type(module).__module__], "apply_rotary_pos_emb", _llama_rope)
    q, _ = rope(q, q, cos, sin)
    return q


def _llama_rope(q, k, cos, sin):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    return apply_rotary_pos_emb(q, k, cos, sin)


def _before_stack_hook(module, args, kwargs):
    cache = _cache_from(kwargs)
    if _ours(cache):
        return args, cache._before_forward(args, kwargs)
    return None


def _after_stack_hook(module, args, kwargs, output):
    cache = _cache_from(kwargs)
    if _ours(cache):
        cache._after_forward()


def _install_hook(module: torch.nn.Module, key: str, hook) -> None:
    """One hook per module and purpose, installed once; it finds the active cache in the call's kwargs, so hooks
    hold no reference to any cache and stay inert for other caches or plain calls."""
    handles = module.__dict__.setdefault("_epikv_hooks", {})
    if key not in handles:
        if key in ("query", "before"):  # runs before the module, on its inputs
            handles[key] = module.register_forward_pre_hook(hook, with_kwargs=True)
        else:
            handles[key] = module.register_forward_hook(hook, with_kwargs=True)


def _check_hybrid_policy(policy: Policy, obs, n_layers: int) -> None:
    """On a model mixing sliding-window and full-attention layers only the full-attention layers are evicted, with one
    keep set per sequence. Policies whose data is defined layer by layer over the cached keys (per-head or per-layer
    keep sets, attention weights, recomputed queries paired with a layer's keys) would meet sliding layers that hold
    only their window: refused rather than silently computed on a subset of layers."""
    why = None
    if policy.granularity != "token":
        why = f"keeps a separate token set per {policy.granularity}"
    elif obs.attention_layers:
        why = "reads attention weights"
    elif obs.queries:
        why = "reads recomputed query states"
    elif policy.evicts and policy.uncompressed_layers(n_layers):
        why = "leaves some layers uncompressed"
    if why:
        raise EpiKVError(f"policy {policy.name} {why}, which is not supported on models with sliding-window layers "
                         "(only token-level policies reading hidden states or cached keys/values are)")


def rope_frequencies(model, head_dim: int, policy_name: str) -> tuple[torch.Tensor, float]:
    """The rotary embedding's inverse frequencies [head_dim // 2] and cos / sin scale, for a policy that rotates
    queries itself (Observes.pre_rope); refused in one line where the model has no such embedding or rotates only
    part of a head (the policy's rotation would then differ from the model's)."""
    base = getattr(model, "model", model)
    rot = getattr(base, "rotary_emb", None)
    inv = getattr(rot, "inv_freq", None)
    if not isinstance(inv, torch.Tensor):
        raise EpiKVError(f"policy {policy_name} rotates query states itself and needs the model's rotary embedding "
                         "(model.model.rotary_emb.inv_freq), which this model lacks")
    if 2 * inv.numel() != head_dim:
        raise EpiKVError(f"policy {policy_name} rotates whole query heads, but this model's rotary embedding covers "
                         f"{2 * inv.numel()} of {head_dim} channels per head (partial rotary is not supported)")
    return inv, float(getattr(rot, "attention_scaling", 1.0) or 1.0)
