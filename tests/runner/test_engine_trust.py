"""The engine can be trusted with bad input and with failures inside a step.

Bad prompts and sampling params are refused with :class:`InvalidArgumentError` before anything is
admitted; a batch is admitted all or nothing; an exception (or ``KeyboardInterrupt``) anywhere in
a step propagates, leaves the engine idle with no leaked block and no unwritten KV in the prefix
cache, and the next ``generate`` gives exactly what a fresh engine gives."""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import transformers

from kvcore.errors import InvalidArgumentError
from kvcore.scheduler import RequestRejectedError, SchedulerOutput
from kvcore.testing import refuse_allocation
from runner.engine import LLM
from runner.sampler import SampledTokens, Sampler, SamplingParams

VOCAB = 300
MAX_LEN = 128
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SYSTEM = list(range(10, 42))  # 32 tokens: 8 full blocks of 4
TAILS = [[50 + 60 * k + i for i in range(n)] for k, n in enumerate((5, 11, 18, 7))]
BATCH = [SYSTEM + t for t in TAILS]  # all share the system prompt


def config() -> Any:
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=VOCAB, max_position_embeddings=256)
    cfg._attn_implementation = "eager"
    return cfg


def make_llm(**kw: Any) -> LLM:
    # Small step budget and max_num_seqs=2: prefills are chunked over several steps and part of
    # a 4-prompt batch is still waiting when a step fails.
    args: dict[str, Any] = dict(block_size=4, num_blocks=96, seed=0, device="cpu",
                                max_model_len=MAX_LEN, max_num_batched_tokens=12, max_num_seqs=2)
    llm = LLM(config(), **{**args, **kw})
    # Random init (std 0.02 against unit-norm embeddings) makes attention negligible: the model
    # is nearly a bigram model, blind to what is in the KV cache.  Amplify attention so that KV
    # served from never-written blocks changes the generated tokens.
    with torch.no_grad():
        for name, param in llm.runner.model.named_parameters():
            if name.endswith("qkv_proj.weight"):
                param.mul_(10)
            elif name.endswith("o_proj.weight"):
                param.mul_(50)
    return llm


def tokens(outputs: list[Any]) -> list[list[int]]:
    return [o.token_ids for o in outputs]


def assert_idle(llm: LLM, sampler: Sampler | None = None) -> None:
    assert not llm.scheduler.has_unfinished_requests()
    assert not llm.scheduler.requests
    assert llm.manager.num_running_requests == 0
    assert llm.manager.num_free_blocks == llm.kv_config.num_blocks - 1
    llm.manager.check_invariants()
    assert not (sampler or llm.sampler)._request_generators


@pytest.fixture(scope="module")
def fresh_batch_tokens() -> list[list[int]]:
    """What an engine that never failed (and never saw the system prompt) generates for BATCH;
    the same as without prefix caching."""
    want = tokens(make_llm().generate(BATCH, GREEDY, use_tqdm=False))
    uncached = make_llm(enable_prefix_caching=False)
    assert tokens(uncached.generate(BATCH, GREEDY, use_tqdm=False)) == want
    return want


def warm(llm: LLM) -> None:
    """A successful request first, so BATCH's system prompt is served from the prefix cache."""
    (out,) = llm.generate([[*SYSTEM, 7, 8, 9]], GREEDY, use_tqdm=False)
    assert len(out.token_ids) == 8
    assert_idle(llm)


class FailOn:
    """Wraps ``fn``; its ``n``-th call raises ``exc`` (calls are counted from 1)."""

    def __init__(self, fn: Callable[..., Any], n: int, exc: BaseException,
                 before: Callable[..., None] | None = None) -> None:
        self.fn, self.n, self.exc, self.before = fn, n, exc, before
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == self.n:
            if self.before is not None:
                self.before(*args, **kwargs)
            raise self.exc
        return self.fn(*args, **kwargs)


# -- prompts are checked before anything is admitted ----------------------------------------------
class StubTokenizer:
    eos_token_id = None

    def encode(self, text: str) -> list[int]:
        return [1, 2, 999] if text == "bad" else [1, 2, 3]


