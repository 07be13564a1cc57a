"""PNG plots of the speed, memory and throughput results (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_speed(result: dict, path: str | Path) -> None:
    """Per budget: ms per decoded token of every config (bars, speed-up vs full on top); long generations:
    tokens/s and peak memory against generated length."""
    blocks = result["budgets"]
    long = [p for p in result.get("long", []) if p.get("status", "ok") == "ok" and "generated" in p]
    ncols = len(blocks) + (3 if long else 0)
    fig, axes = plt.subplots(1, ncols, figsize=(5.5 * ncols, 4.2), squeeze=False)
    for ax, b in zip(axes[0], blocks):
        rows = b["configs"]
        ms = [r["ms_per_token"] for r in rows]
        colors = ["tab:gray" if not r["evicts"] else "tab:blue" if r["attention_free"] else "tab:red" for r in rows]
        ax.bar(range(len(rows)), ms, color=colors)
        ax.set_xticks(range(len(rows)), [r["label"] for r in rows], rotation=45, ha="right", fontsize=8)
        ax.set_ylabel("ms per decoded token (median of rounds)")
        ax.set_title(f"K = {b['budget']} (gray: full, blue: attention-free, red: attention)", fontsize=9)
        sp = b["ratios"].get("speedup_vs_full", {})
        for i, r in enumerate(rows):
            if r["label"] in sp:
                ax.text(i, ms[i], f"{sp[r['label']]:.2f}x", ha="center", va="bottom", fontsize=7)
    if long:
        ax_t, ax_m, ax_kv = axes[0][-3], axes[0][-2], axes[0][-1]
        for pol in dict.fromkeys(p["policy"] for p in long):
            pts = [p for p in long if p["policy"] == pol]
            x = [p["generated"] for p in pts]
            ax_t.plot(x, [p["segment_tokens_per_s"] for p in pts], marker="o", label=pol)
            if all("peak_gib" in p for p in pts):
                ax_m.plot(x, [p["peak_gib"] for p in pts], marker="o", label=pol)
            if all("kv_buffer_mib" in p for p in pts):
                ax_kv.plot(x, [p["kv_buffer_mib"] for p in pts], marker="o", label=pol)
        ax_kv.set_xlabel("generated tokens"), ax_kv.set_ylabel("KV buffers allocated (MiB)")
        ax_kv.set_title("KV cache buffers at each checkpoint", fontsize=9)
        ax_kv.legend()
        ax_t.set_xlabel("generated tokens"), ax_t.set_ylabel("tokens/s (last segment)")
        ax_t.set_title(f"long generation, K = {long[0].get('budget') or result.get('long_budget')}", fontsize=9)
        ax_m.set_xlabel("generated tokens"), ax_m.set_ylabel("peak memory so far (GiB)")
        ax_m.set_title("peak memory (process RSS on CPU, allocator on CUDA)", fontsize=9)
        ax_t.legend(), ax_m.legend()
    fig.suptitle(f"decode speed: {result['model']} on {result['device']} ({result['dtype']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_memory(result: dict, path: str | Path) -> None:
    """Peak memory of one forward pass against n (log scale), failures marked at the cap."""
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    cap = result.get("cap_gib")
    for mode, color in (("eager+attn", "tab:red"), ("sdpa+hidden", "tab:blue")):
        pts = [p for p in result["points"] if p["mode"] == mode]
        ok = [p for p in pts if p["status"] == "ok"]
        ax.plot([p["n"] for p in ok], [p["peak_gib"] for p in ok], marker="o", color=color, label=mode)
        bad = [p for p in pts if p["status"] in ("oom", "over-cap")]
        if bad and cap:
            ax.scatter([p["n"] for p in bad], [cap] * len(bad), marker="x", s=80, color=color,
                       label=f"{mode}: {'/'.join(sorted({p['status'] for p in bad}))}")
    if cap:
        ax.axhline(cap, color="black", linestyle="--", linewidth=0.8, label=f"cap {cap:g} GiB")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens in one forward pass")
    ax.set_ylabel("peak memory (GiB)")
    ax.set_title(f"memory wall: {result['model']} on {result['device']} ({result['dtype']})", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_throughput(result: dict, path: str | Path) -> None:
    """Aggregate tokens/s against batch size per policy (largest fitting batch starred), and KV memory against batch
    size with the cap."""
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    cap_mib = result["cap_mib"]
    for label in dict.fromkeys(p["label"] for p in result["points"]):
        pts = sorted((p for p in result["points"] if p["label"] == label), key=lambda p: p["batch"])
        x = [p["batch"] for p in pts]
        line, = ax_t.plot(x, [p["aggregate_tokens_per_s"] for p in pts], marker="o", label=label)
        top = result["search"][label]["max_batch"]
        for p in pts:
            if p["batch"] == top:
                ax_t.scatter([top], [p["aggregate_tokens_per_s"]], marker="*", s=160, color=line.get_color(), zorder=3)
        ax_m.plot(x, [p["kv_peak_bytes"] / 2**20 for p in pts], marker="o", color=line.get_color(), label=label)
        ax_m.plot(x, [p["predicted_peak_bytes"] / 2**20 for p in pts], linestyle="--", color=line.get_color())
    ax_t.set_xlabel("batch size (static)"), ax_t.set_ylabel("aggregate generated tokens/s")
    ax_t.set_title(f"throughput, {result['requests']} requests x {result['new_tokens']} tokens (star: largest batch "
                   f"under {cap_mib:g} MiB)", fontsize=9)
    ax_m.axhline(cap_mib, color="black", linestyle="--", linewidth=0.8, label=f"cap {cap_mib:g} MiB")
    ax_m.set_xlabel("batch size (static)"), ax_m.set_ylabel("MiB")
    ax_m.set_title("solid: KV buffers (measured peak); dashed: + observed attention\nweights / hidden states "
                   "(counted against the cap)", fontsize=9)
    ax_t.legend(fontsize=8), ax_m.legend(fontsize=8)
    fig.suptitle(f"throughput under a KV-memory cap: {result['model']} on {result['device']} ({result['dtype']}); "
                 "static batches, forced length", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
