"""The evicting KV cache: preallocated per-layer storage, per-token policy data, and the eviction schedule.

It is the only place where eviction happens, for the engine's loop and for `model.generate` alike: forward hooks
capture what the policy observes (hidden states of a few blocks, attention weights only for attention-based
policies), and a hook after the decoder stack scores, selects and compacts. Stored length (what attention reads)
is kept apart from tokens seen (true RoPE positions), as in transformers' cache layers.

By concern: the per-layer storage is `buffers.py`, what is read of the model (blocks, hooks) `hooks.py`, the
policy's side (state, per-token data, schedule, keep) `policy_state.PolicyState`, shared with the other engines;
this module is the cache that ties them together.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from transformers.cache_utils import Cache

from .buffers import BufferLayer, SlidingBufferLayer, hole_fill, select_state_rows  # noqa: F401 (re-exported)
from .errors import EpiKVError
from .hooks import (_after_stack_hook, _attention_hook, _before_stack_hook, _check_hybrid_policy,  # noqa: F401
                    _hidden_hook, _install_hook, _query_hook, attention_layout, cache_kwarg, decoder_layers,
                    rope_frequencies)
from .policies import DEFAULT_POLICY, CacheView, Policy, for_model, get_policy
from .policy_state import BufferBytes, PolicyState, held_bytes
from .signals import model_depth


# the buffers the torch cache keeps for its policy besides the keys and values (policy_state.BUFFER_KINDS)
CACHE_BUFFERS = ("queries", "token_data", "policy_state", "slot_map")


def _check_learned(policy: Policy, fingerprint: str, n_layers: int) -> None:
    """A policy with learned weights checks them against the model (policies/learned.py); others have nothing to."""
    if getattr(policy, "check_model", None) is not None:
        policy.check_model(fingerprint, n_layers)


class EpiKVCache(Cache):
    """A KV cache that keeps at most `budget` tokens per sequence by evicting with a policy.

    Drop-in for `model.generate(..., cache=EpiKVCache(model, policy="epikv-seg-q", budget=1024))` (`past_key_values=`
    before transformers 5.24), and the cache behind `epikv.generate`. In model.generate: left-padded batches (the
    padding is read from the first forward's attention mask), beam search and num_return_sequences (rows reordered
    with their policy state), later turns (`get_seq_length()` counts tokens seen, so generate feeds only the unseen
    suffix at its true positions; `stored_length()` is what is stored) and `copy.deepcopy` to fork a conversation.
    Between two steps the cache holds at most budget + tau - 1 tokens, exactly budget after each eviction.

    Hybrid models (Gemma-3, GPT-OSS, Ministral: `config.layer_types` mixing "sliding_attention" and
    "full_attention"): the budget and the policy apply to the full-attention layers only (the reference layer for
    lengths is one of them, and view.keys / obs.keys list only them); each sliding-window layer keeps the last
    sliding_window - 1 tokens seen, as transformers' own sliding layers do, never takes part in eviction and reports
    its own kv length and offset to the mask builder, so its window stays exact (left-padded batches too, with the
    default keep rule, which evicts a row's padding before its real tokens). Policies defined layer by layer
    (per-head or per-layer keep sets, attention weights, recomputed queries) are refused there, as are
    linear-attention layers; a model whose every layer slides is already bounded and only runs the `full` policy.
    """

    EPIKV_HOOKED = True  # the forward hooks (hooks.py) act on caches of this class only

    def __init__(self, model, policy: str | Policy = DEFAULT_POLICY, budget: int | None = 1024, tau: int | None = None,
                 **policy_settings) -> None:
        self.policy = get_policy(policy, tau=tau, **policy_settings)
        layers = decoder_layers(model)
        self.n_layers = model_depth(model.config, len(layers))  # an int that also names the architecture
        if getattr(self.policy, "check_model", None) is not None:  # learned weights: fitted on this very model?
            from .fingerprint import model_fingerprint

            fp = model_fingerprint(model, layers)
            # the default (no policy named) falls back where no weights fit this model; a named one is refused
            self.policy = for_model(self.policy, lambda p: _check_learned(p, fp, self.n_layers), tau=tau)
        sliding, self.window = attention_layout(model, self.n_layers)
        if sliding and len(sliding) == self.n_layers:
            if self.policy.evicts:
                raise EpiKVError(f"every attention layer of this model is sliding-window ({self.window} tokens): its "
                                 "cache is already bounded by the window and no full-attention layer is left to "
                                 "evict from; use policy full (or the model's own cache)")
            sliding = frozenset()  # nothing is evicted: plain buffers keep every token and the masks stay exact
        if self.policy.evicts:
            if budget is None or isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
                raise EpiKVError(f"budget must be a positive integer, got {budget!r}")
        self.budget = budget if self.policy.evicts else None
        self.tau = self.policy.tau
        self.recent = self.policy.recent_window(budget) if self.policy.evicts else 0
        obs = self.policy.observes(self.n_layers)
        from .policies.base import check_true_positions
        from .signals import check_layers

        check_true_positions(self.policy)
        check_layers(obs.hidden_layers, self.n_layers)
        check_layers(obs.attention_layers, self.n_layers)
        if sliding:
            _check_hybrid_policy(self.policy, obs, self.n_layers)
        if obs.attention_layers and getattr(model.config, "_attn_implementation", "eager") != "eager":
            raise EpiKVError(f"policy {self.policy.name} reads attention weights and needs eager attention "
                             f"(the model uses {model.config._attn_implementation})")
        # Policies that read no keys, values or attention weights see the cache through token data only, so an
        # eviction may refill its holes with the newest kept slots instead of compacting in order (`hole_fill`):
        # slot order then differs from true-position order, kept in `_phys`. Attention does not depend on slot
        # order (positions are applied when a key is written), and new tokens always append after every stored
        # slot, so multi-token feeds keep their causal layout. In a padded batch the padding mask then follows
        # `_pad_slots` (an evicted padding slot takes a real token), except on hybrid models (see _padding_mask).
        self._refill = self.policy.evicts and not (obs.keys_values or obs.attention_layers or obs.queries)
        self._phys: torch.Tensor | None = None  # [batch, n] physical slot of each stored token, in true order
        self._pad_slots: torch.Tensor | None = None  # [batch, n] physical slots holding padding, once refilled
        self._capture_hidden = frozenset(obs.hidden_layers)
        self._capture_attn = frozenset(obs.attention_layers)
        self._needs_kv = obs.keys_values
        self._arriving_kv = obs.arriving_kv and not obs.keys_values  # the new tokens' slots only
        self._n_queries = obs.queries
        self._query_layers = frozenset(obs.query_layers or range(self.n_layers))
        self._queries_pre_rope = bool(obs.queries and obs.pre_rope)
        self._rope: dict = {}  # Observes.pre_rope: what the view carries of the rotary embedding
        if self._queries_pre_rope:
            inv, scale = rope_frequencies(model, layers[0].self_attn.head_dim, self.policy.name)
            self._rope = {"rope_inv_freq": inv, "rope_scaling": scale}
        # layers the policy never compresses (knorm's first two): they keep every token; lengths come from `_ref`
        self._full_layers = frozenset(self.policy.uncompressed_layers(self.n_layers)) if self.policy.evicts else frozenset()
        check_layers(self._full_layers, self.n_layers)
        if len(self._full_layers) >= self.n_layers:
            raise EpiKVError(f"{self.policy.name}: at least one layer must be compressed")
        # hybrid models: the sliding-window layers keep their own window and never take part in eviction; the
        # policy sees, scores and evicts the full-attention layers only
        self._sliding = sliding
        self._ref = min(set(range(self.n_layers)) - self._full_layers - sliding)  # a full-attention layer
        self._kv_layers = tuple(i for i in range(self.n_layers) if i not in sliding)  # what view.keys lists
        # budget + tau slots, plus slack so the kept run can drift right before it is moved back to offset 0
        self._capacity = (self.budget + self.tau + max(16, self.budget // 4)) if self.budget else 256
        super().__init__(layers=[SlidingBufferLayer(self.window) if i in sliding else BufferLayer(self._capacity)
                                 for i in range(self.n_layers)])
        self.home = model.get_input_embeddings().weight.device
        for l in obs.hidden_layers:
            _install_hook(layers[l], "hidden", _hidden_hook(l))
        for l in obs.attention_layers:
            _install_hook(layers[l].self_attn, "attention", _attention_hook(l))
        if obs.queries:
            check_layers(obs.query_layers, self.n_layers)
            for l in sorted(self._query_layers):
                _install_hook(layers[l].self_attn, "query", _query_hook(l))
        _install_hook(model.model, "before", _before_stack_hook)
        _install_hook(model.model, "after", _after_stack_hook)
        self._open = False  # a forward the hooks saw is running: only then may layers be written
        self._queries_fresh: set[int] = set()  # layers whose queries this forward recomputed
        self._hidden: dict[int, torch.Tensor] = {}
        self._attn: dict[int, torch.Tensor] = {}
        self._queries: dict[int, torch.Tensor] = {}  # layer -> [batch, heads, <= w, head_dim]
        self._query_valid: torch.Tensor | None = None  # [batch, <= w]
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None
        # the policy's side (state, per-token data, protected head, schedule), as every engine keeps it
        self.ps = PolicyState(self.policy, self.budget, self.recent, self.home)
        self.seen = None
        self.max_tokens = 0
        self._stored_after_step = 0
        self._hold = False  # eviction deferred to the end of a multi-token feed split into single tokens
        # the buffers kept for the policy besides the keys and values (policy_state.BUFFER_KINDS), the whole batch's:
        # now, and at the most (after a forward has scored its tokens, before its eviction)
        self.buffers = BufferBytes(CACHE_BUFFERS)

    # the policy's side lives in self.ps (policy_state.PolicyState); these names are the cache's public face
    state = property(lambda self: self.ps.state, lambda self, v: setattr(self.ps, "state", v))
    token_data = property(lambda self: self.ps.token_data, lambda self, v: setattr(self.ps, "token_data", v))
    n_pad = property(lambda self: self.ps.n_pad, lambda self, v: setattr(self.ps, "n_pad", v))
    n_protect = property(lambda self: self.ps.n_protect, lambda self, v: setattr(self.ps, "n_protect", v))
    n_prompt = property(lambda self: self.ps.n_prompt, lambda self, v: setattr(self.ps, "n_prompt", v))
    evictions = property(lambda self: self.ps.evictions, lambda self, v: setattr(self.ps, "evictions", v))
    _len_after_evict = property(lambda self: self.ps.len_after_evict,
                                lambda self, v: setattr(self.ps, "len_after_evict", v))
    _prefix = property(lambda self: self.ps.prefix, lambda self, v: setattr(self.ps, "prefix", v))

    # -- sequence set-up ---------------------------------------------------------------------------------------------
    def begin(self, prompt_lens: list[int], n_pad: list[int] | None = None) -> None:
        """Declare the batch: real prompt tokens per row and left padding. Checks the budget against what is
        protected."""
        n_pad = n_pad or [0] * len(prompt_lens)
        if min(prompt_lens) < 1:
            raise EpiKVError("empty prompt: at least one token is needed")
        if self._full_layers and any(n_pad):
            raise EpiKVError(f"{self.policy.name} leaves layers {sorted(self._full_layers)} uncompressed, so layers "
                             "differ in length, which a padded batch's shared mask cannot express: run prompts one "
                             "at a time or set skip_layers to none")
        why = self.policy.protected_overflow(self.budget, self.recent, max(prompt_lens))
        if why:
            raise EpiKVError(why)
        self._padded = any(n_pad)  # host-side, from the prompt layout: no device sync per step
        if self._sliding and self._padded and self.policy.evicts and (
                self.policy.page or type(self.policy).keep is not Policy.keep):
            # the shared 2D mask needs every padded row to lose its padding before any real token (see _padding_mask)
            what = f"evicts whole pages (page={self.policy.page})" if self.policy.page else "has its own keep rule"
            raise EpiKVError(f"{self.policy.name} {what}, which may evict real tokens of a padded row before its "
                             "padding: on a model with sliding-window layers run its prompts unpadded (one at a time)")
        self.ps.begin(prompt_lens, n_pad, self.n_layers)  # n_pad, n_protect, n_prompt (first prompt), state
        self.seen = torch.zeros(len(prompt_lens), dtype=torch.long, device=self.home)

    def feeds_one_at_a_time(self, n_tokens: int) -> bool:
        """Whether a forward of n_tokens must be split into single-token forwards: once uncompressed layers (e.g.
        knorm's first two) are longer than the rest, one causal mask cannot serve every layer, but one query needs
        no mask. The engine splits such feeds under `held_eviction`, which gives the same result as one forward."""
        return bool(self._full_layers) and n_tokens > 1 and self.layers[0].length != self.layers[self._ref].length

    @contextlib.contextmanager
    def held_eviction(self):
        """No eviction inside; on exit one if due, as after a single multi-token forward."""
        self._hold = True
        try:
            yield
        finally:
            self._hold = False
        self._end_step()

    def _end_step(self) -> None:
        """Evict when the policy's schedule says so (default: over budget + tau - 1), then record what the step
        leaves stored."""
        if self.ps.due(self.layers[self._ref].length):
            self.evict()
            self.buffers.note(self.buffer_bytes())
        self._stored_after_step = self.layers[self._ref].length
        self.max_tokens = max(self.max_tokens, self._stored_after_step)

    def prepare(self, valid: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Attention mask and true position ids for the next forward of T tokens (valid: [batch, T] bool).

        The 2D mask covers stored + new tokens; padding stays a prefix of every row, so it is derived from n_pad.
        Returns (mask or None when no row has padding, position_ids [batch, T])."""
        valid = valid.to(self.home)
        if self.feeds_one_at_a_time(valid.shape[1]):  # the engine splits these; a direct caller must too
            raise EpiKVError(f"{self.policy.name}: once layers differ in length, tokens must be fed one at a time "
                             "(a multi-token forward needs one causal mask per layer length)")
        pos = self.seen[:, None] + valid.long().cumsum(-1) - 1
        pos = pos.clamp(min=0)
        self._pending = (valid, pos)
        if not self._padded:
            return None, pos
        return self._padding_mask(valid), pos

    def _padding_mask(self, valid: torch.Tensor) -> torch.Tensor:
        """The 2D mask [batch, seen + T] laid out as transformers reads it: get_mask_sizes puts the stored slots at
        columns seen - stored ... seen - 1 and the T new tokens after them (the columns before, evicted tokens, are
        never read). Padding stays a prefix of each row's stored slots, so that part comes from n_pad.

        With sliding-window layers the columns before the stored slots show the true padding (the first
        seen - real columns of a row): a sliding layer reads the columns of its window, which may reach before the
        full-attention layers' stored slots. Where both read, they agree: a row keeps padding only while it keeps every
        real token (checked at eviction), so its stored padding sits at the padding's true columns."""
        layer = self.layers[self._ref]  # a full-attention layer: every layer has seen the same columns
        n = layer.length
        if self._sliding:
            pad0 = layer.cumulative - self.seen  # [batch] padding columns of each row (fed in the first forward)
            gone = torch.arange(layer.cumulative - n, device=self.home)[None, :] >= pad0[:, None]
        else:
            gone = valid.new_ones(valid.shape[0], layer.cumulative - n)
        if self._pad_slots is not None:  # refilled: kept padding may sit anywhere among the stored slots
            stored = ~self._pad_slots
        else:
            stored = torch.arange(n, device=self.home)[None, :] >= self.n_pad[:, None]
        return torch.cat([gone, stored, valid], dim=1).long()

    # -- the step ----------------------------------------------------------------------------------------------------
    def _before_forward(self, args: tuple, kwargs: dict) -> dict:
        """Runs before the decoder stack of every forward that passes this cache by keyword. A forward the engine
        prepared keeps its mask and positions; any other (model.generate, a direct call) gets them here: the
        padding (left only) is read from its 2D mask on the first forward, the mask is replaced by one that follows
        the compacted cache, and position ids, when absent, are the true positions."""
        if self._open:
            raise EpiKVError("an earlier forward with this EpiKVCache stopped midway (an exception inside the model), "
                             "so its layers may disagree: start a new cache")
        if self._pending is None:
            kwargs = self._plain_forward(args, kwargs)
        self._open = True
        self._queries_fresh = set()
        return kwargs

    def _plain_forward(self, args: tuple, kwargs: dict) -> dict:
        x = kwargs.get("input_ids")
        if x is None:
            x = kwargs.get("inputs_embeds")
        if x is None and args:
            x = args[0]
        b, t = x.shape[0], x.shape[1]
        mask = kwargs.get("attention_mask")
        is_2d = isinstance(mask, torch.Tensor) and mask.dim() == 2
        if is_2d:  # generate()'s mask covers every column so far; the new tokens are its last t
            valid = mask[:, -t:].to(device=self.home, dtype=torch.bool)
        else:
            valid = torch.ones(b, t, dtype=torch.bool, device=self.home)
        if self.n_pad is None:  # first forward: the prompt, possibly left-padded
            n_pad = t - valid.sum(-1)
            if is_2d and not bool((valid == (torch.arange(t, device=self.home)[None, :] >= n_pad[:, None])).all()):
                raise EpiKVError("EpiKVCache supports left padding only: each row of the attention mask must be "
                                 "zeros, then ones (set tokenizer.padding_side = 'left')")
            self.begin((t - n_pad).tolist(), n_pad.tolist())
        elif b != self.n_pad.shape[0]:
            raise EpiKVError(f"this EpiKVCache holds {self.n_pad.shape[0]} sequences but the forward feeds {b}: "
                             "select or repeat its rows first (cache.batch_select_indices, "
                             "cache.batch_repeat_interleave)")
        elif is_2d and t > 1 and not bool(valid.all()):  # (a single new token: generate's mask always ends in 1)
            raise EpiKVError("only the first forward over an EpiKVCache may hold padding (a left-padded prompt): "
                             "the new tokens of a later turn must all be real")
        if self.feeds_one_at_a_time(t):
            raise EpiKVError(f"{self.policy.name} leaves layers {sorted(self._full_layers)} uncompressed, so once "
                             "it has evicted its layers differ in length and a forward of several tokens (a later "
                             "turn in model.generate) cannot be masked: feed the turn with epikv.engine.Decoder.step, "
                             "which splits it, or set skip_layers to none")
        new_mask, pos = self.prepare(valid)
        given = kwargs.get("position_ids")
        if given is not None:  # the caller's positions (generate derives the true ones from its mask)
            self._pending = (valid, given.to(self.home).expand(b, -1))
        else:
            kwargs["position_ids"] = pos.to(x.device)
        if mask is None or is_2d:
            kwargs["attention_mask"] = None if new_mask is None else new_mask.to(x.device)
        return kwargs

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if not self._open:
            raise EpiKVError("EpiKVCache was written by a forward its hooks did not see (the cache passed "
                             "positionally, or under a name other than cache / past_key_values): eviction and true "
                             "positions would silently stop; pass it by keyword to the model")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _after_forward(self) -> None:
        self._open = False
        valid, pos = self._pending
        self._pending = None
        t = valid.shape[1]
        if self.layers[self._ref].length - self._stored_after_step != t:
            raise EpiKVError(f"the forward fed {t} tokens but layer {self._ref} of the cache received "
                             f"{self.layers[self._ref].length - self._stored_after_step}")
        missing = (self._capture_hidden - self._hidden.keys()) | (self._capture_attn - self._attn.keys())
        if self._n_queries:
            missing |= self._query_layers - self._queries_fresh
        if missing:
            raise EpiKVError(f"the hooks on decoder blocks {sorted(missing)} did not find the cache in their keyword "
                             f"arguments, so {self.policy.name} cannot observe them (a model that passes it under "
                             "another name is not supported)")
        if self._n_queries:
            qv = valid if self._query_valid is None else torch.cat([self._query_valid, valid], dim=1)
            self._query_valid = qv[:, -self._n_queries:]
        n_old = self._stored_after_step
        self.ps.observe(hidden=self._hidden, attentions=self._attn, valid=valid, positions=pos, n_old=n_old,
                        kv_heads=self.layers[self._ref].keys.shape[1], keys=self._step_kv("keys", t),
                        values=self._step_kv("values", t))
        if self._phys is not None:  # the new tokens were written after every stored slot
            self._phys = torch.cat([self._phys, torch.arange(n_old, n_old + t, device=self._phys.device)
                                    .expand(self._phys.shape[0], t)], dim=1)
        if self._pad_slots is not None:
            self._pad_slots = torch.cat([self._pad_slots, ~valid], dim=1)
        self._hidden, self._attn = {}, {}
        self.seen += valid.sum(-1)
        self.buffers.note(self.buffer_bytes())
        self._stored_after_step = self.layers[self._ref].length
        if not self._hold:
            self._end_step()

    def _step_kv(self, which: str, t: int) -> list[torch.Tensor]:
        """What a step shows of the stored keys or values: every slot (Observes.keys_values), the t new ones, which
        the forward wrote after every stored slot (Observes.arriving_kv), or nothing."""
        if self._needs_kv:
            return [getattr(self.layers[i], which) for i in self._kv_layers]
        if self._arriving_kv:
            return [getattr(self.layers[i], which)[:, :, -t:] for i in self._kv_layers]
        return []

    def view(self) -> CacheView:
        return self.ps.view(self.layers[self._ref].length, **self._view_kv())

    def _view_kv(self) -> dict:
        """What the keep rule reads of the stored keys, values and recent queries (per the policy's Observes)."""
        return dict(keys=[self.layers[i].keys for i in self._kv_layers] if self._needs_kv else [],
                    values=[self.layers[i].values for i in self._kv_layers] if self._needs_kv else [],
                    queries=[self._queries.get(l) for l in range(self.n_layers)] if self._n_queries else [],
                    query_valid=self._query_valid, **self._rope)

    def evict(self) -> torch.Tensor:
        """Cut every sequence back to the policy's keep set (exactly `budget` tokens unless the policy keeps fewer).
        Returns the keep indices."""
        n_old = self.layers[self._ref].length
        keep = self.ps.keep(n_old, **self._view_kv())  # [batch, K] or [batch, layers, heads, K], K <= budget
        per_head = keep.dim() == 4
        k = keep.shape[-1]
        phys = keep  # the kept tokens' physical slots, in true order
        if self._phys is not None:
            p = self._phys.to(keep.device)
            phys = p.gather(1, keep) if not per_head else p[:, None, None, :].expand(*keep.shape[:3], -1).gather(-1, keep)
        ref = self.layers[self._ref]
        if (self._refill and not per_head and not (self._padded and self._sliding) and n_old > k
                and ref.capacity <= 2 * self._capacity):
            self._refill_holes(phys, n_old - k)
        else:
            self._compact(phys, per_head, k, n_old)
            self._phys = self._pad_slots = None  # compaction writes the kept tokens in true order
        first = keep[:, self._ref, 0] if per_head else keep  # [batch, K]
        self.ps.select(keep, self.layers[self._ref].length, ref_layer=self._ref)
        self.n_pad = (first < self.n_pad[:, None]).sum(-1)  # padding stays a prefix
        if self._sliding and self._padded:
            # one 2D mask serves both kinds of layer (see _padding_mask): a row may keep padding only while it keeps
            # every real token, so that its stored padding sits at the padding's true columns
            n = self.layers[self._ref].length
            if bool(((self.n_pad > 0) & (n - self.n_pad != self.seen)).any()):
                raise EpiKVError(f"{self.policy.name} evicted real tokens of a padded row while keeping its padding, "
                                 "which a hybrid (sliding-window) model's shared mask cannot express: run that "
                                 "prompt unpadded")
        self._stored_after_step = self.layers[self._ref].length
        return keep

    def _refill_holes(self, phys: torch.Tensor, m: int) -> None:
        """Eviction by refilling: the kept slots beyond K move into the evicted slots below K (`hole_fill`)."""
        moves: dict[torch.device, tuple] = {}
        for i, layer in enumerate(self.layers):
            if i in self._full_layers or i in self._sliding:
                continue
            dev = layer.device
            if dev not in moves:
                moves[dev] = hole_fill(phys.to(dev, non_blocking=True), m)
            layer.move_slots(moves[dev][0], moves[dev][1], phys.shape[-1])
        src, dst, self._phys = (x.to(self.home) for x in moves[next(iter(moves))])
        if self._padded:  # the padding mask follows the slots: kept padding stays put, holes take what moved in
            n_old = phys.shape[-1] + m
            pad = self._pad_slots
            if pad is None:  # until now padding was the prefix of every row
                pad = torch.arange(n_old, device=self.home)[None, :] < self.n_pad[:, None]
            pad = pad.clone()
            pad.scatter_(1, dst, pad.gather(1, src))
            self._pad_slots = pad[:, : phys.shape[-1]]

    def _compact(self, keep: torch.Tensor, per_head: bool, k: int, n_old: int) -> None:
        """Eviction by compaction: the kept slots `keep` (physical) in this order, every layer."""
        start = still = 0
        if keep.device.type == "cpu":
            # Kept runs that need not move: slots before the first evicted one, and after the last one. Reading them
            # is free on the CPU; on an accelerator it would be a host sync, so there every slot moves.
            front = (keep == torch.arange(k)).flatten(0, -2).all(0)  # [K]
            back = (keep == torch.arange(n_old - k, n_old)).flatten(0, -2).all(0)
            start = k if bool(front.all()) else int((~front).int().argmax())
            still = k if bool(back.all()) else int((~back).int().flip(0).argmax())  # trailing run
        on_dev: dict[torch.device, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            dev = layer.device
            if dev not in on_dev:
                on_dev[dev] = keep.to(dev, non_blocking=True)
            if i in self._full_layers or i in self._sliding:
                continue
            layer.compact(on_dev[dev][:, i] if per_head else on_dev[dev], self._capacity, start, still)

    def load_prefix(self, other: "EpiKVCache", n_tokens: int) -> None:
        """Start this (fresh) cache as a copy of the first `n_tokens` stored tokens of `other`, batch row by row
        the same, ready to continue at true position n_tokens. `other` must not have evicted (positions = slots):
        a prefix reused by many continuations (occlusion windows, teacher forcing) costs one pass over it."""
        if other.evictions:
            raise EpiKVError("cannot fork a cache that has evicted: its slots are no longer positions")
        if not 1 <= n_tokens <= other.stored_length():
            raise EpiKVError(f"prefix of {n_tokens} tokens is outside the {other.stored_length()} stored")
        batch = other.n_pad.shape[0]
        if self._sliding != other._sliding:
            raise EpiKVError("cannot fork a prefix from a cache of another model")
        self.begin([n_tokens] * batch)
        for src, dst in zip(other.layers, self.layers):
            if isinstance(dst, SlidingBufferLayer):  # the window before column n_tokens, if src still holds it
                first, start = src.cumulative - src.length, max(0, n_tokens - dst.keep_slots)
                if start < first:
                    raise EpiKVError(f"cannot fork a prefix of {n_tokens} tokens: the sliding-window layers have "
                                     f"moved past it (they hold columns {first} onwards)")
                dst.update(src.keys[:, :, start - first : n_tokens - first],
                           src.values[:, :, start - first : n_tokens - first])
                dst.cumulative = n_tokens
                continue
            dst.update(src.keys[:, :, :n_tokens], src.values[:, :, :n_tokens])  # copies into our own buffers
        self.seen.fill_(n_tokens)
        self.token_data = {"pos": other.token_data["pos"][..., :n_tokens].clone()}
        self._stored_after_step = n_tokens
        self.max_tokens = n_tokens

    # -- Cache API ---------------------------------------------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens seen (columns fed, padding included), what transformers' generate() and position logic expect;
        after an eviction more than are stored (`stored_length`)."""
        return self.layers[layer_idx].get_seq_length()

    def stored_length(self) -> int:
        """Tokens stored per sequence now (at most budget + tau - 1 between steps)."""
        return self.layers[self._ref].length

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i becomes row beam_idx[i], in the layers and in every per-row datum (policy state,
        token data, positions, padding)."""
        self._select_rows(torch.as_tensor(beam_idx))

    def batch_select_indices(self, indices) -> None:
        """Keep the rows `indices` (indices or a bool mask), in that order."""
        idx = torch.as_tensor(indices)
        self._select_rows(idx.nonzero().squeeze(-1) if idx.dtype == torch.bool else idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row `repeats` times in a row (num_return_sequences, or one prefix for several continuations)."""
        if self.n_pad is not None:
            self._select_rows(torch.arange(self.n_pad.shape[0]).repeat_interleave(repeats))

    def _select_rows(self, idx: torch.Tensor) -> None:
        if self.n_pad is None:  # nothing fed yet: no rows to move
            return
        batch = self.n_pad.shape[0]
        idx = idx.to(self.home, torch.long)
        for layer in self.layers:
            layer.select_rows(idx)
        self.token_data = {k: v.index_select(0, idx.to(v.device)) for k, v in self.token_data.items()}
        if self._phys is not None:
            self._phys = self._phys.index_select(0, idx.to(self._phys.device))
        if self._pad_slots is not None:
            self._pad_slots = self._pad_slots.index_select(0, idx.to(self._pad_slots.device))
        self.n_pad, self.n_protect, self.seen, self.n_prompt = (
            x.index_select(0, idx) for x in (self.n_pad, self.n_protect, self.seen, self.n_prompt))
        self._queries = {l: q.index_select(0, idx.to(q.device)) for l, q in self._queries.items()}
        if self._query_valid is not None:
            self._query_valid = self._query_valid.index_select(0, idx)
        self.state = select_state_rows(self.state, idx, batch)

    def buffer_bytes(self) -> dict[str, int]:
        """Bytes of each buffer kept for the policy (CACHE_BUFFERS), over the batch, read from the arrays."""
        seen: set = set()
        return {"queries": held_bytes([self._queries, self._query_valid], seen),
                "slot_map": held_bytes([self._phys, self._pad_slots, self.seen], seen), **self.ps.buffer_bytes(seen)}

    def stats(self) -> dict[str, Any]:
        """max_cache_tokens, final_cache_tokens, evictions, and the policy's buffers by kind now and at the most
        (buffer_bytes, buffer_peak_bytes)."""
        return {"max_cache_tokens": self.max_tokens, "final_cache_tokens": self.layers[self._ref].length,
                "evictions": self.evictions, **self.buffers.report()}
