"""Counterfactual occlusion labels over a trace's reasoning span (METHOD.md section 5).

A window of `window` reasoning tokens (stride `stride`) is replaced by a filler token, keeping the length. Two labels:
- "nll" (continuous, any model): increase of the answer's mean negative log-likelihood under occlusion (teacher
  forcing, no generation). A token's label is the largest increase over the windows that cover it.
- "flip" (the authors'): regenerate the answer greedily after the occluded reasoning; 1 if the extracted answer
  differs from the clean regeneration's. A token is important if any covering window flipped (OR).
Prompt and answer tokens get no label (None).

The prefix cache is reused: the clean text is run once; for a window starting at s, the cache of the first s tokens
(which occlusion at s cannot change) is forked, so each window costs one pass over the suffix only.

Record format (one JSON object per trace, one line each in DIR/labels.jsonl), shareable without the traces' text
when written with include_text=False:
  id, model, label ("nll" | "flip"), filler ("eos" | "pad" | "random"; "pad" is refused when the pad token is the
  EOS token), filler_id and filler_token (the occluding token's id and text; null for random), settings {window, stride,
  answer_tokens, max_reasoning_tokens, regen_tokens, seed}, token_ids, offsets ([start, end) character offsets of
  every token into prompt + trace after "<think>\\n", i.e. the source's full_cot), tokens (decoded text of every
  token, optional), reasoning [start, end) and answer [start, end) token ranges, labels (one per token, null outside
  the reasoning span), windows ([start, end, value] per window), clean (clean answer NLL or regenerated answer),
  truncated_from (reasoning tokens before capping, or null), seconds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..eval.grading import last_boxed, last_number
from ..engine import Decoder
from ..errors import EpiKVError

THINK_OPEN = "<think>\n"
FILLERS = ("eos", "pad", "random")


@dataclass
class Spans:
    """Token ranges of one labelled sequence: reasoning [r0, r1), answer [r1, a1)."""

    r0: int
    r1: int
    a1: int


def windows(r0: int, r1: int, window: int, stride: int) -> list[tuple[int, int]]:
    """Windows [s, e) sliding over the reasoning span [r0, r1); the last ones are clipped at r1."""
    if window < 1 or stride < 1:
        raise EpiKVError(f"window and stride must be positive, got {window} and {stride}")
    if stride > window:
        raise EpiKVError(f"stride {stride} is larger than the window {window}: some reasoning tokens would never be "
                         "occluded")
    return [(s, min(s + window, r1)) for s in range(r0, r1, stride)]


def token_labels(n: int, wins: list[tuple[int, int]], values: list[float], kind: str) -> list[float | None]:
    """Per-token label from window values: max over covering windows (OR for flip labels); None outside windows."""
    out: list[float | None] = [None] * n
    for (s, e), v in zip(wins, values):
        for t in range(s, e):
            out[t] = v if out[t] is None else max(out[t], v)
    if kind == "flip":
        out = [None if x is None else float(x > 0) for x in out]
    return out


def filler_token(tokenizer, filler: str) -> int | None:
    """The token id a filler occludes with (None for "random"). "pad" is refused when the pad token is the EOS token
    (SmolLM2, and any tokenizer without a pad token, which `load_model` gives EOS as pad): it would be "eos" again."""
    if filler == "random":
        return None
    if filler not in FILLERS:
        raise EpiKVError(f"unknown filler {filler!r}; choose one of {', '.join(FILLERS)}")
    tid = tokenizer.eos_token_id if filler == "eos" else tokenizer.pad_token_id
    if tid is None:
        raise EpiKVError(f"the tokenizer has no {filler} token; choose another --filler")
    if filler == "pad" and tid == tokenizer.eos_token_id:
        raise EpiKVError(f"--filler pad: this model's pad token is its EOS token ({tokenizer.eos_token!r}, id {tid}), "
                         "so it would be the same as --filler eos; use --filler eos or random")
    return int(tid)


def filler_ids(tokenizer, filler: str, length: int, vocab: int, seed: int) -> torch.Tensor:
    tid = filler_token(tokenizer, filler)
    if tid is None:  # random
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(0, vocab, (length,), generator=gen)
    return torch.full((length,), tid, dtype=torch.long)


# -- spans of a trace ------------------------------------------------------------------------------------------------
def trace_text(row: dict) -> tuple[str, int]:
    """The full text (prompt + reasoning + answer) and the prompt's length in characters."""
    prompt, trace = row.get("prompt"), row.get("trace")
    if not isinstance(prompt, str) or not isinstance(trace, str):
        raise EpiKVError(f"trace {row.get('id')!r} needs string fields 'prompt' and 'trace'")
    body = trace[len(THINK_OPEN):] if trace.startswith(THINK_OPEN) and prompt.endswith(THINK_OPEN) else trace
    return prompt + body, len(prompt)


def answer_char(text: str, prompt_chars: int) -> int | None:
    """Where the answer starts: first non-space character after </think>, else the last \\boxed{, else None."""
    i = text.find("</think>", prompt_chars)
    if i >= 0:
        m = re.compile(r"\S").search(text, i + len("</think>"))
        if m:
            return m.start()
    j = text.rfind("\\boxed{")
    return j if j >= prompt_chars else None


