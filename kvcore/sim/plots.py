"""Matplotlib helpers (the optional ``plot`` extra): hit rate vs capacity, usage over time."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvcore.errors import InvalidArgumentError
from kvcore.eviction import OFFLINE_BOUND
from kvcore.sim.policies import PolicyResult


def _pyplot() -> Any:
    try:
        import matplotlib.pyplot as plt  # headless machines fall back to Agg by themselves
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("plotting needs matplotlib: pip install 'kvcore[plot]'") from exc
    return plt


def check_plot_path(path: str | Path, option: str = "--plot") -> None:
    """Refuse, before any work, a plot file that could not be written: a missing or unwritable
    directory, a directory as the file, an extension matplotlib has no writer for (or no
    matplotlib).  The error names ``option`` and the value."""
    plt = _pyplot()
    from matplotlib.backend_bases import FigureCanvasBase

    if not str(path).strip():
        raise InvalidArgumentError(f"{option}: the file name is empty")
    target = Path(path)
    where = target.parent
    if target.is_dir():
        raise InvalidArgumentError(f"{option} {path}: is a directory, not a file")
    if not where.is_dir():
        raise InvalidArgumentError(f"{option} {path}: directory {where} does not exist")
    if not os.access(where, os.W_OK | os.X_OK):
        raise InvalidArgumentError(f"{option} {path}: directory {where} is not writable")
    supported = FigureCanvasBase.get_supported_filetypes()
    fmt = target.suffix[1:].lower() or plt.rcParams["savefig.format"]
    if fmt not in supported:
        raise InvalidArgumentError(f"{option} {path}: matplotlib cannot write {fmt!r} files "
                                   f"(use one of {', '.join(sorted(supported))})")


def plot_hit_rate_curves(curves: Mapping[str, Sequence[PolicyResult]], *, block_size: int,
                         ideal: float | None = None, title: str = "Prefix-cache hit rate",
                         path: str | Path | None = None, ax: Any = None) -> Any:
    """One line per policy: token hit rate against cache capacity (tokens).

    Belady is drawn dashed and labelled as the offline bound.  A capacity at which every request
    was skipped (larger than the cache) has no hit rate and is left out, not drawn as 0%; one
    note under the plot says how many requests each small capacity skipped (the same for every
    policy).  The legend stands to the right of the axes, so it covers no curve.
    """
    plt = _pyplot()
    if ax is None:
        _, ax = plt.subplots(figsize=(6.4, 4.2))
    skipped: dict[int, int] = {}  # capacity (tokens) -> requests skipped, where any was
    for policy, results in curves.items():
        shown = [r for r in results if r.prompt_tokens]
        xs = [r.capacity_blocks * block_size for r in shown]
        label = f"{policy} (offline bound)" if policy == OFFLINE_BOUND else policy
        for x, r in zip(xs, shown):
            if r.skipped:
                skipped[x] = max(skipped.get(x, 0), r.skipped)
        ax.plot(xs, [100 * r.hit_rate for r in shown], marker="o", label=label,
                linestyle="--" if policy == OFFLINE_BOUND else "-")
    if ideal is not None:
        ax.axhline(100 * ideal, color="grey", linestyle="--", label="infinite capacity")
    ax.set_xscale("log")
    ax.set_xlabel("cache capacity (tokens)")
    ax.set_ylabel("token hit rate (%)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    if skipped:
        ax.annotate("requests larger than the cache skipped: " + ", ".join(
            f"{n:,} at {x:,} tokens" for x, n in sorted(skipped.items())),
            xy=(0.0, 0.0), xycoords="axes fraction", xytext=(0, -42),
            textcoords="offset points", va="top", fontsize="small", color="dimgrey")
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
