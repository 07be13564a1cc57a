"""Per-token scores of a policy over a text, and which tokens it would evict at a budget (`epikv trace`).

A policy that scores each token once, on arrival (the EPIKV family), is shown by that score; any other policy with
one keep set per sequence (Seg-Q's relevance at eviction, streaming, h2o ...) by its keep set over time: when each
token left the cache."""

from __future__ import annotations

import html
from dataclasses import dataclass

import torch

from .engine import Decoder, attention_for
from .errors import EpiKVError


@dataclass
class TokenTrace:
    tokens: list[str]  # decoded text of each token
    scores: list[float] | None  # the score the evicting pass's policy gave each token when it entered the cache;
    # None: the policy gives none on arrival (it ranks at eviction time, or keeps by position): see evicted_at
    evicted: list[bool]  # evicted by the end of the text at `budget`
    is_prompt: list[bool]
    policy: str
    budget: int
    evicted_at: list[int | None] | None = None  # tokens fed when it left the cache (None: kept to the end)
    steps: list[int] | None = None  # tokens fed after each forward: the times the keep set was read


def traceable(cls) -> str | None:
    """Why a policy class cannot be traced (one line), or None: it must evict, with one keep set per sequence."""
    if not cls.evicts:
        return f"policy {cls.name} never evicts: there is nothing to trace"
    if cls.granularity != "token":
        return f"policy {cls.name} keeps a separate token set per {cls.granularity}, so no one keep set to show"
    from .support import torch_refusal

    return torch_refusal(cls())  # the trace runs in the torch engine (context-shift does not)


def traceable_names() -> list[str]:
    from .policies import REGISTRY

    return [name for name, cls in REGISTRY.items() if traceable(cls) is None]


def trace_scores(model, tokenizer, prompt_ids: list[int], completion_ids: list[int], policy: str = "epikv",
                 budget: int = 256, tau: int | None = None, **settings) -> TokenTrace:
    """Stream prompt + completion through the model once, evicting at `budget` in chunks of `tau` (default: the
    policy's own) as during generation, and record when each token left the cache and, for a policy that scores a
    token on arrival (token data "score"), that score as the policy computed it (evicted tokens included).

    The colours and the strike-through come from the same pass: once tokens are evicted, later tokens' hidden states
    (hence their scores) differ from what a pass without eviction would give."""
    from .policies import get_policy

    if not prompt_ids:
        raise EpiKVError("empty prompt")
    if not completion_ids:
        raise EpiKVError("empty text to trace")
    pol = get_policy(policy, tau=tau, **settings)
    why = traceable(type(pol))
    if why:
        raise EpiKVError(f"{why}; trace one of: {', '.join(traceable_names())}")
    tau = pol.tau
    ids = torch.tensor([prompt_ids + completion_ids])
    n, p = ids.shape[1], len(prompt_ids)
    arrived: list[torch.Tensor | None] = []  # scores of the real tokens of each forward, in order (None: no score)
    evicted_at: dict[int, int] = {}
    steps: list[int] = []
    with torch.inference_mode(), attention_for(model, pol):  # eager only for a policy reading attention weights
        dec = Decoder(model, pol, budget=budget)
        on_tokens = dec.policy.on_tokens  # the cache's own policy instance

        def recording(state, obs):
            out = on_tokens(state, obs)
            s = None if dec.policy.ages else out.get("score")  # an ageing rank: its keep set, not its arrival score
            arrived.append(None if s is None or s.dim() != 2 else s[0][obs.valid[0]].float().cpu())  # [T]
            return out

        def read_keep(fed: int) -> None:
            kept = set(dec.cache.token_data["pos"][0].tolist())
            for i in range(fed):
                if i not in kept and i not in evicted_at:
                    evicted_at[i] = fed
            steps.append(fed)

        dec.policy.on_tokens = recording  # this instance only: what the policy computes is unchanged
        dec.prefill(ids[:, :p], [0])
        read_keep(p)
        for s in range(p, n, tau):
            dec.step(ids[:, s : s + tau])
            read_keep(min(s + tau, n))
    scores = None
    if arrived and all(a is not None for a in arrived):
        scores = torch.cat(arrived).tolist()
        if len(scores) != n:  # every token is scored exactly once, on arrival
            raise RuntimeError(f"trace recorded {len(scores)} scores for {n} tokens")
    tokens = token_texts(tokenizer, prompt_ids + completion_ids)
    return TokenTrace(tokens=tokens, scores=scores, evicted=[i in evicted_at for i in range(n)],
                      is_prompt=[i < p for i in range(n)], policy=pol.name, budget=budget,
                      evicted_at=[evicted_at.get(i) for i in range(n)], steps=steps)


def stayed(tr: TokenTrace) -> list[float]:
    """Per token, the share of the text after it during which it stayed cached, mapped to [-1, 1]: 1 kept to the
    end, -1 evicted as soon as it arrived (what the views colour by when there is no score)."""
    n = len(tr.tokens)
    at = tr.evicted_at or [None] * n
    return [1.0 if e is None else 2.0 * (e - 1 - i) / max(1, n - 1 - i) - 1.0 for i, e in enumerate(at)]


