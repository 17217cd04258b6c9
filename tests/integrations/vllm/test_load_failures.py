"""A KV load that fails inside vLLM's own scheduler with kvcore as its manager (issue 45): vLLM
sets the request back to the first failed block; where kvcore's tables cannot go on from there
(a sliding window released what that token reads) the request starts over instead, and the
checked manager (contents tracked) sees every table it runs with hold the request's own KV."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from kvcore.integrations.vllm.replay import Engine, ReplaySetup, make_scheduler
from kvcore.testing import checked
from tests.integrations.vllm.helpers import hasher

CONNECTOR = {"kv_connector": "ExternalPrefixConnector", "kv_role": "kv_both",
             "kv_connector_module_path": "tests.integrations.vllm.fake_connectors",
             "kv_load_failure_policy": "recompute"}


def _groups(kind: str) -> Any:
    def make() -> list[Any]:
        args: dict[str, Any] = dict(block_size=16, num_kv_heads=1, head_size=32,
                                    dtype=torch.float16)
        spec = (SlidingWindowSpec(sliding_window=32, **args) if kind == "swa"
                else FullAttentionSpec(**args))
        return [KVCacheGroupSpec(["layer.0"], spec)]
    return make


def _step(sched: Any, invalid: set[int] | None = None) -> Any:
    so = sched.schedule()
    ids = list(so.num_scheduled_tokens)
    mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                            sampled_token_ids=[[7] for _ in ids])
    if invalid:
        mro.kv_connector_output = KVConnectorOutput(invalid_block_ids=invalid)
    sched.update_from_output(so, mro)
    return so


@pytest.mark.parametrize(("kind", "resumes"), [("full", True), ("swa", False)])
def test_a_failed_load_resumes_only_where_kvcores_tables_can(kind: str, resumes: bool) -> None:
    setup = ReplaySetup(block_size=16, num_blocks=64, max_model_len=1024, max_num_seqs=4,
                        max_num_batched_tokens=256, kv_transfer_config=CONNECTOR,
                        kv_cache_groups=_groups(kind), prefix_cache_retention_interval=None)
    sched = make_scheduler(setup, Engine.parse("kvcore"))
    kv = checked(sched.kv_cache_manager.kv, track_contents=True)
    req = Request("ext-0", [(5 * i) % 97 for i in range(100)],
                  SamplingParams(max_tokens=3, ignore_eos=True), None, block_hasher=hasher())
    sched.add_request(req)
    so = sched.schedule()  # 96 tokens loaded synchronously, 4 computed
    assert so.num_scheduled_tokens == {"ext-0": 4} and req.num_computed_tokens == 100
    table = kv.get_block_ids("ext-0")[0]
    bad = table[5]  # positions 80-95: a sliding window of 32 at 80 reads from 49 (block 3)
    assert bad and (kind == "full" or not table[3])
    ids = list(so.num_scheduled_tokens)
    mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={"ext-0": 0}, sampled_token_ids=[[7]],
                            kv_connector_output=KVConnectorOutput(invalid_block_ids={bad}))
    sched.update_from_output(so, mro)
    assert req.num_output_tokens == 0
    if resumes:  # vLLM's rollback, unchanged
        assert req.status == RequestStatus.RUNNING and req.num_computed_tokens == 80
    else:  # started over: preempted, the failed block out of the cache
        assert req.status == RequestStatus.PREEMPTED and req.num_computed_tokens == 0
        assert kv.pool.blocks[bad].block_hash is None
    for _ in range(20):
        if req.is_finished():
            break
        _step(sched)
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED and req.num_output_tokens == 3
    assert not kv.requests()