@pytest.mark.parametrize("prompts,match", [
    ([[1, 2, 3], [4, 5, VOCAB]], rf"prompt 1: token id {VOCAB} at position 2 is outside the "
                                 rf"vocabulary \[0, {VOCAB}\)"),
    ([[1, 2, 70000]], r"prompt 0: token id 70000 at position 2 is outside the vocabulary"),
    ([[1, 2], [5, -1]], r"prompt 1: token id -1 at position 1 is outside the vocabulary"),
    ([[1, True, 3]], r"prompt 0: token id True at position 1 is not an int \(bool\)"),
    ([[1, 2.0]], r"prompt 0: token id 2\.0 at position 1 is not an int \(float\)"),
    ([[1, "7"]], r"prompt 0: token id '7' at position 1 is not an int \(str\)"),
    ([[1, 2], []], r"prompt 1 is empty"),
    ([[1, 2], ()], r"prompt 1 is empty"),
    ([[1] * MAX_LEN], rf"prompt 0 has {MAX_LEN} tokens; it must be shorter than "
                      rf"max_model_len={MAX_LEN}"),
    ([[1, 2], [3] * (MAX_LEN + 5)], rf"prompt 1 has {MAX_LEN + 5} tokens"),
    ([[1, 2], 5], r"prompt 1: expected a str or a list of int token ids, got int \(wrap"),
    ([[1, 2], None], r"prompt 1: expected a str or a list of int token ids, got NoneType"),
    ([b"abc"], r"prompt 0: expected a str or a list of int token ids, got bytes"),
    ({"a": 1}, r"prompts must be a str or a list of prompts, got dict"),
], ids=["vocab-edge", "huge-id", "negative", "bool", "float", "str-id", "empty", "empty-tuple",
        "max-len", "too-long", "bare-int", "none", "bytes", "dict"])
def test_bad_prompt_is_refused_and_nothing_is_admitted(prompts: Any, match: str) -> None:
    llm = make_llm()
    free = llm.manager.num_free_blocks
    with pytest.raises(InvalidArgumentError, match=match):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.manager.num_free_blocks == free
    assert_idle(llm)
    short = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    (out,) = llm.generate([[1, 2, 3]], short, use_tqdm=False)
    assert len(out.token_ids) == 2 and out.request_id == "0"  # still works; no id was spent


def test_tokenized_prompt_is_checked_too() -> None:
    llm = make_llm(tokenizer=StubTokenizer())
    with pytest.raises(InvalidArgumentError,
                       match=r"prompt 1 \(tokenized\): token id 999 at position 2 is outside"):
        llm.generate(["good", "bad"], GREEDY, use_tqdm=False)
    assert_idle(llm)
    assert len(llm.generate(["good"], GREEDY, use_tqdm=False)[0].token_ids) == 8


def test_very_long_prompt_is_refused_instantly() -> None:
    llm = make_llm()
    prompt = [1] * 5_000_000
    t0 = time.thread_time()  # CPU time: the work done, not how busy the machine is
    with pytest.raises(InvalidArgumentError, match=r"prompt 0 has 5000000 tokens"):
        llm.generate([prompt], GREEDY, use_tqdm=False)
    assert time.thread_time() - t0 < 1.0
    assert_idle(llm)


def test_prompts_may_be_tuples_and_numpy_ints() -> None:
    np = pytest.importorskip("numpy")
    llm = make_llm()
    want = tokens(llm.generate(BATCH[:2], GREEDY, use_tqdm=False))
    got = llm.generate((tuple(BATCH[0]), [np.int64(t) for t in BATCH[1]]), GREEDY, use_tqdm=False)
    assert tokens(got) == want
    assert got[1].prompt_token_ids == BATCH[1] and type(got[1].prompt_token_ids[0]) is int


