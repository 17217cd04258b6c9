"""Async scheduling in the engine: step N+1 is scheduled and launched before step N's tokens
are applied, its placeholder positions reading step N's sampled tokens on the device.  Outputs
must equal the synchronous engine's (greedy and seeded, under chunked prefill, preemption,
prefix hits, stop tokens, a hybrid sliding-window model), and placeholders must really occur."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from kvcore.errors import InvalidArgumentError
from kvcore.scheduler import Scheduler, SchedulerConfig
from runner.batch import PreparedBatch, prepare_batch
from runner.engine import LLM
from runner.sampler import SamplingParams
from tests.factories import full_spec, make_manager
from tests.runner.test_engine import make_config
from tests.runner.test_gemma import gemma_config

GREEDY = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)


def shared_prefix_prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    base = [rng.randrange(300) for _ in range(20)]
    return [base[:rng.randrange(21)] + [rng.randrange(300) for _ in range(rng.randint(1, 25))]
            for _ in range(n)]


class FillSpy:
    """Counts the placeholder tokens the engine's batches fill on the device."""

    def __init__(self, llm: LLM) -> None:
        self.filled = 0
        prepare = llm._batcher.prepare

        def spy(*args: Any, **kw: Any) -> PreparedBatch:
            batch = prepare(*args, **kw)
            if batch.fill_dst is not None:
                self.filled += int(batch.fill_dst.numel())
            return batch

        llm._batcher.prepare = spy  # type: ignore[method-assign]


def pair(cfg: Any, **kw: Any) -> tuple[LLM, LLM, FillSpy]:
    sync = LLM(cfg, async_scheduling=False, **kw)
    on = LLM(cfg, async_scheduling=True, **kw)
    assert (sync.async_scheduling, on.async_scheduling) == (False, True)
    return sync, on, FillSpy(on)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma3"])
def test_greedy_outputs_equal_the_synchronous_engine(kind: str) -> None:
    cfg = gemma_config("gemma3") if kind == "gemma3" else make_config(kind)
    # A small pool (preemption) and a small token budget (chunked prefill, mixed steps).
    # (Gemma-3: six one-layer groups, five of them sliding windows that free blocks as
    # requests advance: no pool that admits its longest request preempts this batch.)
    num_blocks = 60 if kind == "gemma3" else 40
    sync, on, spy = pair(cfg, block_size=4, num_blocks=num_blocks, max_num_batched_tokens=24,
                         seed=3)
    batch = shared_prefix_prompts(8, seed=1)
    want = [o.token_ids for o in sync.generate(batch, GREEDY, use_tqdm=False)]
    outs = on.generate(batch, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == want
    assert all(len(t) == GREEDY.max_tokens for t in want)
    assert spy.filled > 0  # placeholders were filled from the previous step on the device
    assert sum(o.num_cached_tokens for o in outs) > 0
    assert kind == "gemma3" or sum(o.num_preemptions for o in outs) > 0
    assert on.manager.num_free_blocks == on.kv_config.num_blocks - 1
    assert not on.scheduler.has_unfinished_requests()


def test_seeded_sampling_and_stop_tokens_equal_the_synchronous_engine() -> None:
    sync, on, spy = pair(make_config("llama"), block_size=4, num_blocks=64, seed=5)
    for llm in (sync, on):  # few top-p candidates: the exact fallback (a wait) happens
        llm.sampler.candidates = 8
    batch = shared_prefix_prompts(6, seed=2)
    greedy_first = sync.generate(batch, GREEDY, use_tqdm=False)
    stop = tuple({o.token_ids[3] for o in greedy_first})  # some requests stop early
    params = [SamplingParams(temperature=0.8, top_k=40, seed=100 + i, max_tokens=10)
              for i in range(3)]
    params += [SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=stop),
               SamplingParams(temperature=0.7, top_p=0.9, seed=7, max_tokens=9),  # top-p only
               SamplingParams(temperature=0.0, max_tokens=1)]
    want = [(o.token_ids, o.finish_reason) for o in sync.generate(batch, params, use_tqdm=False)]
    got = [(o.token_ids, o.finish_reason) for o in on.generate(batch, params, use_tqdm=False)]
    assert got == want
    assert got[3][1] == "stop" and len(got[3][0]) == 4  # stopped on its 4th token
    assert spy.filled > 0
    assert on.sampler.num_exact_rows > 0  # the top-p fallback resolved before the next step
    assert len(got[5][0]) == 1  # max_tokens=1: no step scheduled past it


