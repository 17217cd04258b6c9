"""Tests of the simulation package (traces, workloads, policies, replay)."""

from __future__ import annotations

from kvcore.sim import workloads as W
from kvcore.sim.traces import TraceRequest

SMALL = {"agent": dict(num_sessions=6, min_steps=2, max_steps=4, system_len=256,
                       task_len=(64, 128), tool_median=128, tool_max=512),
         "api": dict(num_requests=120, num_system_prompts=6, system_len=(128, 768),
                     user_len=(64, 512), output_len=(16, 128)),
         "rag": dict(num_requests=120, num_documents=40, instruction_len=128,
                     document_len=(128, 512), question_len=(64, 128), output_len=(16, 128))}
"""Arguments that shrink a workload sized for 512-token blocks to the unit-test scale."""


def small_workload(name: str, **kwargs: object) -> list[TraceRequest]:
    """Built-in workload ``name`` at the unit-test scale."""
    return W.make_workload(name, **{**SMALL.get(name, {}), **kwargs})
