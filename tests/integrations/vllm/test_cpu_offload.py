"""vLLM's ``SimpleCPUOffloadConnector`` (native CPU offloading) inside vLLM's real Scheduler,
no model: with kvcore's LRU manager the same schedule and the same connector metadata (which
GPU blocks are stored to which CPU blocks, and loaded back, step by step) as with vLLM's own
manager, eager and lazy offloading, the worker's completions fabricated as vLLM's tests do;
kvcore's invariants checked after every step; vLLM's residency metrics on (every block
sampled), whose per-block access counts, the connector's touches included, are vLLM's too."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from kvcore.integrations.vllm.replay import (
    Engine,
    ReplaySetup,
    _step_record,
    _token,
    make_scheduler,
)
from kvcore.integrations.vllm.settings import parse_settings
from kvcore.sim.workloads import make_workload
from tests.integrations.vllm.helpers import hasher

PAGE = 16 * 32 * 2 * 2  # block size x head size x (K, V) x fp16 bytes, one layer
NUM_BLOCKS = 48


def _tensors() -> list[Any]:
    from vllm.v1.kv_cache_interface import KVCacheTensor

    return [KVCacheTensor(size=PAGE * NUM_BLOCKS, layers=["layer.0"],
                          layer_stride=PAGE * NUM_BLOCKS, block_stride=PAGE)]


def _setup(lazy: bool) -> ReplaySetup:
    return ReplaySetup(block_size=16, num_blocks=NUM_BLOCKS, max_model_len=1024,
                       max_num_seqs=4, max_num_batched_tokens=128, kv_cache_tensors=_tensors,
                       kv_cache_metrics=True,  # the connector's touches are accesses too
                       kv_transfer_config={
                           "kv_connector": "SimpleCPUOffloadConnector", "kv_role": "kv_both",
                           "kv_connector_extra_config": {"cpu_bytes_to_use": 96 * PAGE,
                                                         "lazy_offload": lazy}})


def _run(engine: Engine, lazy: bool) -> list[Any]:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata

    sched = make_scheduler(_setup(lazy), engine)
    trace = make_workload("shared-prefix", num_groups=3, prompts_per_group=4, system_len=160)
    for i, tr in enumerate(trace):
        tr = replace(tr, request_id=f"r{i}")
        sched.add_request(Request(tr.request_id, tr.prompt_token_ids(),
                                  SamplingParams(max_tokens=4, ignore_eos=True), None,
                                  block_hasher=hasher()))
    record: list[Any] = []
    for _ in range(2000):
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        meta = so.kv_connector_metadata
        ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = sched.requests[rid]
            done = req.num_computed_tokens + so.num_scheduled_tokens[rid] >= req.num_tokens
            sampled.append([_token(rid, req.num_tokens)] if done else [])
        mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=sampled)
        loaded = {r for reqs in meta.load_event_to_reqs.values() for r in reqs}
        stored = {meta.store_event: 1} if meta.store_event >= 0 else {}
        mro.kv_connector_output = KVConnectorOutput(
            finished_recving=loaded,
            kv_connector_worker_meta=SimpleCPUOffloadWorkerMetadata(stored))
        residency = tuple(sorted((b, len(m.access_history))
                                 for b, m in sched.kv_metrics_collector.block_metrics.items()))
        record.append((_step_record(so), meta.load_gpu_blocks, meta.load_cpu_blocks,
                       meta.store_gpu_blocks, meta.store_cpu_blocks, meta.need_flush,
                       residency))
        sched.update_from_output(so, mro)
        if engine.settings is not None:  # every reference accounted for, withheld included
            sched.kv_cache_manager.check_invariants()
    assert not sched.has_unfinished_requests()
    return record


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_cpu_offload_gives_vllms_schedule_and_transfers(lazy: bool) -> None:
    theirs = _run(Engine.parse("vllm"), lazy)
    ours = _run(Engine("kvcore", parse_settings({"check_invariants_every": 1})), lazy)
    assert len(ours) == len(theirs)
    for step, (a, b) in enumerate(zip(theirs, ours)):
        assert a == b, f"step {step}"
    assert any(x[3] for x in ours)  # blocks were stored
    assert any(x[1] for x in ours)  # and loaded back from the CPU tier
    assert ours[-1] == theirs[-1]
