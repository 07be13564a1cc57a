"""The profile figure: rho against layer (pooled and per-trace mean, bootstrap intervals, the paper's bands shaded)
and the positional trend of g_l inside the reasoning span."""

from __future__ import annotations

import numpy as np

from ..signals import scale_band


def plot_profile(profile: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = profile["layers"]
    n = len(rows)
    x = np.arange(n)
    get = lambda k: np.array([np.nan if r[k] is None else r[k] for r in rows], dtype=float)  # noqa: E731
    getci = lambda k: np.array([[np.nan if v is None else v for v in r[k]] for r in rows], dtype=float)  # noqa: E731
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    for lo, hi, colour, name in ((7, 13, "tab:green", "paper band A"), (18, 25, "tab:red", "paper band B")):
        band = scale_band(lo, hi, n)
        ax.axvspan(band[0] - 0.5, band[-1] + 0.5, color=colour, alpha=0.1, label=f"{name} ({lo}-{hi} of 32, scaled)")
    series = [("trace_mean", "tab:blue", "mean of per-trace rho"), ("pooled", "0.3", "pooled rho")]
    if "partial_position" in rows[0]:
        series.append(("partial_position", "tab:purple", "per-trace rho, position partialled out"))
    for key, colour, name in series:
        ci = getci(key + "_ci")
        ax.plot(x, get(key), marker="o", ms=3, color=colour, label=name)
        ax.fill_between(x, ci[:, 0], ci[:, 1], color=colour, alpha=0.2)
    ax.axhline(0, color="k", lw=0.6)
    ax.set_xlabel("decoder block l (g_l from hidden_states[l+1])")
    ax.set_ylabel("Spearman rho(trailing-mean g_l, label)")
    ax.set_title(f"{profile.get('model')}: {profile.get('label')} labels, n_eff = {profile.get('n_traces')} traces, "
                 f"{int(profile.get('level', 0.95) * 100)}% cluster bootstrap", fontsize=9)
    ax.legend(fontsize=7)
    trend = profile["positional_trend"]
    mean_g = np.array(trend["mean_g"], dtype=float)  # [layers, bins]
    centres = (np.arange(trend["bins"]) + 0.5) / trend["bins"]
    show = sorted({scale_band(10, 10, n)[0], scale_band(21, 21, n)[0], *profile.get("highlight", [])})
    for l in show:
        sm = trend.get("rho_position_smoothed")
        extra = f", trailing mean {sm[l]:+.2f}" if sm and sm[l] is not None else ""
        ax2.plot(centres, mean_g[l] / np.nanmean(mean_g[l]), marker=".", label=f"g_{l} (rho vs position: raw "
                 f"{trend['rho_position'][l]:+.2f}{extra})")
    ax2.set_xlabel("relative position in the reasoning span")
    ax2.set_ylabel("mean g_l / its overall mean")
    lab = trend.get("rho_label_position")
    ax2.set_title("positional trend of g_l (why the policy z-scores)"
                  + (f"; labels vs position: rho {lab:+.2f}" if lab is not None else ""), fontsize=9)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
