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
