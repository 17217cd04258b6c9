"""The vLLM replay's report: one row per engine (the JSON's ``results``) and the tables printed
without ``--json`` — hit rate, steps, preemptions, CPU time and the comparison with vLLM's
manager; then the simulated clock's time to first token, queueing delay and longest wait in
scheduler steps (:mod:`~kvcore.integrations.vllm.replay_clock`)."""

from __future__ import annotations

import statistics
from typing import Any


def spread(values: list[float]) -> dict[str, float]:
    """Median, min and max of repeated measurements."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _cell(values: dict[str, float] | None) -> str:
    if values is None:
        return "—"
    return f"{values['median']:.1f} ({values['min']:.1f}–{values['max']:.1f})"


def print_table(rows: list[dict[str, Any]], with_ratio: bool) -> None:
    """The rows as two tables (see the module docstring); ``with_ratio``: the KV manager's time
    per step over vLLM's (the ``vllm`` row's)."""
    base = next((r for r in rows if r["engine"] == "vllm"), None)
    width = max(24, *(len(r["engine"]) for r in rows))
    print(f"{'engine':<{width}} {'hit rate':>8} {'steps':>6} {'preempt':>7} "
          f"{'sched µs/step (min–max)':>26} {'KV mgr µs/step (min–max)':>27} "
          f"{'mgr ratio':>9} {'same as vLLM':>12}")
    for r in rows:
        m = r["manager_us"]
        ratio = ""
        if base is not None and with_ratio and m is not None:
            ratio = f"{m['median'] / base['manager_us']['median']:.2f}×"
        same = {None: "", True: "yes", False: "NO"}[r["identical_to_vllm"]]
        print(f"{r['engine']:<{width}} {r['hit_rate']:>8.2%} {r['steps']:>6} "
              f"{r['preemptions']:>7} {_cell(r['step_us']):>26} {_cell(m):>27} {ratio:>9} "
              f"{same:>12}")
    print()
    print(f"{'engine':<{width}} {'TTFT p50 ms':>11} {'TTFT p99 ms':>11} {'queue p50 ms':>12} "
          f"{'queue p99 ms':>12} {'queue mean ms':>13} {'max wait steps':>14} "
          f"{'sim time s':>10}")
    for r in rows:
        print(f"{r['engine']:<{width}} {r['ttft_ms_p50']:>11.1f} {r['ttft_ms_p99']:>11.1f} "
              f"{r['queue_ms_p50']:>12.1f} {r['queue_ms_p99']:>12.1f} "
              f"{r['queue_ms_mean']:>13.1f} {r['max_wait_steps']:>14} "
              f"{r['sim_time_ms'] / 1000:>10.1f}")
