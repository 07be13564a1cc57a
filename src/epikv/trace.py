"""Per-token scores of a policy over a text, and which tokens it would evict at a budget (`epikv trace`)."""

from __future__ import annotations

import html
from dataclasses import dataclass

import torch

from .engine import Decoder
from .errors import EpiKVError


@dataclass
class TokenTrace:
    tokens: list[str]  # decoded text of each token
    scores: list[float]  # the score the evicting pass's policy gave each token when it entered the cache
    evicted: list[bool]  # evicted by the end of the text at `budget`
    is_prompt: list[bool]
    policy: str
    budget: int


def trace_scores(model, tokenizer, prompt_ids: list[int], completion_ids: list[int], policy: str = "epikv",
                 budget: int = 256, tau: int = 1, **settings) -> TokenTrace:
    """Stream prompt + completion through the model once, evicting at `budget` in chunks of `tau` as during
    generation, and record every token's score as the policy computes it on arrival (evicted tokens included).

    The colours and the strike-through come from the same pass: once tokens are evicted, later tokens' hidden states
    (hence their scores) differ from what a pass without eviction would give."""
    from .policies import get_policy
    from .policies.hidden import HiddenStatePolicy

    if not prompt_ids:
        raise EpiKVError("empty prompt")
    if not completion_ids:
        raise EpiKVError("empty text to trace")
    pol = get_policy(policy, tau=tau, **settings)
    if not isinstance(pol, HiddenStatePolicy):
        raise EpiKVError(f"policy {pol.name} has no per-token score to trace (it scores at eviction time); "
                         "trace an EPIKV policy: epikv, epikv-raw, epikv-a, epikv-band")
    ids = torch.tensor([prompt_ids + completion_ids])
    n, p = ids.shape[1], len(prompt_ids)
    arrived: list[torch.Tensor] = []  # scores of the real tokens of each forward, in order
    with torch.inference_mode():
        dec = Decoder(model, pol, budget=budget)
        on_tokens = dec.policy.on_tokens  # the cache's own policy instance

        def recording(state, obs):
            out = on_tokens(state, obs)
            arrived.append(out["score"][0][obs.valid[0]].float().cpu())  # [T] (batch of one)
            return out

        dec.policy.on_tokens = recording  # this instance only: what the policy computes is unchanged
        dec.prefill(ids[:, :p], [0])
        for s in range(p, n, tau):
            dec.step(ids[:, s : s + tau])
        kept = set(dec.cache.token_data["pos"][0].tolist())
    scores = torch.cat(arrived).tolist()
    if len(scores) != n:  # every token is scored exactly once, on arrival
        raise RuntimeError(f"trace recorded {len(scores)} scores for {n} tokens")
    tokens = token_texts(tokenizer, prompt_ids + completion_ids)
    return TokenTrace(tokens=tokens, scores=scores, evicted=[i not in kept for i in range(n)],
                      is_prompt=[i < p for i in range(n)], policy=pol.name, budget=budget)


def token_texts(tokenizer, ids: list[int], max_group: int = 8) -> list[str]:
    """The text of each token. A byte-level tokenizer splits a CJK character or an emoji into tokens that each hold
    an incomplete UTF-8 sequence (decoded alone: U+FFFD); such a token is decoded together with the next ones until
    the group decodes cleanly, the group's text going to its first token and "" to the rest. A sequence that never
    completes within max_group tokens keeps the tokens' own decodings."""
    out: list[str] = []
    i = 0
    while i < len(ids):
        text, j = tokenizer.decode([ids[i]]), i + 1
        while "\ufffd" in text and j < len(ids) and j - i < max_group:
            j += 1
            text = tokenizer.decode(ids[i:j])
        if "\ufffd" in text and j > i + 1:  # never completed: not a split character
            text, j = tokenizer.decode([ids[i]]), i + 1
        out.append(text)
        out.extend([""] * (j - i - 1))
        i = j
    return out


def _colour(score: float, scale: float) -> tuple[int, int, int]:
    """Diverging colour: high scores (kept, 'epiphany') orange-red, low scores blue, zero white."""
    x = max(-1.0, min(1.0, score / scale)) if scale > 0 else 0.0
    if x >= 0:
        return 255, int(255 - 120 * x), int(255 - 200 * x)
    return int(255 + 200 * x), int(255 + 120 * x), 255


def _scale(tr: TokenTrace) -> float:
    vals = sorted(abs(s) for s, p in zip(tr.scores, tr.is_prompt) if not p)
    return vals[int(0.95 * (len(vals) - 1))] if vals else 1.0