def tokenize_trace(tokenizer, row: dict, answer_tokens: int, max_reasoning: int | None):
    """Token ids, character offsets and spans of a trace, the reasoning capped to its first `max_reasoning` tokens
    (the answer is kept right after the cap). Returns (ids, offsets, spans, reasoning tokens before the cap)."""
    text, p_chars = trace_text(row)
    enc = tokenizer(text, add_special_tokens=True, return_offsets_mapping=True)
    ids, offs = list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
    first_after = lambda c: next((i for i, (a, b) in enumerate(offs) if b > c and b > a), len(ids))  # noqa: E731
    r0 = first_after(p_chars)
    a_c = answer_char(text, p_chars)
    r1 = first_after(a_c) if a_c is not None else max(r0, len(ids) - 64)
    if r1 <= r0 or r1 >= len(ids):
        raise EpiKVError(f"trace {row.get('id')!r} has no reasoning span followed by an answer")
    full_reasoning = r1 - r0
    a1 = min(len(ids), r1 + answer_tokens)
    if max_reasoning and full_reasoning > max_reasoning:
        keep = list(range(r0 + max_reasoning)) + list(range(r1, a1))
        ids, offs = [ids[i] for i in keep], [offs[i] for i in keep]
        r1 = r0 + max_reasoning
        a1 = len(ids)
    else:
        ids, offs = ids[:a1], offs[:a1]
    return ids, [list(o) for o in offs], Spans(r0, r1, a1), full_reasoning


# -- the prefix cache --------------------------------------------------------------------------------------------------
def _answer_nll(dec: Decoder, before: torch.Tensor, answer: torch.Tensor) -> float:
    """Mean NLL of `answer` [1, A] after feeding `before` [1, m] (m >= 1) to a forked decoder."""
    last = dec.step(before)  # [1, vocab]: predicts answer[0]
    logits = [last[:, None]]
    if answer.shape[1] > 1:
        logits.append(dec.step(answer[:, :-1], all_logits=True))  # [1, A - 1, vocab]
    logp = torch.cat(logits, dim=1).float().log_softmax(-1)  # [1, A, vocab]
    return float(-logp.gather(-1, answer[..., None]).mean())


def extract_answer(text: str) -> str | None:
    """The last \\boxed{...} (the graders' extractor), else the last number; normalised for comparison."""
    ans = last_boxed(text)
    if ans is None:
        ans = last_number(text)
    return _norm(ans) if ans is not None else None


def _norm(ans: str) -> str:
    ans = ans.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace(" ", "").replace(",", "")
    return ans.rstrip(".").removesuffix(".0") if re.fullmatch(r"-?\d+\.0", ans) else ans.rstrip(".")


def _regenerate(dec: Decoder, before: torch.Tensor, tokenizer, eos: set[int], max_tokens: int) -> tuple[str, list]:
    """Greedy continuation after feeding `before`; stops at EOS or when a \\boxed{} answer has closed."""
    logits = dec.step(before)
    out: list[int] = []
    for _ in range(max_tokens):
        nxt = int(logits.argmax(-1))
        if nxt in eos:
            break
        out.append(nxt)
        if len(out) % 8 == 0:
            text = tokenizer.decode(out, skip_special_tokens=True)
            if last_boxed(text) is not None:
                break
        logits = dec.step(torch.tensor([[nxt]], device=dec.device))
    text = tokenizer.decode(out, skip_special_tokens=True)
    return extract_answer(text), text


def occlusion_labels(model, tokenizer, ids: list[int], spans: Spans, *, kind: str = "nll", window: int = 32,
                     stride: int = 16, filler: str = "eos", regen_tokens: int = 512, seed: int = 0,
                     progress=None) -> dict:
    """Window values and per-token labels for one sequence. Returns {"windows", "labels", "clean", "filler_id"}."""
    if kind not in ("nll", "flip"):
        raise EpiKVError(f"unknown label {kind!r}; choose nll or flip")
    if not 0 < spans.r0 < spans.r1 < spans.a1 <= len(ids):
        raise EpiKVError(f"bad spans {spans} for {len(ids)} tokens: need prompt, reasoning and answer")
    wins = windows(spans.r0, spans.r1, window, stride)
    filler_token(tokenizer, filler)  # a refused filler fails before any model pass
    vocab = model.get_input_embeddings().weight.shape[0]
    x = torch.tensor([ids])
    eos = {int(t) for t in ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])}
    with torch.inference_mode():
        base = Decoder(model, "full", budget=None)
        base.prefill(x[:, : spans.r0], [0])
        if spans.r1 > spans.r0 + 1:
            base.step(x[:, spans.r0 : spans.r1 - 1])  # every prefix a window can start at
        answer = x[:, spans.r1 : spans.a1]

        def evaluate(s: int, seq: torch.Tensor):
            dec = base.fork(s)
            if kind == "nll":
                return _answer_nll(dec, seq[:, s : spans.r1], answer)
            return _regenerate(dec, seq[:, s : spans.r1], tokenizer, eos, regen_tokens)

        clean = evaluate(spans.r0, x)
        values, fillers = [], []
        for k, (s, e) in enumerate(wins):
            fill = filler_ids(tokenizer, filler, e - s, vocab, seed + k)
            occ = x.clone()
            occ[0, s:e] = fill
            res = evaluate(s, occ)
            values.append(res - clean if kind == "nll" else float(res[0] != clean[0]))
            fillers.append(res[0] if kind == "flip" else None)
            if progress is not None:
                progress.update(1)
    labels = token_labels(len(ids), wins, values, kind)
    fid = filler_token(tokenizer, filler)
    out = {"windows": [[s, e, v] for (s, e), v in zip(wins, values)], "labels": labels, "filler_id": fid,
           "filler_token": None if fid is None else tokenizer.convert_ids_to_tokens(fid)}
    if kind == "nll":
        out["clean"] = {"answer_nll": clean}
    else:
        out["clean"] = {"answer": clean[0], "text": clean[1]}
        out["window_answers"] = fillers
    return out
