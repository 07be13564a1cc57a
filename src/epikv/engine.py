"""The decoding loop every entry point uses: prefill, decode, sampling, stop rules, eviction, statistics.

`Decoder` owns one batch's cache and feeds tokens with true positions and the compacted padding mask;
`generate` runs prompts to completion on top of it.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import torch

from .cache import EpiKVCache, cache_kwarg, decoder_layers
from .errors import ContextWarning, EpiKVError
from .policies import DEFAULT_POLICY, Policy, get_policy
from .progress import live_rate
from .stops import StopStream, cut_at_stop, stop_index


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


DRAWS = ("cdf", "gumbel")


@dataclass
class Sampling:
    """temperature 0 = greedy; otherwise sampling after transformers' own logits processors, in model.generate's
    order: repetition penalty (1 = off; greedy too), temperature, top-k (0 = off), top-p (1 = off), min-p (0 = off).
    `seed`: row i of a batch draws from its own stream seeded `seed + i`, unless generate(seeds=...) gives each row
    its seed; a row's tokens never depend on the other rows of its batch.
    `draw`: how a token is drawn from the processed scores. "cdf" (default): one uniform per step, inverse CDF.
    "gumbel": Gumbel-max, argmax(scores + Gumbel noise), one noise value per vocabulary entry and step from the
    row's seeded stream, on the model's device (a seed gives the same stream on every CPU, and on every CUDA
    device, not across the two). Both sample the same distribution; Gumbel-max changes a token only when float
    noise in the logits reorders its two best perturbed scores, so it stays the same when the logits move by
    rounding (another batch composition in a serving engine), where the inverse CDF moves across thousands of
    close boundaries of a flat distribution. `epikv serve` draws with "gumbel"."""

    temperature: float = 0.0
    """0: greedy; > 0: sample at this temperature."""
    top_p: float = 1.0
    """Nucleus sampling in (0, 1] (1: off)."""
    top_k: int = 0
    """Keep the k most likely tokens (0: off)."""
    seed: int = 0
    """Row i of a batch draws from the stream seeded seed + i (unless generate(seeds=...) gives each row its own)."""
    min_p: float = 0.0
    """Drop tokens below min_p times the most likely token's probability (0: off)."""
    repetition_penalty: float = 1.0
    """> 0; on tokens already in the prompt or the output (1: off)."""
    draw: str = "cdf"
    """How a token is drawn from the processed scores: "cdf" (inverse CDF) or "gumbel" (Gumbel-max)."""

    def __post_init__(self):
        if self.draw not in DRAWS:
            raise EpiKVError(f"draw must be one of {', '.join(DRAWS)}, got {self.draw!r}")
        if not (_number(self.temperature) and self.temperature >= 0):
            raise EpiKVError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not (_number(self.top_p) and 0 < self.top_p <= 1):
            raise EpiKVError(f"top-p must be in (0, 1], got {self.top_p!r}")
        if not (isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k >= 0):
            raise EpiKVError(f"top-k must be an integer >= 0, got {self.top_k!r}")
        if not (_number(self.min_p) and 0 <= self.min_p <= 1):
            raise EpiKVError(f"min-p must be in [0, 1], got {self.min_p!r}")
        if not (_number(self.repetition_penalty) and self.repetition_penalty > 0):
            raise EpiKVError(f"repetition penalty must be a number > 0 (1 = off), got {self.repetition_penalty!r}")
        _check_seed(self.seed)

    def processors(self):
        """The transformers LogitsProcessorList this configuration applies (empty for plain greedy)."""
        from transformers import (LogitsProcessorList, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                  TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

        procs = LogitsProcessorList()
        if self.repetition_penalty != 1:
            procs.append(RepetitionPenaltyLogitsProcessor(float(self.repetition_penalty)))
        if self.temperature > 0:  # warpers only shape a sampled distribution (as with do_sample=False in HF)
            if self.temperature != 1:
                procs.append(TemperatureLogitsWarper(float(self.temperature)))
            if self.top_k:
                procs.append(TopKLogitsWarper(int(self.top_k)))
            if self.top_p < 1:
                procs.append(TopPLogitsWarper(float(self.top_p)))
            if self.min_p > 0:
                procs.append(MinPLogitsWarper(float(self.min_p)))
        return procs


def _gc_resolver(gc, model):
    """name -> the value model.generate would use: the config's own, else the model's generation_config, else
    transformers' global default (a private table in recent versions, GenerationConfig()'s attributes in older ones),
    else `off`."""
    from transformers import GenerationConfig

    table = getattr(GenerationConfig, "_get_default_generation_params", None)
    defaults = table() if callable(table) else GenerationConfig().to_dict()
    sources = [gc, getattr(model, "generation_config", None)]

    def get(name, off):
        for src in sources:
            v = getattr(src, name, None) if src is not None else None
            if v is not None:
                return v
        v = defaults.get(name)
        return off if v is None else v

    return get


def _check_seed(seed) -> None:
    if not (isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed < 2**63):
        raise EpiKVError(f"seed must be an integer in [0, 2^63), got {seed!r}")


def sequence_seed(*parts) -> int:
    """A stable seed from any parts (e.g. base seed, problem id, sample index): the same on every machine and run,
    unlike Python's salted hash()."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1  # 63 bits


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row by inverse CDF: probs [batch, vocab] (rows summing to ~1), u [batch] uniforms in [0, 1).
    Only tokens with probability > 0 can come out."""
    cdf = probs.cumsum(-1)  # [batch, vocab], non-decreasing
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None].to(cdf.dtype), right=True).squeeze(-1)
    ar = torch.arange(probs.shape[-1], device=probs.device)
    last = torch.where(probs > 0, ar, -1).amax(-1)  # float rounding could step past the last possible token
    return torch.minimum(idx, last)