def _values(tr: TokenTrace) -> tuple[list[float], float]:
    """What the views colour by, and its scale: the score, or without one the time a token stayed cached."""
    if tr.scores is not None:
        return tr.scores, _scale(tr)
    return stayed(tr), 1.0


def _legend(tr: TokenTrace) -> str:
    if tr.scores is not None:
        return "orange = high score (kept first), blue = low score"
    return ("no score on arrival: coloured by how long each token stayed cached, orange = to the end, blue = evicted "
            "soon after it arrived")

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
    values, scale = _values(tr)
    text = Text()
    for tok, s, ev, pr in zip(tr.tokens, values, tr.evicted, tr.is_prompt):
        if pr:
            text.append(tok, style="dim")
            continue
        r, g, b = _colour(s, scale)
        text.append(tok, style=f"black on rgb({r},{g},{b})" + (" strike" if ev else ""))
    console.print(text)
    n_ev = sum(tr.evicted)
    console.print(f"[bold]{tr.policy}[/] at K={tr.budget}: {n_ev} of {len(tr.tokens)} tokens evicted (struck through); "
                  f"{_legend(tr)}; prompt dimmed.")


def render_html(tr: TokenTrace) -> str:
    values, scale = _values(tr)
    at = tr.evicted_at or [None] * len(tr.tokens)
    spans = []
    for i, (tok, s, ev, pr) in enumerate(zip(tr.tokens, values, tr.evicted, tr.is_prompt)):
        r, g, b = (235, 235, 235) if pr else _colour(s, scale)
        style = f"background:rgb({r},{g},{b})" + (";text-decoration:line-through;opacity:.55" if ev else "")
        what = f" score {s:.3f}" if tr.scores is not None else ""
        gone = f" evicted after token #{at[i] - 1}" if at[i] is not None else (" evicted" if ev else "")
        spans.append(f'<span title="#{i}{what}{gone}" style="{style}">{html.escape(tok)}</span>')
    n_ev = sum(tr.evicted)
    return ("<!doctype html><html><head><meta charset='utf-8'><title>epikv trace</title>"
            "<style>body{font-family:sans-serif;max-width:60em;margin:2em auto}"
            ".t{font-family:monospace;white-space:pre-wrap;line-height:1.6}</style></head><body>"
            f"<h3>{html.escape(tr.policy)} {'scores' if tr.scores is not None else 'keep set'}, K={tr.budget}: "
            f"{n_ev} of {len(tr.tokens)} tokens evicted</h3>"
            + ("<p>Orange: high score (kept first, the method's 'epiphanies'); blue: low; grey: prompt (protected); "
               "struck through: evicted by the end. Hover a token for its score.</p>" if tr.scores is not None else
               f"<p>{html.escape(tr.policy)} gives no score on arrival: each token is coloured by how long it stayed "
               "in the cache (orange: to the end; blue: evicted soon after it arrived); grey: prompt (protected); "
               "struck through: evicted by the end. Hover a token for when it left.</p>")
            +
            f"<div class='t'>{''.join(spans)}</div></body></html>")


def render_png(tr: TokenTrace, path: str) -> None:
    import matplotlib.pyplot as plt

    fig = png_figure(tr) if tr.scores is not None else keep_figure(tr)
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


def keep_matrix(tr: TokenTrace, max_rows: int = 400) -> tuple[list[int], list[list[bool]]]:
    """The keep set over time: (times, rows), one row per time the keep set was read (at most max_rows, evenly
    picked, the last always in), rows[r][i] True when token i had arrived and was still cached after `times[r]`
    tokens."""
    n = len(tr.tokens)
    steps = tr.steps or [n]
    if len(steps) > max_rows:
        pick = sorted({round(j * (len(steps) - 1) / (max_rows - 1)) for j in range(max_rows)})
        steps = [steps[j] for j in pick]
    at = tr.evicted_at or [None] * n
    return steps, [[i < t and (at[i] is None or at[i] > t) for i in range(n)] for t in steps]


def keep_figure(tr: TokenTrace):
    """The keep set over time, for a policy with no score on arrival: one row per forward (time, downwards), one
    column per token position; a cell is dark while that token is cached. The prompt is shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    times, rows = keep_matrix(tr)
    n = len(tr.tokens)
    fig, ax = plt.subplots(figsize=(13, 4))
    ax.imshow(np.array(rows, dtype=float), aspect="auto", cmap="Greys", vmin=0, vmax=1, interpolation="nearest",
              extent=(-0.5, n - 0.5, len(times) - 0.5, -0.5))
    p_end = sum(tr.is_prompt)
    ax.axvspan(-0.5, p_end - 0.5, color="tab:orange", alpha=0.15, zorder=2)
    ticks = sorted({0, len(times) // 2, len(times) - 1})
    ax.set_yticks(ticks, [str(times[t]) for t in ticks])
    ax.set_xlabel("token position")
    ax.set_ylabel("tokens fed")
    ax.set_title(f"{tr.policy} keep set over time, K={tr.budget}: {sum(tr.evicted)} of {n} evicted by the end "
                 "(dark: cached; shaded: prompt)")
    fig.tight_layout()
    return fig
