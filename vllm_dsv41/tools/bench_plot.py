"""Plots for ``vllm-dsv41-bench``: throughput/GPU against interactivity, the
Pareto frontier, and the value at the target interactivity (Agg backend)."""

from __future__ import annotations

from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

_COLORS = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple",
           "tab:brown", "tab:pink", "tab:gray", "tab:olive", "tab:cyan"]


def _draw(ax, pareto: dict[str, Any], label: str, color: str) -> None:
    pts = pareto.get("points") or []
    front = pareto.get("frontier") or []
    if pts:
        ax.scatter([p["interactivity"] for p in pts], [p["throughput_per_gpu"] for p in pts],
                   s=18, color=color, alpha=0.35, zorder=2)
        for p in pts:
            ax.annotate(f"c={p['concurrency']}", (p["interactivity"], p["throughput_per_gpu"]),
                        textcoords="offset points", xytext=(4, 4), fontsize=7, color=color,
                        alpha=0.8)
    if front:
        ax.plot([p["interactivity"] for p in front], [p["throughput_per_gpu"] for p in front],
                "-o", color=color, markersize=5, label=f"{label} (frontier)", zorder=3)
    value = pareto.get("throughput_per_gpu_at_target")
    target = pareto.get("target_tps_per_user")
    if value is not None and target is not None:
        ax.plot([target], [value], marker="*", markersize=16, color=color,
                markeredgecolor="black", zorder=4)
        ax.annotate(f"{value:,.1f} tok/s/GPU", (target, value), textcoords="offset points",
                    xytext=(8, -12), fontsize=9, color=color, weight="bold")


def plot_frontiers(entries: Sequence[tuple[str, dict[str, Any]]], target: float, path: str,
                   title: str = "") -> None:
    """One figure with every ``(label, pareto_block)`` overlaid and a dashed
    line at the target interactivity."""
    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=110)
    try:
        missing = []
        for i, (label, pareto) in enumerate(entries):
            _draw(ax, pareto, label, _COLORS[i % len(_COLORS)])
            if pareto.get("throughput_per_gpu_at_target") is None:
                missing.append(f"{label}: {pareto.get('reason') or 'no value'}")
        ax.axvline(target, color="black", linestyle="--", linewidth=1,
                   label=f"target {target:g} tok/s/user")
        if missing:
            ax.text(0.01, 0.01, "\n".join(missing), transform=ax.transAxes, fontsize=7,
                    va="bottom", ha="left", color="dimgray", wrap=True)
        ax.set_xlabel("interactivity (output tok/s per user)")
        ax.set_ylabel("throughput (output tok/s per GPU)")
        ax.set_title(title or "Throughput per GPU vs interactivity")
        ax.grid(True, alpha=0.3)
        xs = [p["interactivity"] for _, pr in entries for p in pr.get("points") or []]
        ys = [p["throughput_per_gpu"] for _, pr in entries for p in pr.get("points") or []]
        ax.set_xlim(0, max(xs + [target]) * 1.12)
        ax.set_ylim(0, (max(ys) if ys else 1.0) * 1.15 or 1.0)
        ax.legend(loc="best", fontsize=8)
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)