def gumbel_max(scores: torch.Tensor, gens: Sequence[torch.Generator]) -> torch.Tensor:
    """One token per row by Gumbel-max: argmax(scores + G), G = -log(-log(U)) with U drawn from row i's generator
    gens[i] (on its device: a vocabulary of noise per token is too much to copy from the host at every step), one per
    vocabulary entry. scores [batch, vocab]: log-probabilities up to a constant (-inf: never drawn)."""
    u = torch.stack([torch.rand(scores.shape[-1], generator=g, dtype=torch.float64, device=g.device) for g in gens])
    noise = -torch.log(-torch.log(u.clamp(min=1e-300)))  # [batch, vocab]; U = 0 would give -inf, never +inf
    return (scores.double() + noise.to(scores.device)).argmax(dim=-1)


class Sampler:
    """Next tokens of a batch: transformers' logits processors over the ids so far (prompt + generated, kept on the
    device), then argmax (greedy) or one inverse-CDF draw per row from that row's own seeded stream of uniforms.
    The uniforms of every step are drawn up front on the host (one copy to the device, none per step), so a row's
    tokens depend only on its own prompt and seed, never on its batch-mates or its position in the batch."""

    def __init__(self, cfg: Sampling, seeds: Sequence[int], prompt_ids: torch.Tensor, n_pad: Sequence[int],
                 max_new_tokens: int, device) -> None:
        self.procs = cfg.processors()
        self.greedy = cfg.temperature == 0
        b, p = prompt_ids.shape
        self.p = p
        # [batch, prompt + new]: padding replaced by the row's first real token, so the repetition penalty sees
        # exactly the row's own tokens (a repeated id is penalised once either way)
        first = prompt_ids[torch.arange(b), torch.tensor(list(n_pad))]
        ids = torch.where(torch.arange(p)[None, :] < torch.tensor(list(n_pad))[:, None], first[:, None], prompt_ids)
        self.ids = torch.cat([ids, torch.zeros(b, max_new_tokens, dtype=torch.long)], dim=1).to(device)
        self.u = None
        self.gumbel = cfg.draw == "gumbel"
        if not self.greedy and self.gumbel:  # one stream per row on the device, drawn from step by step
            self.gens = [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]
        elif not self.greedy:
            u = torch.stack([torch.rand(max_new_tokens, generator=torch.Generator().manual_seed(int(s)))
                             for s in seeds])  # [batch, max_new_tokens]
            self.u = u.to(device)  # before the prefill: nothing queued to wait for

    @property
    def out(self) -> torch.Tensor:
        """The generated ids [batch, max_new_tokens] (a view)."""
        return self.ids[:, self.p:]

    def scores(self, logits: torch.Tensor, step: int) -> torch.Tensor:
        """logits [batch, vocab] of step `step` after the processors (float32), as model.generate would score them."""
        scores = logits.float()
        if self.procs:
            scores = self.procs(self.ids[:, : self.p + step].to(scores.device), scores)
        return scores

    def __call__(self, logits: torch.Tensor, step: int) -> torch.Tensor:
        """logits [batch, vocab] of step `step` -> token ids [batch]."""
        if not self.procs and self.greedy:
            return logits.argmax(dim=-1)
        scores = self.scores(logits, step)
        if self.greedy:
            return scores.argmax(dim=-1)
        if self.gumbel:
            return gumbel_max(scores, self.gens)
        return draw(scores.softmax(-1), self.u[:, step].to(scores.device))


