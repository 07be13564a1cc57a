"""A model's fingerprint: what learned weights are tied to (issue 57 item 2). Part of the transformers engine (it reads
the model's parameters); policies compare the strings only.

The fingerprint is the architecture and shapes of the text config (model type, layers, hidden size, attention and
KV heads, vocabulary) and a sha256 of a fixed sample of the weights: the first SAMPLE values of the input
embedding, of the first decoder layer's parameters and of the last one's (in parameter-name order), cast to
bfloat16 first so that loading the same checkpoint in float32, float16 or bfloat16 gives the same checksum (a
fine-tune moves enough of those values past a bfloat16 step to change it).
"""

from __future__ import annotations

import hashlib
import json

import torch

SAMPLE = 4096  # values taken from each sampled tensor
UNKNOWN = "unknown"  # the checksum of a model whose sampled weights are not in memory (offloaded)


def model_signature(model) -> dict:
    """The architecture and shapes of a model's text config."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return {"model_type": getattr(cfg, "model_type", "?"), "layers": cfg.num_hidden_layers,
            "hidden": cfg.hidden_size, "heads": cfg.num_attention_heads,
            "kv_heads": getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            "vocab": getattr(cfg, "vocab_size", None)}


def weights_checksum(model, layers) -> str:
    """sha256 (hex, first 16 digits) of the sampled weights, as bfloat16; layers: the model's decoder layers
    (cache.decoder_layers)."""
    tensors = [model.get_input_embeddings().weight]
    for layer in (layers[0], layers[-1]):
        tensors += [p for _, p in sorted(layer.named_parameters(), key=lambda kv: kv[0])]
    h = hashlib.sha256()
    with torch.no_grad():
        for t in tensors:
            if t.device.type == "meta":  # offloaded (device_map): no values to read; compared by shape alone
                return UNKNOWN
            flat = t.detach().reshape(-1)[:SAMPLE].to("cpu", torch.bfloat16)
            h.update(flat.view(torch.int16).numpy().tobytes())
    return h.hexdigest()[:16]


def model_fingerprint(model, layers) -> str:
    """'<signature as sorted JSON>|<weights checksum>': two models share it only with the same architecture, shapes
    and sampled weights. layers: the model's decoder layers (cache.decoder_layers)."""
    return json.dumps(model_signature(model), sort_keys=True) + "|" + weights_checksum(model, layers)
