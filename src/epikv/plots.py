"""Plot styling shared by the reports: metrics against the cache budget K."""

from __future__ import annotations


def budget_axes(ax, budgets, ylabel: str, title: str, legend_size: int = 8) -> None:
    """Log2 budget axis labelled with the budgets actually run, grid, labels and legend."""
    ks = sorted(set(budgets))
    if ks:
        ax.set_xscale("log", base=2)
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.minorticks_off()
    ax.set_xlabel("cache budget K (tokens)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=legend_size)


def policy_style(policy: str) -> dict:
    """A fixed colour, marker and line style per policy, the same in every plot and distinct for all registered
    policies: the policies scored from hidden states (the EPIKV family) solid, every other baseline dashed. A
    policy run with other settings (`lagkv[lag=128]`) keeps its colour, dash-dotted with crosses."""
    import zlib

    import matplotlib

    from .policies import REGISTRY

    base = policy.split("[", 1)[0]
    if base != policy and base in REGISTRY:
        return {**policy_style(base), "ls": "-.", "marker": "X"}
    names = list(REGISTRY)
    i = names.index(policy) if policy in names else zlib.crc32(policy.encode()) % 20
    hidden = policy in REGISTRY and bool(REGISTRY[policy]().observes(32).hidden_layers)
    return {"color": matplotlib.colormaps["tab20"](i % 20), "marker": "osD^v<>ph*"[i % 10],
            "ls": "-" if hidden else "--"}


def dodge(xs, i: int, n: int, spread: float = 0.12):
    """Budgets nudged apart on a log2 axis (policy i of n), so that error bars at one budget do not overlap."""
    return [x * 2 ** (spread * (i - (n - 1) / 2) / max(n - 1, 1)) for x in xs]