def layer_choice(model, policy: Policy) -> str | None:
    """Which decoder blocks a policy with a `layers` setting (the EPIKV family) reads on this model (hidden states
    and recomputed queries, from its observes()), and why: set, the authors' published layers for this model, or the
    paper's scaled by depth. None for other policies."""
    if not hasattr(policy, "layers"):
        return None
    from .policies.hidden import layer_note
    from .signals import model_depth

    depth = model_depth(model.config, len(decoder_layers(model)))
    obs = policy.observes(depth)
    blocks = sorted(set(obs.hidden_layers) | set(obs.query_layers))
    return layer_note(policy.layers, depth, blocks) if blocks else None


@contextlib.contextmanager
def attention_for(model, policy: Policy):
    """Eager attention only for policies that read attention weights; SDPA/flash stay untouched otherwise."""
    needs = bool(policy.observes(len(model.model.layers)).attention_layers)
    current = model.config._attn_implementation
    if not needs or current == "eager":
        yield
        return
    if current.startswith("flash"):
        raise EpiKVError(f"policy {policy.name} needs attention weights, which {current} never produces: "
                         "run it with --attn sdpa or eager")
    model.set_attn_implementation("eager")
    try:
        yield
    finally:
        model.set_attn_implementation(current)


class Decoder:
    """One batch of sequences being decoded under a policy. Feed it tokens; it returns next-token logits."""

    def __init__(self, model, policy: str | Policy = DEFAULT_POLICY, budget: int | None = 1024, tau: int | None = None,
                 **policy_settings) -> None:
        self.model = model
        self.cache = EpiKVCache(model, policy, budget, tau, **policy_settings)
        self.policy = self.cache.policy
        self._kw = cache_kwarg(model)
        self.device = self.cache.home
        self.budget, self.tau = self.cache.budget, self.cache.tau
        self.host_sync = False  # logits on a device: decode_loop batches its host reads

    def cache_stats(self) -> dict:
        """max_cache_tokens, final_cache_tokens, evictions (host ints: no device sync)."""
        return self.cache.stats()

    def _forward(self, ids: torch.Tensor, valid: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        if self.cache.feeds_one_at_a_time(ids.shape[1]):
            # layers of different lengths (a policy with uncompressed layers): token by token, one eviction at the
            # end, which is what the single forward would have done
            with self.cache.held_eviction():
                outs = [self._forward(ids[:, j : j + 1], valid[:, j : j + 1], True) for j in range(ids.shape[1])]
            return torch.cat(outs, dim=1) if all_logits else outs[-1]
        mask, pos = self.cache.prepare(valid)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                         logits_to_keep=0 if all_logits else 1, **{self._kw: self.cache})
        return out.logits

    def prefill(self, ids: torch.Tensor, n_pad: Sequence[int], chunk: int | None = None,
                all_logits: bool = False) -> torch.Tensor:
        """ids [batch, P] left-padded; returns the logits of the last position [batch, vocab] (all positions
        [batch, P, vocab] with all_logits). chunk: prefill in pieces of this many tokens (evicting between)."""
        ids = ids.to(self.device)
        p = ids.shape[1]
        self.cache.begin([p - n for n in n_pad], list(n_pad))
        valid = torch.arange(p, device=self.device)[None, :] >= torch.tensor(list(n_pad), device=self.device)[:, None]
        step = chunk or p
        outs = []
        for s in range(0, p, step):
            logits = self._forward(ids[:, s : s + step], valid[:, s : s + step], all_logits)
            outs.append(logits)
        return torch.cat(outs, dim=1) if all_logits else outs[-1][:, -1]

    def fork(self, n_tokens: int) -> "Decoder":
        """A no-eviction Decoder continuing from a copy of this one's first `n_tokens` tokens (this one must not
        have evicted). Prefix reuse for occlusion and teacher-forcing runs."""
        dec = Decoder(self.model, "full", budget=None)
        dec.cache.load_prefix(self.cache, n_tokens)
        return dec

    def step(self, ids: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        """Feed new tokens ids [batch, T] (all real); returns the last logits [batch, vocab] (or all)."""
        ids = ids.to(self.device)
        logits = self._forward(ids, torch.ones_like(ids, dtype=torch.bool), all_logits)
        return logits if all_logits else logits[:, -1]


@dataclass
class GenerationResult:
    """What `generate` returns: per prompt its text, tokens and why it ended, and the run's statistics."""

    texts: list[str]
    """The generated text per prompt."""
    token_ids: list[list[int]]
    """Generated ids per prompt (EOS included when it ended the sequence)."""
    prompt_tokens: list[int]
    """Prompt length per prompt, in tokens."""
    finish_reasons: list[str]
    """Per prompt why it ended: 'eos', 'stop' (a stop string) or 'length' (max_new_tokens)."""
    stats: dict = field(default_factory=dict)
    """The run's statistics: max_cache_tokens and final_cache_tokens (the cache's size at its largest and at the end),
    evictions, prompt_tokens and new_tokens per prompt, seconds = prefill_seconds + decode_seconds, tokens_per_s,
    decode_tokens_per_s, policy, budget, tau, and the engine's own (kv_bytes ... for llama.cpp); as of the last token
    returned."""


@dataclass
class StepInfo:
    """What a streaming callback sees after each decode step (batch row 0's text is in `new_text`)."""

    step: int
    new_token_ids: list[int]
    new_text: str
    cache_tokens: int
    evictions: int
    tokens_per_s: float | None
    """Decode rate so far; None for the first steps, when it means nothing (live_rate)."""


def model_context(model) -> int | None:
    """The number of positions the model was trained for: its (text) config's max_position_embeddings (or
    n_positions / max_sequence_length / seq_length); None when the config names none."""
    cfg = model.config
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        v = getattr(text, name, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def check_context(model, policy: Policy, budget: int | None, prompt_tokens: int, max_new_tokens: int,
                  allow_beyond_context: bool = False) -> None:
    """Positions past the trained context give output the model was never trained to produce, so:
    a budget larger than the context (for a policy that evicts) is refused unless allow_beyond_context; a prompt
    longer than the context, or prompt + max_new_tokens past it while the cache can hold that many tokens (a policy
    that never evicts, or an allowed budget above the context), is a ContextWarning. A cache kept within a budget <=
    the context still counts positions up past it on a long generation (true positions): that is the method's
    setting and is not warned about."""
    ctx = model_context(model)
    if ctx is None:
        return
    if policy.evicts and budget is not None and budget > ctx and not allow_beyond_context:
        raise EpiKVError(f"budget {budget} is larger than the model's {ctx}-token context (max_position_embeddings): "
                         f"use a budget <= {ctx}, or allow_beyond_context=True (--allow-beyond-context) to run it")
    if prompt_tokens > ctx:
        warnings.warn(ContextWarning(f"the {prompt_tokens}-token prompt is longer than the model's {ctx}-token "
                                     "context: positions past it were never trained, expect degraded output",
                                     "prompt"), stacklevel=3)
        return
    reach = prompt_tokens + max_new_tokens
    cap = min(budget, reach) if policy.evicts and budget is not None else reach
    if cap > ctx:
        held = f"budget {budget}" if policy.evicts else f"{policy.name} keeps every token"
        warnings.warn(ContextWarning(f"prompt + max new tokens ({prompt_tokens} + {max_new_tokens}) may run past the "
                                     f"model's {ctx}-token context and the cache can hold them ({held}): output past "
                                     f"{ctx} tokens is not what the model was trained for", "cache"), stacklevel=3)


def encode_prompts(tokenizer, prompts: Sequence[str] | Sequence[Sequence[int]], chat: bool = False,
                   system: str | None = None) -> list[list[int]]:
    out = []
    for p in prompts:
        if isinstance(p, str):
            if not p.strip():
                raise EpiKVError("empty prompt")
            if chat:
                msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": p}]
                ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
                if isinstance(ids, dict) or hasattr(ids, "keys"):
                    ids = ids["input_ids"]
                ids = list(ids)
            else:
                ids = tokenizer(p, add_special_tokens=True)["input_ids"]
        else:
            ids = [int(t) for t in p]
        if not ids:
            raise EpiKVError("empty prompt")
        out.append(ids)
    return out


def left_pad(batch: list[list[int]], pad_id: int) -> tuple[torch.Tensor, list[int]]:
    width = max(len(x) for x in batch)
    n_pad = [width - len(x) for x in batch]
    return torch.tensor([[pad_id] * n + x for n, x in zip(n_pad, batch)]), n_pad


def eos_ids(model, tokenizer) -> list[int]:
    ids = model.generation_config.eos_token_id if getattr(model, "generation_config", None) else None
    if ids is None:
        ids = tokenizer.eos_token_id
    ids = ids if isinstance(ids, (list, tuple)) else [ids]
    return [int(i) for i in ids if i is not None]


def generate(model, tokenizer, prompts: str | Sequence[str] | Sequence[Sequence[int]], *,
             policy: str | Policy = DEFAULT_POLICY, budget: int | None = 1024, tau: int | None = None,
             max_new_tokens: int = 256, sampling: Sampling | None = None, stop: Iterable[str] = (),
             chat: bool = False, system: str | None = None, prefill_chunk: int | None = None,
             eos_token_ids: Sequence[int] | None = None, on_step: Callable[[StepInfo], None] | None = None,
             seeds: Sequence[int] | None = None, generation_config=None, allow_beyond_context: bool = False,
             **policy_settings) -> GenerationResult:
    """Generate for one prompt or a batch (left-padded; each sequence keeps its own tokens), the KV cache kept
    within `budget` tokens per sequence by evicting with `policy`.

    Args:
        model (transformers.PreTrainedModel): a transformers causal LM (`load_model(...).model`).
        tokenizer (transformers.PreTrainedTokenizerBase): its tokenizer.
        prompts: a string, a list of strings, or token ids (one list per prompt).
        policy: a registered policy name or a Policy object (default `DEFAULT_POLICY`, epikv-seg-q).
        budget: K, the tokens a sequence keeps, prompt included (ignored by `full`).
        tau: evict every tau tokens (the cache holds up to budget + tau - 1); None: the policy's own.
        max_new_tokens: tokens generated per prompt at most.
        sampling: a Sampling; None: greedy.
        stop: strings that end a sequence (the text ends before them).
        chat: feed the prompts through the tokenizer's chat template.
        system: a system message for the chat template.
        prefill_chunk: prefill the prompt in chunks of this many tokens (None: one forward).
        eos_token_ids: tokens that end a sequence (default: the model's).
        on_step: called after every decode step with a StepInfo (streaming).
        seeds: one sampling seed per prompt (default: Sampling.seed + row index).
        generation_config (transformers.GenerationConfig | None): instead of `sampling`; where it sets
            max_new_tokens (or max_length), eos_token_id or stop_strings, those win over the arguments.
        allow_beyond_context: run a budget above the model's trained context (max_position_embeddings), refused
            otherwise; a prompt longer than it, or a cache that may grow past it, warns (ContextWarning).
        **policy_settings (Any): the policy's own settings (its dataclass fields, e.g. recent=64).

    Returns:
        A GenerationResult: texts, token ids, finish reasons and statistics describing exactly the tokens returned.
    """
    if isinstance(prompts, str):
        prompts = [prompts]
    batch = None
    if generation_config is not None:
        if sampling is not None:
            raise EpiKVError("pass either sampling or generation_config, not both")
        sampling, over = from_generation_config(generation_config, model)
        if over.get("max_length") is not None:  # HF counts the (padded) prompt in max_length
            batch = encode_prompts(tokenizer, prompts, chat=chat, system=system)
            max_new_tokens = over["max_length"] - max(len(x) for x in batch)
            if max_new_tokens < 1:
                raise EpiKVError(f"generation_config.max_length {over['max_length']} leaves no room after the "
                                 f"{max(len(x) for x in batch)}-token prompt: set max_new_tokens")
        max_new_tokens = over.get("max_new_tokens", max_new_tokens)
        eos_token_ids = over.get("eos_token_ids", eos_token_ids)
        stop = over.get("stop", stop)
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise EpiKVError(f"max new tokens must be a positive integer, got {max_new_tokens!r}")
    if prefill_chunk is not None and prefill_chunk < 1:
        raise EpiKVError(f"prefill chunk must be a positive integer, got {prefill_chunk!r}")
    sampling = sampling or Sampling()
    stop = [s for s in stop if s]
    batch = batch or encode_prompts(tokenizer, prompts, chat=chat, system=system)
    if seeds is None:
        seeds = [sampling.seed + i for i in range(len(batch))]
    seeds = list(seeds)
    if len(seeds) != len(batch):
        raise EpiKVError(f"{len(seeds)} seeds for {len(batch)} prompts: give one seed per prompt")
    for s in seeds:
        _check_seed(s)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids, n_pad = left_pad(batch, pad_id)
    eos = list(eos_token_ids) if eos_token_ids is not None else eos_ids(model, tokenizer)
    pol = get_policy(policy, tau=tau, **policy_settings)
    check_context(model, pol, budget, max(len(x) for x in batch), max_new_tokens, allow_beyond_context)
    with torch.inference_mode(), attention_for(model, pol):
        dec = Decoder(model, pol, budget)
        run = decode_loop(dec, tokenizer, ids, n_pad, sampling=sampling, seeds=seeds, max_new_tokens=max_new_tokens,
                          eos=eos, stop=stop, pad_id=pad_id, on_step=on_step, prefill_chunk=prefill_chunk)
    return run.result([len(x) for x in batch], seeds)


@dataclass
class DecodeRun:
    """What decode_loop returns: the texts and ids (cut at EOS and stop strings), why each row ended, and the
    cache statistics and times as of the last token returned."""

    texts: list[str]
    token_ids: list[list[int]]
    finish_reasons: list[str]
    cache_stats: dict
    seconds: float
    prefill_seconds: float
    decode_steps: int
    policy: str
    budget: int | None
    tau: int

    def result(self, prompt_tokens: list[int], seeds: list[int], **extra) -> "GenerationResult":
        n_new = sum(len(r) for r in self.token_ids)
        seconds, t_prefill = self.seconds, self.prefill_seconds
        # seconds = prefill_seconds + decode_seconds; tokens_per_s over all of it, decode_tokens_per_s over the decode
        stats = dict(self.cache_stats, prompt_tokens=prompt_tokens, new_tokens=[len(r) for r in self.token_ids],
                     seconds=seconds, prefill_seconds=t_prefill, decode_seconds=seconds - t_prefill,
                     decode_steps=self.decode_steps, tokens_per_s=n_new / max(seconds, 1e-9),
                     decode_tokens_per_s=n_new / max(seconds - t_prefill, 1e-9), policy=self.policy,
                     budget=self.budget, tau=self.tau, seeds=seeds, **extra)
        return GenerationResult(texts=self.texts, token_ids=self.token_ids, prompt_tokens=prompt_tokens,
                                finish_reasons=self.finish_reasons, stats=stats)


def decode_loop(dec, tokenizer, ids: torch.Tensor, n_pad: Sequence[int], *, sampling: Sampling, seeds: Sequence[int],
                max_new_tokens: int, eos: Sequence[int], stop: Sequence[str], pad_id: int,
                on_step: Callable[[StepInfo], None] | None = None, prefill_chunk: int | None = None) -> DecodeRun:
    """The one decoding loop of every engine: prefill, then sample and feed one token a row a step until each row
    ends (EOS, a stop string, max_new_tokens), streaming through on_step; statistics as of the last token returned.

    `dec` is any engine's decoder: `device`, `prefill(ids [b, P], n_pad, chunk)` and `step(ids [b, 1])` returning
    next-token logits [b, vocab], `cache_stats()` (max_cache_tokens, final_cache_tokens, evictions), `policy`,
    `budget`, `tau`, and `host_sync` (True: read every step's tokens at once, an engine whose logits are on the
    host anyway; False: batch the reads, which cost a device sync each)."""
    dev = dec.device
    sampler = Sampler(sampling, seeds, ids, n_pad, max_new_tokens, dev)
    out = sampler.out  # [batch, max_new_tokens]
    eos_t = torch.tensor(list(eos) or [-1], device=dev)
    b = ids.shape[0]
    clock = _Clock(dev)
    t0, h0 = clock.mark(), time.perf_counter()
    logits = dec.prefill(ids, n_pad, chunk=prefill_chunk)
    t_pre, h_pre = clock.mark(), time.perf_counter() - h0
    finished = torch.zeros(b, dtype=torch.bool, device=dev)
    # Host reads are batched on a device engine: every step when streaming or checking stop strings, else every 16
    # steps. So the loop may run up to 15 steps past the end; each step's cache statistics and clock mark are kept
    # (host ints and an event, no sync) and the result reports them as of the true last step.
    sync_every = 1 if (on_step or stop or dec.host_sync) else 16
    decode = lambda r: tokenizer.decode(r, skip_special_tokens=True)  # noqa: E731
    # with stop strings, row 0's stream holds back what may begin one (epikv.stops: the one rule)
    stream = StopStream(decode, stop) if stop else None
    host_tokens: list[list[int]] = [[] for _ in range(b)]
    reasons = ["length"] * b
    synced = [0]  # decode steps already copied to the host
    marks: list[tuple[dict, object]] = []  # per step since `first`: (cache stats, clock mark) once it is chosen
    first = 0
    for step in range(max_new_tokens):
        nxt = sampler(logits, step).to(dev)
        nxt = torch.where(finished, torch.full_like(nxt, pad_id), nxt)
        out[:, step] = nxt
        marks.append((dec.cache_stats(), clock.mark()))
        finished = finished | torch.isin(nxt, eos_t)
        last = step == max_new_tokens - 1
        if (step + 1) % sync_every == 0 or last:
            fin_host = _sync_rows(out, synced, step + 1, host_tokens, eos, reasons, tokenizer, stop)
            if on_step:
                elapsed = time.perf_counter() - h0 - h_pre
                new_text = (stream.step(_trim(host_tokens[0], eos), fin_host[0] or last) if stream
                            else _new_text(tokenizer, host_tokens[0]))
                on_step(StepInfo(step=step, new_token_ids=host_tokens[0][-1:], new_text=new_text,
                                 cache_tokens=marks[-1][0]["final_cache_tokens"],
                                 evictions=marks[-1][0]["evictions"], tokens_per_s=live_rate(step + 1, elapsed)))
            if all(fin_host) or last:
                break
            finished = torch.tensor(fin_host, device=dev) | finished
            if not stop:  # rows still running end after this step: older marks are no longer needed
                first, marks = step + 1, []  # (a stop string may end a row some tokens back: keep them)
        logits = dec.step(nxt[:, None])
    token_ids = [_trim(row, eos) for row in host_tokens]
    texts = []
    for i, row in enumerate(token_ids):  # a stop string cuts text and ids alike (epikv.stops)
        text, token_ids[i], _ = cut_at_stop(decode, row, stop)
        texts.append(text)
    end = max(len(r) for r in token_ids) - 1  # the batch's true last step: its last row's final token
    cache_stats, t_end = marks[max(end, 0) - first]
    return DecodeRun(texts=texts, token_ids=token_ids, finish_reasons=reasons, cache_stats=cache_stats,
                     seconds=clock.between(t0, t_end), prefill_seconds=clock.between(t0, t_pre),
                     decode_steps=end + 1, policy=dec.policy.name, budget=dec.budget, tau=dec.tau)


class _Clock:
    """Timestamps of decode steps without a host sync: CUDA events on a GPU (read once at the end), the host clock
    elsewhere."""

    def __init__(self, device) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.device = device

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def between(self, a, b) -> float:
        if not self.cuda:
            return b - a
        b.synchronize()
        return a.elapsed_time(b) / 1000.0


_GC_MAPPED = {"do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "max_new_tokens",
              "max_length", "eos_token_id", "stop_strings"}
# plumbing that changes nothing about which tokens come out (or concerns model.generate's own cache)
_GC_IGNORED = {"transformers_version", "_from_model_config", "pad_token_id", "bos_token_id", "decoder_start_token_id",
               "use_cache", "cache_implementation", "cache_config", "compile_config", "disable_compile",
               "return_dict_in_generate", "early_stopping", "length_penalty", "low_memory"}
_GC_NO_CACHE = {"num_beams", "num_beam_groups", "num_return_sequences", "diversity_penalty", "penalty_alpha",
                "constraints", "force_words_ids", "prompt_lookup_num_tokens", "assistant_early_exit",
                "num_assistant_tokens", "num_assistant_tokens_schedule", "is_assistant"}


def from_generation_config(gc, model=None) -> tuple[Sampling, dict]:
    """A transformers GenerationConfig -> (Sampling, overrides for max_new_tokens / max_length / eos_token_ids /
    stop). Sampling settings it leaves unset come, as in model.generate, from `model.generation_config`, then from
    transformers' defaults (top_k 50 with do_sample). Anything else it sets that changes the tokens is refused."""
    diff = gc.to_diff_dict()  # what differs from this transformers version's defaults
    set_ = {k: v for k, v in diff.items() if k not in _GC_IGNORED}
    for k in ("num_beams", "num_return_sequences"):
        if set_.get(k) == 1:
            set_.pop(k)
    unsupported = sorted(k for k in set_ if k not in _GC_MAPPED)
    if unsupported:
        what = ", ".join(f"{k}={set_[k]!r}" for k in unsupported)
        if any(k in _GC_NO_CACHE for k in unsupported):
            raise EpiKVError(f"generation_config sets {what}: an evicting cache decodes one sequence per prompt (no "
                             "beam search, multiple return sequences or assisted decoding)")
        raise EpiKVError(f"generation_config sets {what}, which epikv.generate does not map (it maps do_sample, "
                         "temperature, top_k, top_p, min_p, repetition_penalty, max_new_tokens, eos_token_id, "
                         "stop_strings): use model.generate with cache=EpiKVCache(...) for other processors")
    get = _gc_resolver(gc, model)
    rp = get("repetition_penalty", 1.0)
    if get("do_sample", False):
        t = get("temperature", 1.0)
        if t == 0:
            raise EpiKVError("generation_config: do_sample with temperature 0; use do_sample=False for greedy")
        sampling = Sampling(temperature=t, top_k=get("top_k", 0), top_p=get("top_p", 1.0), min_p=get("min_p", 0.0),
                            repetition_penalty=rp)
    else:
        sampling = Sampling(repetition_penalty=rp)
    over: dict = {}
    if gc.max_new_tokens is not None:
        over["max_new_tokens"] = gc.max_new_tokens
    elif "max_length" in set_:
        over["max_length"] = gc.max_length
    if gc.eos_token_id is not None:
        e = gc.eos_token_id
        over["eos_token_ids"] = [int(i) for i in (e if isinstance(e, (list, tuple)) else [e])]
    if getattr(gc, "stop_strings", None):
        s = gc.stop_strings
        over["stop"] = [s] if isinstance(s, str) else list(s)
    return sampling, over


def _sync_rows(out, synced, n_done, host_tokens, eos, reasons, tokenizer, stop) -> list[bool]:
    """Copy new tokens to the host, apply EOS and stop strings; returns each row's finished flag."""
    rows = out[:, synced[0] : n_done].tolist()
    synced[0] = n_done
    fin = []
    for i, new in enumerate(rows):
        if reasons[i] == "length":  # still running before this copy
            host_tokens[i].extend(new)
            if any(t in eos for t in new):
                reasons[i] = "eos"
            elif stop and stop_index(tokenizer.decode(host_tokens[i][-64:], skip_special_tokens=True), stop) >= 0:
                reasons[i] = "stop"
        fin.append(reasons[i] != "length")
    return fin


def _new_text(tokenizer, row: list[int]) -> str:
    """Text the newest token adds, decoded with a little context so merged bytes and spaces come out right."""
    if not row:
        return ""
    ctx = row[-8:]
    full = tokenizer.decode(ctx, skip_special_tokens=True)
    prev = tokenizer.decode(ctx[:-1], skip_special_tokens=True)
    return full[len(prev):] if full.startswith(prev) else tokenizer.decode(ctx[-1:], skip_special_tokens=True)


def _trim(row: list[int], eos: list[int]) -> list[int]:
    for j, t in enumerate(row):
        if t in eos:
            return row[: j + 1]
    return row

