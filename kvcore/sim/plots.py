"""Matplotlib helpers (the optional ``plot`` extra): hit rate vs capacity, usage over time."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvcore.eviction import OFFLINE_BOUND
from kvcore.sim.policies import PolicyResult


def _pyplot() -> Any:
    try:
        import matplotlib.pyplot as plt  # headless machines fall back to Agg by themselves
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("plotting needs matplotlib: pip install 'kvcore[plot]'") from exc
    return plt


def plot_hit_rate_curves(curves: Mapping[str, Sequence[PolicyResult]], *, block_size: int,
                         ideal: float | None = None, title: str = "Prefix-cache hit rate",
                         path: str | Path | None = None, ax: Any = None) -> Any:
    """One line per policy: token hit rate against cache capacity (tokens).

    Belady is drawn dashed and labelled as the offline bound.  A capacity at which every request
    was skipped (larger than the cache) has no hit rate and is left out, not drawn as 0%; the
    legend says how many requests the smallest plotted capacity skipped.
    """
    plt = _pyplot()
    if ax is None:
        _, ax = plt.subplots(figsize=(6.4, 4.2))
    for policy, results in curves.items():
        shown = [r for r in results if r.prompt_tokens]
        xs = [r.capacity_blocks * block_size for r in shown]
        label = f"{policy} (offline bound)" if policy == OFFLINE_BOUND else policy
        if shown and shown[0].skipped:
            label += f", {shown[0].skipped} skipped at {xs[0]:,}"
        ax.plot(xs, [100 * r.hit_rate for r in shown], marker="o", label=label,
                linestyle="--" if policy == OFFLINE_BOUND else "-")
    if ideal is not None:
        ax.axhline(100 * ideal, color="grey", linestyle="--", label="infinite capacity")
    ax.set_xscale("log")
    ax.set_xlabel("cache capacity (tokens)")
    ax.set_ylabel("token hit rate (%)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    if path is not None:
        ax.figure.savefig(path, dpi=120, bbox_inches="tight")
    return ax


def plot_usage(usage: Sequence[tuple[float, float]], *, title: str = "KV-cache usage",
               path: str | Path | None = None, ax: Any = None) -> Any:
    """KV-cache usage (fraction of blocks in use) against simulated time."""
    plt = _pyplot()
    if ax is None:
        _, ax = plt.subplots(figsize=(6.4, 3.2))
    if usage:
        ts, us = zip(*usage)
        ax.plot([t / 1000 for t in ts], [100 * u for u in us], linewidth=0.8)
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("blocks in use (%)")
    ax.set_ylim(0, 100)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if path is not None:
        ax.figure.savefig(path, dpi=120, bbox_inches="tight")
    return ax