@pytest.mark.parametrize("params,match", [
    ([GREEDY], r"1 sampling params for 2 prompts"),
    ([GREEDY, GREEDY, GREEDY], r"3 sampling params for 2 prompts"),
    ([GREEDY, {"temperature": 0.0}], r"sampling_params\[1\] must be a SamplingParams, got dict"),
    ({"temperature": 0.0}, r"sampling_params must be a SamplingParams or a list"),
])
def test_bad_sampling_params_list_is_refused(params: Any, match: str) -> None:
    llm = make_llm()
    with pytest.raises(InvalidArgumentError, match=match):
        llm.generate(BATCH[:2], params, use_tqdm=False)
    assert_idle(llm)


def test_batch_is_admitted_all_or_nothing() -> None:
    """The second prompt can never fit the 7-block pool: the scheduler rejects it, and the
    first (valid) prompt is not admitted either."""
    llm = make_llm(num_blocks=8)
    with pytest.raises(RequestRejectedError, match="needs up to"):
        llm.generate([[1, 2, 3], list(range(40))], GREEDY, use_tqdm=False)
    assert_idle(llm)
    assert len(llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].token_ids) == 8


# -- SamplingParams -----------------------------------------------------------------------------
NAN, INF = math.nan, math.inf


@pytest.mark.parametrize("kwargs,match", [
    ({"temperature": NAN}, "temperature must be finite, got nan"),
    ({"temperature": INF}, "temperature must be finite, got inf"),
    ({"temperature": -INF}, "temperature must be finite, got -inf"),
    ({"temperature": -0.5}, "temperature must be >= 0, got -0.5"),
    ({"temperature": True}, "temperature must be a number, got True"),
    ({"temperature": "1.0"}, "temperature must be a number, got '1.0'"),
    ({"temperature": None}, "temperature must be a number, got None"),
    ({"temperature": 10**400}, "temperature must be finite, got 1000"),
    ({"top_p": 0}, r"top_p must be in \(0, 1\], got 0"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
    ({"top_p": -0.1}, r"top_p must be in \(0, 1\], got -0.1"),
    ({"top_p": NAN}, "top_p must be finite, got nan"),
    ({"top_p": INF}, "top_p must be finite, got inf"),
    ({"top_p": False}, "top_p must be a number, got False"),
    ({"top_k": -2}, "top_k must be >= 0 .*, got -2"),
    ({"top_k": True}, "top_k must be an int, got True"),
    ({"top_k": 1.5}, "top_k must be an int, got 1.5"),
    ({"top_k": "3"}, "top_k must be an int, got '3'"),
    ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
    ({"max_tokens": -3}, "max_tokens must be >= 1, got -3"),
    ({"max_tokens": 1.5}, "max_tokens must be an int, got 1.5"),
    ({"max_tokens": 2.0}, "max_tokens must be an int, got 2.0"),
    ({"max_tokens": True}, "max_tokens must be an int, got True"),
    ({"max_tokens": None}, "max_tokens must be an int, got None"),
    ({"seed": True}, "seed must be None or an int, got True"),
    ({"seed": 1.5}, "seed must be None or an int, got 1.5"),
    ({"seed": "7"}, "seed must be None or an int, got '7'"),
    ({"seed": 2**64}, r"seed must be in \[-2\*\*63, 2\*\*64\), got 18446744073709551616"),
    ({"ignore_eos": 1}, "ignore_eos must be a bool, got 1"),
    ({"ignore_eos": None}, "ignore_eos must be a bool, got None"),
    ({"stop_token_ids": (-1,)}, r"stop_token_ids\[0\] must be an int >= 0, got -1"),
    ({"stop_token_ids": [1, True]}, r"stop_token_ids\[1\] must be an int >= 0, got True"),
    ({"stop_token_ids": (1.5,)}, r"stop_token_ids\[0\] must be an int >= 0, got 1.5"),
    ({"stop_token_ids": 5}, "stop_token_ids must be a tuple or list of ints, got 5"),
    ({"stop_token_ids": "ab"}, "stop_token_ids must be a tuple or list of ints, got 'ab'"),
    ({"stop_token_ids": None}, "stop_token_ids must be a tuple or list of ints, got None"),
], ids=lambda v: repr(v) if isinstance(v, dict) else "")
def test_bad_sampling_params_name_the_field_and_value(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match) as info:
        SamplingParams(**kwargs)
    assert isinstance(info.value, ValueError)


def test_sampling_params_are_normalised() -> None:
    p = SamplingParams(temperature=0, top_p=1, top_k=-1, max_tokens=3, seed=-5,
                       stop_token_ids=[7, 8])  # type: ignore[arg-type]
    assert p.greedy and p.temperature == 0.0 and isinstance(p.temperature, float)
    assert p.top_k == 0  # -1: vLLM's "no top-k", stored as 0
    assert p.stop_token_ids == (7, 8) and isinstance(p.stop_token_ids, tuple)
    assert p == SamplingParams(temperature=0.0, top_p=1.0, max_tokens=3, seed=-5,
                               stop_token_ids=(7, 8))
    assert SamplingParams() == SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=64,
                                              ignore_eos=False, seed=None, stop_token_ids=())
    with pytest.raises(AttributeError):
        p.top_k = 3  # type: ignore[misc]


