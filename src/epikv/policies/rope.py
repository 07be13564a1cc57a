"""RoPE as the attention-free scores need it: a rotation applied by the policy to a query it models (the model's
own keys are cached already rotated). transformers' rotate_half layout: channel f pairs with f + dim / 2 and turns
by angle position * inv_freq[f]."""

from __future__ import annotations

from .._lazy import torch


def mean_phase(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean of cos and sin of position * inv_freq over a set of positions per row.
    inv_freq [dim // 2]; positions [batch, m] (absolute, float) -> (cos, sin), each [batch, dim // 2]."""
    ang = positions.double()[..., None] * inv_freq.double()  # [batch, m, dim // 2]
    return ang.cos().mean(1).float(), ang.sin().mean(1).float()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply [[cos, -sin], [sin, cos]] to each pair (f, f + dim / 2) of x [..., dim]; cos, sin broadcast against
    x[..., :dim // 2]. With a mean cos / sin this is the mean of the rotations (not itself a rotation)."""
    h = x.shape[-1] // 2
    a, b = x[..., :h], x[..., h:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def rotation_matrix(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """[..., dim // 2] cos, sin -> [..., dim, dim]: the matrix of `rotate` (to carry a covariance: R S R^T)."""
    c, s = torch.diag_embed(cos), torch.diag_embed(sin)
    return torch.cat([torch.cat([c, -s], -1), torch.cat([s, c], -1)], -2)


def next_position(state: dict, obs) -> None:
    """Keep state["next"] [batch] = the absolute position of each row's next token (its newest real token's
    position + 1): where the future queries start, whatever the cache has evicted (not the stored length)."""
    pos = obs.positions.to(state["next"].device)
    newest = pos.masked_fill(~obs.valid.to(pos.device), -1).amax(-1) + 1  # [batch]
    state["next"] = torch.maximum(state["next"], newest)


class FutureQueries:
    """What a policy that models future queries observes and tracks (TriAttention, Expected Attention): the last
    `window` pre-RoPE queries with the cached keys and values, and each row's next absolute position. A mixin for a
    Policy dataclass with a `window` field."""

    def observes(self, n_layers):
        from .base import Observes

        return Observes(keys_values=True, queries=self.window, pre_rope=True)

    def init_state(self, batch, n_layers, device):
        return {"next": torch.zeros(batch, dtype=torch.long, device=device)}

    def on_tokens(self, state, obs):
        next_position(state, obs)
        return {}


def group_heads(k: torch.Tensor, heads: int) -> torch.Tensor:
    """[batch, kv_heads, n, dim] -> [batch, heads, n, dim]: each query head's KV head (GQA)."""
    return k.repeat_interleave(heads // k.shape[1], dim=1)