def render_terminal(tr: TokenTrace, console=None) -> None:
    from rich.console import Console
    from rich.text import Text

    console = console or Console()
    scale = _scale(tr)
    text = Text()
    for tok, s, ev, pr in zip(tr.tokens, tr.scores, tr.evicted, tr.is_prompt):
        if pr:
            text.append(tok, style="dim")
            continue
        r, g, b = _colour(s, scale)
        text.append(tok, style=f"black on rgb({r},{g},{b})" + (" strike" if ev else ""))
    console.print(text)
    n_ev = sum(tr.evicted)
    console.print(f"[bold]{tr.policy}[/] at K={tr.budget}: {n_ev} of {len(tr.tokens)} tokens evicted (struck through); "
                  "orange = high score (kept first), blue = low score; prompt dimmed.")


def render_html(tr: TokenTrace) -> str:
    scale = _scale(tr)
    spans = []
    for i, (tok, s, ev, pr) in enumerate(zip(tr.tokens, tr.scores, tr.evicted, tr.is_prompt)):
        r, g, b = (235, 235, 235) if pr else _colour(s, scale)
        style = f"background:rgb({r},{g},{b})" + (";text-decoration:line-through;opacity:.55" if ev else "")
        spans.append(f'<span title="#{i} score {s:.3f}{" evicted" if ev else ""}" style="{style}">'
                     f"{html.escape(tok)}</span>")
    n_ev = sum(tr.evicted)
    return ("<!doctype html><html><head><meta charset='utf-8'><title>epikv trace</title>"
            "<style>body{font-family:sans-serif;max-width:60em;margin:2em auto}"
            ".t{font-family:monospace;white-space:pre-wrap;line-height:1.6}</style></head><body>"
            f"<h3>{html.escape(tr.policy)} scores, K={tr.budget}: {n_ev} of {len(tr.tokens)} tokens evicted</h3>"
            "<p>Orange: high score (kept first, the method's 'epiphanies'); blue: low; grey: prompt (protected); "
            "struck through: evicted by the end. Hover a token for its score.</p>"
            f"<div class='t'>{''.join(spans)}</div></body></html>")


def render_png(tr: TokenTrace, path: str) -> None:
    import matplotlib.pyplot as plt

    fig = png_figure(tr)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def png_figure(tr: TokenTrace):
    """The score over positions, each token coloured by its score as in the HTML and terminal views (orange high,
    blue low); evicted tokens drawn as crosses, kept ones as dots; the legend outside the axes, over no point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    n = len(tr.tokens)
    xs = list(range(n))
    scale = _scale(tr)
    colour = lambda i: tuple(c / 255 for c in _colour(tr.scores[i], scale))  # noqa: E731
    fig, ax = plt.subplots(figsize=(13, 4))
    ax.plot(xs, tr.scores, lw=0.7, color="0.6", zorder=1)
    ev = [i for i in xs if tr.evicted[i]]
    kept = [i for i in xs if not tr.evicted[i] and not tr.is_prompt[i]]
    ax.scatter(kept, [tr.scores[i] for i in kept], s=14, c=[colour(i) for i in kept], edgecolors="0.35",
               linewidths=0.4, zorder=2)
    ax.scatter(ev, [tr.scores[i] for i in ev], s=22, c=[colour(i) for i in ev], marker="X", edgecolors="black",
               linewidths=0.4, zorder=2)
    p_end = sum(tr.is_prompt)
    ax.axvspan(0, p_end, color="0.9", zorder=0)
    top = sorted(kept, key=lambda i: -tr.scores[i])[:12]
    for i in top:
        ax.annotate(repr(tr.tokens[i].strip())[1:-1][:12], (i, tr.scores[i]), fontsize=7, rotation=45)
    ax.set_xlabel("token position")
    ax.set_ylabel(f"{tr.policy} score")
    ax.set_title(f"{tr.policy} per-token score, K={tr.budget}: {len(ev)} of {n} evicted")
    handles = [Line2D([], [], ls="", marker="o", mfc=tuple(c / 255 for c in _colour(scale, scale)), mec="0.35",
                      label="high score"),
               Line2D([], [], ls="", marker="o", mfc=tuple(c / 255 for c in _colour(-scale, scale)), mec="0.35",
                      label="low score"),
               Line2D([], [], ls="", marker="o", mfc="white", mec="0.35", label="kept"),
               Line2D([], [], ls="", marker="X", mfc="white", mec="black", label="evicted"),
               Patch(color="0.9", label="prompt (protected)")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, borderaxespad=0)
    fig.tight_layout()
    return fig
