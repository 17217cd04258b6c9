"""The differential suite's random operation traces (tests/differential) through kvcore behind
the vLLM adapter and through vLLM's own KVCacheManager, both driven with vLLM's requests in this
process: identical hits and hit block ids, new block ids, tables, free queue in eviction order,
KV events (vLLM's types, hashes converted as vLLM converts them) and prefix-cache stats after
every operation.  Trace kinds the adapter refuses (Mamba, cross attention) are left out; that
it refuses them is tested in test_adapter.py."""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.differential.replay import replay_all
from tests.differential.traces import generate_trace

NUM_TRACES = int(os.environ.get("KVCORE_DIFF_TRACES", "400"))
REFUSED = {"mamba", "hybrid_mamba", "cross"}


@pytest.fixture(scope="module")
def traces() -> list[dict[str, Any]]:
    out = [generate_trace(seed, pending=[]) for seed in range(NUM_TRACES)]
    return [t for t in out if t["config"]["kind"] not in REFUSED]


def test_adapter_matches_vllm_on_every_trace(traces: list[dict[str, Any]]) -> None:
    assert len(traces) > NUM_TRACES // 2
    theirs = replay_all("vllm", traces)
    ours = replay_all("adapter", traces)
    failures = [(t["seed"], t["config"]["kind"], next(
        (i, a, b) for i, (a, b) in enumerate(zip(x, y)) if a != b))
        for t, x, y in zip(traces, ours, theirs) if x != y]
    errors = [o["error"] for obs in theirs for o in obs if "error" in o]
    assert not errors, f"vLLM raised on {len(errors)} traces: {errors[:3]}"
    hits = sum(1 for obs in ours for o in obs if o.get("hit", 0) > 0)
    events = sum(1 for obs in ours for o in obs if o.get("events"))
    assert hits > 100 and events > 100
    assert not failures, f"{len(failures)} traces differ; first: {failures[0]}"