# -- failures inside a step ---------------------------------------------------------------------
@pytest.fixture
def llm() -> Iterator[LLM]:
    engine = make_llm()
    warm(engine)
    yield engine


def check_recovered(llm: LLM, want: list[list[int]]) -> None:
    assert_idle(llm)
    got = llm.generate(BATCH, GREEDY, use_tqdm=False)
    assert tokens(got) == want
    assert all(o.num_cached_tokens >= len(SYSTEM) for o in got)  # the cache is still used
    assert_idle(llm)


@pytest.mark.parametrize("fail_at,phase", [(1, "first-prefill"), (2, "chunked-prefill"),
                                           (5, "decode")])
def test_forward_failure_propagates_and_the_engine_recovers(
        llm: LLM, fresh_batch_tokens: list[list[int]], fail_at: int, phase: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    def record(inputs: Any) -> None:
        seen["decode_only"] = inputs.meta.is_decode_only
        seen["waiting"] = llm.scheduler.num_waiting

    boom = FailOn(llm.runner.forward, fail_at, RuntimeError("injected forward failure"), record)
    monkeypatch.setattr(llm.runner, "forward", boom)
    with pytest.raises(RuntimeError, match="injected forward failure"):
        llm.generate(BATCH, GREEDY, use_tqdm=False)
    assert seen["decode_only"] is (phase == "decode")
    assert seen["waiting"] > 0  # requests that never ran are aborted as well
    monkeypatch.undo()
    check_recovered(llm, fresh_batch_tokens)


def test_decode_failure_leaves_no_unwritten_block_in_the_cache(
        llm: LLM, fresh_batch_tokens: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompts that extend the failed requests' generated tokens would hit blocks allocated (and
    cached) by the failed decode step if they were not dropped."""
    for fail_at in range(3, 9):  # several decode steps: some of them complete a block
        monkeypatch.setattr(llm.runner, "forward",
                            FailOn(llm.runner.forward, fail_at, RuntimeError("decode boom")))
        with pytest.raises(RuntimeError, match="decode boom"):
            llm.generate(BATCH, GREEDY, use_tqdm=False)
        monkeypatch.undo()
        assert_idle(llm)
    longer = [p + out for p, out in zip(BATCH, fresh_batch_tokens)]
    want = tokens(make_llm().generate(longer, GREEDY, use_tqdm=False))
    assert tokens(llm.generate(longer, GREEDY, use_tqdm=False)) == want
    check_recovered(llm, fresh_batch_tokens)


class FlakySampler:
    """Delegates to a real sampler; call ``n`` raises ``exc`` or returns ``bad`` tokens."""

    def __init__(self, real: Sampler, n: int, exc: BaseException | None = None) -> None:
        self.real, self.n, self.exc, self.calls = real, n, exc, 0

    def forget(self, request_id: str) -> None:
        self.real.forget(request_id)

    def sample_async(self, logits: torch.Tensor, params: Any, rids: Any) -> SampledTokens:
        self.calls += 1
        out = self.real.sample_async(logits, params, rids)
        if self.calls == self.n:
            if self.exc is not None:
                raise self.exc
            # What reaches the host is not a token: update_from_output refuses it.
            return SampledTokens(out.device, tokens=[-1] * len(rids))
        return out


@pytest.mark.parametrize("exc", [RuntimeError("sampler boom"), None], ids=["raises", "bad-token"])
def test_sampler_or_update_failure_forgets_seeded_generators(
        llm: LLM, exc: BaseException | None, monkeypatch: pytest.MonkeyPatch) -> None:
    seeded = SamplingParams(temperature=0.9, top_k=50, max_tokens=8, ignore_eos=True, seed=11)
    want = tokens(make_llm().generate(BATCH, seeded, use_tqdm=False))
    real = llm.sampler
    flaky = FlakySampler(real, 4, exc)
    monkeypatch.setattr(llm, "sampler", flaky)
    expected = RuntimeError if exc is not None else InvalidArgumentError
    with pytest.raises(expected, match="sampler boom" if exc else "sampled token"):
        llm.generate(BATCH, seeded, use_tqdm=False)
    # A bad token is seen when its step is applied: with async scheduling, after the next
    # step was launched.
    assert flaky.calls == (5 if exc is None and llm.async_scheduling else 4)
    assert_idle(llm, real)  # no per-request generator survives
    monkeypatch.undo()
    assert tokens(llm.generate(BATCH, seeded, use_tqdm=False)) == want  # seeds: engine-independent
    assert_idle(llm)


def test_failure_inside_schedule_uncaches_blocks_allocated_ahead(
        llm: LLM, fresh_batch_tokens: list[list[int]]) -> None:
    """The second allocation of a step raises: the first request was admitted (its tail blocks
    cached at allocation, never written) when ``schedule`` fails."""
    # (kvcore.testing's fault injection: a compiled manager's methods cannot be patched.)
    refuse_allocation(llm.manager, {2}, error=RuntimeError("schedule boom"))
    with pytest.raises(RuntimeError, match="schedule boom"):
        llm.generate(BATCH, GREEDY, use_tqdm=False)
    check_recovered(llm, fresh_batch_tokens)  # later calls go through unchanged


def test_keyboard_interrupt_leaves_the_engine_usable(
        llm: LLM, fresh_batch_tokens: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llm.runner, "forward", FailOn(llm.runner.forward, 2, KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        llm.generate(BATCH, GREEDY, use_tqdm=False)
    monkeypatch.undo()
    check_recovered(llm, fresh_batch_tokens)


def test_step_failure_drops_only_that_steps_requests(llm: LLM,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """``step()`` on its own: the failed step's requests are aborted, waiting ones stay queued."""
    reqs = [llm.manager.make_request(f"own-{i}", p, max_tokens=4, sampling_params=GREEDY)
            for i, p in enumerate(BATCH)]
    llm.scheduler.add_requests(reqs)
    monkeypatch.setattr(llm.runner, "forward", FailOn(llm.runner.forward, 1, ValueError("x")))
    with pytest.raises(ValueError, match="x"):
        llm.step()
    monkeypatch.undo()
    assert [r.status.value for r in reqs] == ["abort", "abort", "waiting", "waiting"]
    while llm.scheduler.has_unfinished_requests():
        llm.step()
    assert [r.status.value for r in reqs] == ["abort", "abort", "length", "length"]
    assert_idle(llm)


def test_a_scheduler_that_never_schedules_does_not_spin_forever(
        llm: LLM, fresh_batch_tokens: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llm.scheduler, "schedule", lambda: SchedulerOutput([], [], [], 0, 0))
    with pytest.raises(RuntimeError, match=re.escape("scheduled nothing for 64 steps")):
        llm.generate(BATCH, GREEDY, use_tqdm=False)
    monkeypatch.undo()
    check_recovered(llm, fresh_batch_tokens)
