"""The decoding loop every entry point uses: prefill, decode, sampling, stop rules, eviction, statistics.

`Decoder` owns one batch's cache and feeds tokens with true positions and the compacted padding mask;
`generate` runs prompts to completion on top of it.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import torch

from .cache import EpiKVCache, cache_kwarg
from .errors import EpiKVError
from .policies import Policy, get_policy


@dataclass
class Sampling:
    """temperature 0 = greedy; otherwise temperature, then top-k (0 = off), then top-p (1 = off)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0):
            raise EpiKVError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise EpiKVError(f"top-p must be in (0, 1], got {self.top_p!r}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise EpiKVError(f"top-k must be an integer >= 0, got {self.top_k!r}")


def sample(logits: torch.Tensor, cfg: Sampling, gen: torch.Generator | None) -> torch.Tensor:
    """logits [batch, vocab] -> token ids [batch]."""
    if cfg.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / cfg.temperature
    if cfg.top_k:
        kth = logits.topk(min(cfg.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= cfg.top_p  # tokens after the nucleus is complete
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return torch.multinomial(logits.softmax(-1), 1, generator=gen).squeeze(-1)


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

    def __init__(self, model, policy: str | Policy = "epikv", budget: int | None = 1024, tau: int | None = None,
                 **policy_settings) -> None:
        self.model = model
        self.cache = EpiKVCache(model, policy, budget, tau, **policy_settings)
        self.policy = self.cache.policy
        self._kw = cache_kwarg(model)
        self.device = self.cache.home

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
    texts: list[str]
    token_ids: list[list[int]]  # generated ids per prompt (EOS included when it ended the sequence)
    prompt_tokens: list[int]
    finish_reasons: list[str]  # "eos" | "stop" | "length"
    stats: dict = field(default_factory=dict)


@dataclass
class StepInfo:
    """What a streaming callback sees after each decode step (batch row 0's text is in `new_text`)."""

    step: int
    new_token_ids: list[int]
    new_text: str
    cache_tokens: int
    evictions: int
    tokens_per_s: float


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
             policy: str | Policy = "epikv", budget: int | None = 1024, tau: int | None = None,
             max_new_tokens: int = 256, sampling: Sampling | None = None, stop: Iterable[str] = (),
             chat: bool = False, system: str | None = None, prefill_chunk: int | None = None,
             eos_token_ids: Sequence[int] | None = None, on_step: Callable[[StepInfo], None] | None = None,
             **policy_settings) -> GenerationResult:
    """Generate for one prompt or a batch (left-padded; each sequence keeps its own tokens)."""
    if isinstance(prompts, str):
        prompts = [prompts]
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise EpiKVError(f"max new tokens must be a positive integer, got {max_new_tokens!r}")
    if prefill_chunk is not None and prefill_chunk < 1:
        raise EpiKVError(f"prefill chunk must be a positive integer, got {prefill_chunk!r}")
    sampling = sampling or Sampling()
    stop = [s for s in stop if s]
    batch = encode_prompts(tokenizer, prompts, chat=chat, system=system)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids, n_pad = left_pad(batch, pad_id)
    eos = list(eos_token_ids) if eos_token_ids is not None else eos_ids(model, tokenizer)
    pol = get_policy(policy, tau=tau, **policy_settings)
    with torch.inference_mode(), attention_for(model, pol):
        dec = Decoder(model, pol, budget)
        dev = dec.device
        gen = None
        if sampling.temperature > 0:
            gen = torch.Generator(device=dev)
            gen.manual_seed(sampling.seed)
        eos_t = torch.tensor(eos or [-1], device=dev)
        b = ids.shape[0]
        t0 = time.perf_counter()
        logits = dec.prefill(ids, n_pad, chunk=prefill_chunk)
        t_prefill = time.perf_counter() - t0
        out = torch.full((b, max_new_tokens), pad_id, dtype=torch.long, device=dev)
        finished = torch.zeros(b, dtype=torch.bool, device=dev)
        # Host reads are batched: every step when streaming or checking stop strings, else every 16 steps.
        sync_every = 1 if (on_step or stop) else 16
        host_tokens: list[list[int]] = [[] for _ in range(b)]
        reasons = ["length"] * b
        synced = [0]  # decode steps already copied to the host
        n_done = 0
        for step in range(max_new_tokens):
            nxt = sample(logits, sampling, gen)
            nxt = torch.where(finished, torch.full_like(nxt, pad_id), nxt)
            out[:, step] = nxt
            finished = finished | torch.isin(nxt, eos_t)
            n_done = step + 1
            last = step == max_new_tokens - 1
            if (step + 1) % sync_every == 0 or last:
                fin_host = _sync_rows(out, synced, n_done, host_tokens, eos, reasons, tokenizer, stop)
                if on_step:
                    elapsed = time.perf_counter() - t0 - t_prefill
                    on_step(StepInfo(step=step, new_token_ids=host_tokens[0][-1:],
                                     new_text=_new_text(tokenizer, host_tokens[0]),
                                     cache_tokens=dec.cache.get_seq_length(), evictions=dec.cache.evictions,
                                     tokens_per_s=(step + 1) / max(elapsed, 1e-9)))
                if all(fin_host):
                    break
                finished = torch.tensor(fin_host, device=dev) | finished
            if last:
                break
            logits = dec.step(nxt[:, None])
        seconds = time.perf_counter() - t0
    token_ids = [_trim(row, eos) for row in host_tokens]
    texts = [_cut_stop(tokenizer.decode(row, skip_special_tokens=True), stop) for row in token_ids]
    n_new = sum(len(r) for r in token_ids)
    decode_s = max(seconds - t_prefill, 1e-9)
    stats = dict(dec.cache.stats(), prompt_tokens=[len(x) for x in batch], new_tokens=[len(r) for r in token_ids],
                 seconds=seconds, prefill_seconds=t_prefill, decode_steps=n_done,
                 tokens_per_s=n_new / decode_s, policy=dec.policy.name, budget=dec.cache.budget, tau=dec.cache.tau)
    return GenerationResult(texts=texts, token_ids=token_ids, prompt_tokens=[len(x) for x in batch],
                            finish_reasons=reasons, stats=stats)


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
            elif stop and any(s in tokenizer.decode(host_tokens[i][-64:], skip_special_tokens=True) for s in stop):
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


def _cut_stop(text: str, stop: list[str]) -> str:
    cuts = [text.index(s) + len(s) for s in stop if s in text]
    return text[: min(cuts)] if cuts else text