def test_step_is_synchronous_and_generate_leaves_nothing_in_flight() -> None:
    llm = LLM(make_config("llama"), block_size=4, num_blocks=64, async_scheduling=True)
    llm.scheduler.add_requests([llm.manager.make_request("x", [1, 2, 3], max_tokens=3,
                                                        sampling_params=GREEDY)])
    llm.step()
    (r,) = llm.scheduler.running
    assert r.num_output_placeholders == 0 and r.num_output_tokens == 1
    (out,) = llm.generate([[4, 5, 6]], GREEDY, use_tqdm=False)  # drives "x" to its end too
    assert len(out.token_ids) == GREEDY.max_tokens and llm._in_flight is None
    assert r.status.value == "length" and r.num_output_tokens == 3
    assert r.num_output_placeholders == 0 and not llm.scheduler.has_unfinished_requests()


def test_defaults_and_refusals() -> None:
    assert LLM(make_config("llama"), block_size=4, num_blocks=16).async_scheduling is True
    assert LLM(make_config("llama"), block_size=4, num_blocks=16,
               host_kv_blocks=8).async_scheduling is False  # unsupported there: off
    with pytest.raises(InvalidArgumentError, match="host KV tier"):
        LLM(make_config("llama"), block_size=4, num_blocks=16, host_kv_blocks=8,
            async_scheduling=True)
    with pytest.raises(InvalidArgumentError, match="tensor_parallel_size=2"):
        LLM(make_config("llama"), tensor_parallel_size=2, async_scheduling=True)
    with pytest.raises(InvalidArgumentError, match="async_scheduling must be a bool"):
        LLM(make_config("llama"), async_scheduling="yes")


def test_batch_fills_placeholders_from_the_previous_steps_tokens() -> None:
    m = make_manager(full_spec(4), num_blocks=32)
    s = Scheduler(m, SchedulerConfig(async_scheduling=True))
    s.add_requests([m.make_request("a", [1, 2, 3], max_tokens=5),
                    m.make_request("b", [4, 5], max_tokens=5)])
    s.schedule()
    s.add_request(m.make_request("c", [6, 7, 8, 9, 10], max_tokens=5))
    out = s.schedule()  # a and b decode their in-flight tokens; c prefills (a mixed step)
    assert [len(x.token_ids) for x in out.scheduled] == [0, 0, 5]
    with pytest.raises(RuntimeError, match="'a' has a token in flight"):
        prepare_batch(out.scheduled, 1, 4)
    batch = prepare_batch(out.scheduled, 1, 4, in_flight={"b": 0, "a": 1})
    with pytest.raises(RuntimeError, match="no step is in flight"):
        batch.fill(None)
    batch.fill(torch.tensor([22, 11]))
    assert batch.input_ids.tolist() == [11, 22, 6, 7, 8, 9, 10]
    assert batch.positions.tolist() == [3, 2, 0, 1, 2, 3, 4]


def test_interrupt_between_steps_applies_the_step_in_flight() -> None:
    """Ctrl-C lands in generate's loop right after a step was launched: that step's tokens are
    still applied (its KV is written), so a request outside the batch keeps going."""
    llm = LLM(make_config("llama"), block_size=4, num_blocks=64, async_scheduling=True)
    x = llm.manager.make_request("x", [1, 2, 3], max_tokens=8, sampling_params=GREEDY)
    llm.scheduler.add_request(x)
    real, calls = llm._advance, [0]

    def advance(keep_in_flight: bool) -> Any:
        result = real(keep_in_flight)
        calls[0] += 1
        if calls[0] == 3:
            assert llm._in_flight is not None  # a step is in flight when the interrupt lands
            raise KeyboardInterrupt
        return result

    llm._advance = advance  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[4, 5, 6]], GREEDY, use_tqdm=False)
    llm._advance = real  # type: ignore[method-assign]
    assert llm._in_flight is None and x.status.value == "running"
    assert x.num_output_placeholders == 0 and x.num_computed_tokens == x.num_tokens - 1
    llm.step()
    assert x.num_output_tokens == 4
    llm.manager.check_invariants()
