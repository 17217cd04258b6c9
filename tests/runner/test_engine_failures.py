"""Failures the engine must survive or report clearly: NaN or infinite logits fail only the
requests they belong to (typed error, no wrong KV left in the prefix cache, engine usable, with
and without async scheduling); a tensor-parallel worker that dies makes the engine raise
EngineDeadError and shut its other workers down instead of hanging."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
import torch
import transformers

from runner.engine import LLM
from runner.errors import EngineDeadError, NonFiniteLogitsError
from runner.sampler import NON_FINITE, Sampler, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22, 23, 24]]


def config() -> Any:
    return transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2,
                                    vocab_size=300, max_position_embeddings=256)


def engine(**kw: Any) -> LLM:
    return LLM(config(), device="cpu", block_size=4, num_blocks=64, seed=3, **kw)


def poison_first_row(llm: LLM, value: float, calls: set[int]) -> None:
    """Make the logits' row 0 non-finite on the listed ``runner.logits`` calls (from 1)."""
    real = llm.runner.logits
    count = [0]

    def logits(hidden: torch.Tensor) -> torch.Tensor:
        out = real(hidden)
        count[0] += 1
        if count[0] in calls:
            out = out.clone()
            out[0, 7] = value
        return out

    llm.runner.logits = logits  # type: ignore[method-assign]  # a fault injected for the test


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_the_sampler_marks_rows_with_non_finite_logits(value: float) -> None:
    logits = torch.randn(3, 50)
    logits[1, 4] = value
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_p=0.5),
              SamplingParams(temperature=1.0, top_k=5)]
    for p in params:
        sampled = Sampler(0)(logits, [p] * 3, ["a", "b", "c"]).tolist()
        assert sampled[1] == NON_FINITE and min(sampled[0], sampled[2]) >= 0
        device = Sampler(0).sample_async(logits, [p] * 3, ["a", "b", "c"]).device
        assert bool((device >= 0).all())  # what a next step would read stays a valid id


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_nan_logits_fail_only_their_request_and_the_engine_stays_usable(
        async_scheduling: bool) -> None:
    want = [o.token_ids for o in engine().generate(PROMPTS, GREEDY, use_tqdm=False)]
    llm = engine(async_scheduling=async_scheduling)
    poison_first_row(llm, float("nan"), calls={1})  # the first step: prompt 0's prefill
    with pytest.raises(NonFiniteLogitsError) as info:
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    err = info.value
    assert err.request_ids == ["0"] and "'0'" in str(err)
    first, second = err.outputs
    assert first.finish_reason == "abort" and first.token_ids == []
    assert second.finish_reason == "length" and second.token_ids == want[1]
    llm.manager.check_invariants()
    assert llm.manager.num_free_blocks == llm.kv_config.num_blocks - 1
    # The failed prefill's blocks left the prefix cache: the prompt is computed afresh and
    # gives the right tokens.
    again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in again] == want and again[0].num_cached_tokens == 0


def test_inf_logits_in_step_raise_after_the_step_is_applied() -> None:
    llm = engine()
    llm.scheduler.add_requests([llm.manager.make_request("a", PROMPTS[0], max_tokens=3,
                                                         sampling_params=GREEDY)])
    llm.step()
    poison_first_row(llm, float("inf"), calls={1})
    with pytest.raises(NonFiniteLogitsError, match="'a'"):
        llm.step()
    assert not llm.scheduler.has_unfinished_requests()
    assert len(llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].token_ids) == 6


def test_a_dead_tensor_parallel_worker_is_reported_and_the_rest_shut_down() -> None:
    llm = engine(tensor_parallel_size=2)
    assert len(llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].token_ids) == 6
    (worker,) = llm._workers.procs
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(timeout=30)
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match="rank 1 exited"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 30
    assert not llm._workers and not torch.distributed.is_initialized()
    with pytest.raises(EngineDeadError):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.close()
    # The process can build a new engine.
    assert len(engine().generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].token_ids) == 6


def test_a_worker_dying_inside_a_step_does_not_hang_the_engine() -> None:
    llm = engine(tensor_parallel_size=2)
    (worker,) = llm._workers.procs
    real = llm.runner.forward

    def forward(inputs: Any) -> torch.Tensor:  # the worker dies after taking the step's inputs
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(timeout=30)
        return real(inputs)

    llm.runner.forward = forward  # type: ignore[method-assign]  # a fault injected for the test
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match=r"rank 1 exited .* during a step"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 30
    assert not llm._workers and not torch.distributed.is_initialized()
    llm.close()
