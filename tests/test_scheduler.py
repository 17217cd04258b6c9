"""The reference scheduler: chunked prefill mixed with decodes, prefix hits, recompute
preemption, stop conditions, admission limits, rejection, abort — and random workloads that
always finish with every block returned."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypedDict

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from kvcore import Request
from kvcore.connector import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
)
from kvcore.errors import InvalidArgumentError, UnknownRequestError
from kvcore.request import RequestStatus
from kvcore.scheduler import RequestRejectedError, Scheduler, SchedulerConfig, SchedulerOutput
from kvcore.specs import KVCacheSpec
from kvcore.testing import checked, refuse_allocation
from kvcore.testing.setups import cross
from kvcore.types import KVCacheBlocks
from tests.factories import full_spec, make_manager, swa_spec

if TYPE_CHECKING:
    from typing_extensions import Unpack


class SchedulerOptions(TypedDict, total=False):
    """Fields of :class:`SchedulerConfig`."""

    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    full_sequence_must_fit: bool


class StopOptions(TypedDict, total=False):
    """Stop conditions of a :class:`Request`."""

    eos_token_id: int | None
    ignore_eos: bool
    stop_token_ids: Sequence[int]


def sched(num_blocks: int = 64, max_model_len: int = 256, specs: tuple[KVCacheSpec, ...] = (),
          **cfg: Unpack[SchedulerOptions]) -> Scheduler:
    m = make_manager(*(specs or (full_spec(4),)), num_blocks=num_blocks,
                     max_model_len=max_model_len)
    return Scheduler(m, SchedulerConfig(**cfg))


def req(s: Scheduler, rid: str, tokens: list[int], max_tokens: int | None = 4,
        **kw: Unpack[StopOptions]) -> Request:
    r = s.kv.make_request(rid, tokens, max_tokens=max_tokens, **kw)
    s.add_request(r)
    return r


def step(s: Scheduler, token: int = 1, rng: random.Random | None = None
         ) -> tuple[SchedulerOutput, list[Request]]:
    out = s.schedule()
    sampled = {x.request_id: (rng.randrange(8) if rng else token) for x in out.scheduled if x.samples}
    finished = s.update_from_output(out, sampled)
    s.kv.check_invariants()
    return out, finished


def run(s: Scheduler, max_steps: int = 10_000, rng: random.Random | None = None) -> int:
    steps = 0
    while s.has_unfinished_requests():
        step(s, rng=rng)
        steps += 1
        assert steps < max_steps, "scheduler did not finish"
    return steps


def test_prefill_then_decode_until_max_tokens() -> None:
    s = sched()
    r = req(s, "a", list(range(10)), max_tokens=3)
    out, _ = step(s, token=7)
    (x,) = out.scheduled
    assert (x.num_computed_tokens, x.num_new_tokens, x.is_new, x.samples) == (0, 10, True, True)
    assert x.new_block_ids == ([1, 2, 3],) and x.token_ids == list(range(10))
    assert r.output_token_ids == [7] and r.num_computed_tokens == 10
    out, _ = step(s, token=8)
    assert [(x.num_computed_tokens, x.num_new_tokens) for x in out.scheduled] == [(10, 1)]
    out, finished = step(s, token=9)
    assert finished == [r] and r.status is RequestStatus.FINISHED_LENGTH
    assert r.output_token_ids == [7, 8, 9]
    assert s.kv.num_free_blocks == 63 and not s.has_unfinished_requests()
    assert s.schedule().finished_request_ids == ["a"]


def test_eos_stops_unless_ignored() -> None:
    s = sched()
    a = req(s, "a", [1, 2, 3], max_tokens=10, eos_token_id=0)
    b = req(s, "b", [4, 5, 6], max_tokens=2, eos_token_id=0, ignore_eos=True)
    c = req(s, "c", [4, 5, 6], max_tokens=10, stop_token_ids=[0])
    while s.has_unfinished_requests():
        step(s, token=0)
    assert a.status is RequestStatus.FINISHED_STOPPED and a.output_token_ids == [0]
    assert b.status is RequestStatus.FINISHED_LENGTH and b.output_token_ids == [0, 0]
    assert c.status is RequestStatus.FINISHED_STOPPED
    assert s.stats.finish_reasons == {"stop": 2, "length": 1}


def test_chunked_prefill_mixes_with_decode() -> None:
    s = sched(max_num_batched_tokens=16)
    a = req(s, "a", list(range(6)), max_tokens=5)
    step(s)  # a prefilled
    b = req(s, "b", list(range(100, 140)), max_tokens=2)
    out, _ = step(s)
    assert [(x.request_id, x.num_new_tokens, x.samples) for x in out.scheduled] == [
        ("a", 1, True), ("b", 15, False)]
    assert out.num_batched_tokens == 16 and b.output_token_ids == []
    out, _ = step(s)
    assert [(x.request_id, x.num_computed_tokens, x.num_new_tokens) for x in out.scheduled] == [
        ("a", 7, 1), ("b", 15, 15)]
    out, _ = step(s)
    assert [(x.request_id, x.num_new_tokens, x.samples) for x in out.scheduled] == [
        ("a", 1, True), ("b", 10, True)]
    assert len(b.output_token_ids) == 1
    run(s)
    assert a.status.is_finished and b.status.is_finished


def test_shared_prefix_hits_are_counted() -> None:
    s = sched()
    system = list(range(50, 82))
    first = req(s, "a", [*system, 1, 2], max_tokens=1)
    run(s)
    second = req(s, "b", [*system, 3, 4], max_tokens=1)
    out, _ = step(s)
    assert out.scheduled[0].num_computed_tokens == 32 and second.num_cached_tokens == 32
    assert s.stats.prefix_hit_tokens == 32 and first.num_cached_tokens == 0


def test_preemption_by_recompute_and_rehit() -> None:
    s = sched(num_blocks=21)  # 20 usable blocks of 4 tokens; 3 requests growing to 11 each
    reqs = [req(s, f"r{i}", list(range(i * 50, i * 50 + 14)), max_tokens=30) for i in range(3)]
    run(s)
    assert s.stats.num_preemptions > 0
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in reqs)
    assert all(len(r.output_token_ids) == 30 for r in reqs)
    # Prompts are disjoint, so every prefix hit is a preempted request finding its own blocks.
    assert s.stats.prefix_hit_tokens > 0
    assert any(r.num_preemptions and r.num_cached_tokens > 0 for r in reqs)
    assert s.kv.num_free_blocks == 20


def test_preempts_newest_and_readmits_it_first() -> None:
    s = sched(num_blocks=11)  # 10 usable; each request grows to 9 blocks
    a = req(s, "a", list(range(15)), max_tokens=20)
    b = req(s, "b", list(range(100, 115)), max_tokens=20)
    step(s)
    assert s.num_running == 2
    preempted = None
    for _ in range(40):
        out, _ = step(s)
        if out.preempted_request_ids:
            preempted = out.preempted_request_ids
            break
    assert preempted == ["b"] and b.status is RequestStatus.PREEMPTED
    assert s.waiting[0] is b and a.status is RequestStatus.RUNNING
    run(s)


def test_max_num_seqs_and_budget_limit_admission() -> None:
    s = sched(max_num_seqs=2)
    for i in range(4):
        req(s, f"r{i}", [i] * 5, max_tokens=3)
    out, _ = step(s)
    assert len(out.scheduled) == 2 and s.num_waiting == 2
    run(s)


def test_rejections() -> None:
    s = sched(num_blocks=5, max_model_len=64)  # 4 usable blocks
    with pytest.raises(RequestRejectedError, match="max_model_len"):
        req(s, "long", list(range(64)))
    with pytest.raises(RequestRejectedError, match="needs up to 5"):
        req(s, "big", list(range(10)), max_tokens=10)
    ok = req(s, "ok", list(range(10)), max_tokens=6)
    with pytest.raises(InvalidArgumentError, match="already"):
        s.add_request(ok)
    run(s)
    with pytest.raises(InvalidArgumentError, match="chunked"):
        Scheduler(s.kv, SchedulerConfig(enable_chunked_prefill=False, max_num_batched_tokens=32))


def test_abort_running_and_waiting() -> None:
    s = sched(max_num_seqs=1)
    a = req(s, "a", list(range(9)))
    b = req(s, "b", list(range(9)))
    step(s)
    s.abort_request("a")
    s.abort_request("b")
    assert a.status is RequestStatus.FINISHED_ABORTED and b.status is RequestStatus.FINISHED_ABORTED
    assert s.kv.num_free_blocks == 63 and not s.has_unfinished_requests()
    with pytest.raises(UnknownRequestError):
        s.abort_request("a")


def test_sampled_tokens_as_list_and_bad_count() -> None:
    s = sched()
    a = req(s, "a", [1, 2, 3])
    b = req(s, "b", [4, 5, 6])
    out = s.schedule()
    s.update_from_output(out, [11, 12])
    assert (a.output_token_ids, b.output_token_ids) == ([11], [12])
    out = s.schedule()
    with pytest.raises(InvalidArgumentError):
        s.update_from_output(out, [1])


def test_sliding_window_model_keeps_blocks_bounded() -> None:
    # With at most 16 tokens per step, a window-8 request never holds more than
    # cdiv(7 + 16, 4) + 1 = 7 blocks, though it grows to 55 blocks' worth of tokens.
    s = sched(num_blocks=12, specs=(swa_spec(8, 4),), max_model_len=512, max_num_batched_tokens=16)
    r = req(s, "a", list(range(20)), max_tokens=200)
    assert s.blocks_needed(r) == 7
    peak = 0
    while s.has_unfinished_requests():
        step(s)
        peak = max(peak, 11 - s.kv.num_free_blocks)
    assert r.status is RequestStatus.FINISHED_LENGTH and len(r.output_token_ids) == 200
    assert peak <= 5


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), chunked=st.booleans(), must_fit=st.booleans(),
       hybrid=st.booleans())
def test_random_workloads_always_finish_with_every_block_returned(
        seed: int, chunked: bool, must_fit: bool, hybrid: bool) -> None:
    rng = random.Random(seed)
    specs = (full_spec(4), swa_spec(rng.choice([4, 8, 16]), 4)) if hybrid else (full_spec(4),)
    max_len = 96
    num_blocks = rng.randint(26, 64) * len(specs)
    m = make_manager(*specs, num_blocks=num_blocks, max_model_len=max_len)
    budget = max_len if not chunked else rng.choice([8, 16, 32, 96])
    s = Scheduler(m, SchedulerConfig(max_num_seqs=rng.randint(1, 6), max_num_batched_tokens=budget,
                                     enable_chunked_prefill=chunked,
                                     full_sequence_must_fit=must_fit))
    families = [[rng.randrange(6) for _ in range(rng.randint(4, 40))] for _ in range(3)]
    submitted = []
    for i in range(rng.randint(1, 12)):
        base = rng.choice(families)
        prompt = base[:rng.randint(0, len(base))] + [rng.randrange(6) for _ in range(rng.randint(1, 20))]
        r = m.make_request(f"r{i}", prompt, max_tokens=rng.randint(1, 30), eos_token_id=7)
        try:
            s.add_request(r)
            submitted.append(r)
        except RequestRejectedError:
            assert s.blocks_needed(r) > num_blocks - 1
    run(s, max_steps=5000, rng=rng)
    assert all(r.status.is_finished and r.status is not RequestStatus.FINISHED_REJECTED
               for r in submitted)
    assert m.num_free_blocks == num_blocks - 1 and m.usage == 0.0
    m.check_invariants()


def test_add_requests_is_atomic() -> None:
    s = sched(num_blocks=8, max_model_len=64)
    ok = s.kv.make_request("ok", [1, 2, 3], max_tokens=2)
    dup = s.kv.make_request("ok", [4, 5, 6], max_tokens=2)
    with pytest.raises(InvalidArgumentError, match="already in the scheduler"):
        s.add_requests([ok, dup])
    too_long = s.kv.make_request("long", list(range(64)), max_tokens=2)
    with pytest.raises(RequestRejectedError, match="long"):
        s.add_requests([ok, too_long])
    assert not s.has_unfinished_requests() and not s.requests
    s.add_requests([ok])
    assert s.num_waiting == 1


def test_a_finished_request_cannot_be_added_again() -> None:
    s = sched()
    r = req(s, "a", [1, 2, 3], max_tokens=1)
    run(s)
    assert r.status is RequestStatus.FINISHED_LENGTH
    with pytest.raises(InvalidArgumentError, match="not new"):
        s.add_request(r)


def test_update_from_output_checks_every_token_before_applying_any() -> None:
    s = sched()
    a = req(s, "a", [1, 2, 3])
    b = req(s, "b", [4, 5, 6])
    out = s.schedule()
    for bad in ({"a": 1}, {"a": 1, "b": -1}, {"a": 1, "b": True}, {"a": 1, "b": 1.0}):
        with pytest.raises(InvalidArgumentError):
            s.update_from_output(out, bad)  # type: ignore[arg-type]  # bad on purpose
        assert a.output_token_ids == [] and b.output_token_ids == []
    s.update_from_output(out, {"a": 1, "b": 2})
    assert a.output_token_ids == [1] and b.output_token_ids == [2]


def test_an_encoder_decoder_request_gets_its_cross_attention_blocks() -> None:
    """A request carries its encoder token count; the scheduler allocates the cross-attention
    blocks for it at every admission (again after a preemption), counts them in what the request
    needs, and refuses a request whose encoder tokens do not fit the model (issue 45: the
    scheduler accepted a cross-attention config and ran every request with an empty table)."""
    m = checked(make_manager(full_spec(4), cross(4), num_blocks=32, max_model_len=64),
                track_contents=True)
    s = Scheduler(m, SchedulerConfig())
    r = s.kv.make_request("r", list(range(10)), max_tokens=3, num_encoder_tokens=9)
    assert s.blocks_needed(r) == 4 + 3  # decoder: 13 tokens; encoder: 9
    s.add_request(r)
    step(s)
    assert [len(ids) for ids in m.get_block_ids("r")] == [3, 3]
    refuse_allocation(m, {1})  # the next decode step finds no room: "r" is preempted
    out, _ = step(s)
    assert out.preempted_request_ids == ["r"] and "r" not in m.requests()
    step(s)  # re-admitted: its encoder output again
    assert [len(ids) for ids in m.get_block_ids("r")] == [3, 3]
    run(s)
    assert r.status is RequestStatus.FINISHED_LENGTH and m.num_free_blocks == 31
    with pytest.raises(InvalidArgumentError, match=r"'d'.*num_encoder_tokens=0.*cross-attention"):
        s.add_request(s.kv.make_request("d", [1, 2, 3]))
    decoder_only = sched()
    with pytest.raises(InvalidArgumentError, match=r"'e'.*num_encoder_tokens=4.*no cross"):
        decoder_only.add_request(decoder_only.kv.make_request("e", [1, 2], num_encoder_tokens=4))
    for bad in (-1, True, 1.5, None):
        with pytest.raises(InvalidArgumentError, match="num_encoder_tokens"):
            Request("x", [1], num_encoder_tokens=bad)  # type: ignore[arg-type]  # deliberately bad


def test_fail_step_uncaches_unwritten_blocks_and_aborts() -> None:
    s = sched(num_blocks=32)
    warm = req(s, "warm", list(range(12)), max_tokens=1)
    run(s)
    assert warm.status is RequestStatus.FINISHED_LENGTH
    # "a" hits the first 8 cached tokens; "b" is fresh. The step that was to compute their
    # remaining tokens fails: nothing it would have cached may be served later.
    a = req(s, "a", [*range(8), 50, 51, 52, 53, 54])
    b = req(s, "b", [60, 61, 62, 63, 64, 65, 66, 67, 68])
    out = s.schedule()
    assert [x.num_computed_tokens for x in out.scheduled] == [8, 0]
    aborted = s.fail_step(out)
    assert aborted == [a, b] and {a.status, b.status} == {RequestStatus.FINISHED_ABORTED}
    assert s.kv.num_free_blocks == 31 and not s.has_unfinished_requests()
    s.kv.check_invariants()
    # The prefix computed by "warm" is still cached; what the failed step would have written is not.
    again = s.kv.make_request("again", [*range(8), 50, 51, 52, 53, 54])
    assert s.kv.get_computed_blocks(again)[1] == 8
    other = s.kv.make_request("other", [60, 61, 62, 63, 64, 65, 66, 67, 68])
    assert s.kv.get_computed_blocks(other)[1] == 0


class _LookupLater(KVConnectorBase):
    """A user's own connector whose store answers a lookup only on the third try (``None``:
    "not known yet"), then supplies nothing; it records the calls the scheduler makes."""

    def __init__(self) -> None:
        super().__init__(KVConnectorRole.SCHEDULER)
        self.asked: dict[str, int] = {}
        self.allocated: list[tuple[str, int]] = []
        self.finished: list[str] = []

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        n = self.asked[request.request_id] = self.asked.get(request.request_id, 0) + 1
        return (None, False) if n < 3 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self.allocated.append((request.request_id, num_external_tokens))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request: Request,
                         block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        self.finished.append(request.request_id)
        return False, None


class _Offers(KVConnectorBase):
    """A connector whose store holds ``tokens`` tokens of request ``rid``'s prompt beyond the
    device hit (``None``: all of them, the last token included), loaded asynchronously or
    not; it has nothing for other requests."""

    def __init__(self, rid: str, load_async: bool, tokens: int | None = None) -> None:
        super().__init__(KVConnectorRole.SCHEDULER)
        self.rid = rid
        self.load_async = load_async
        self.tokens = tokens
        self.allocated: list[tuple[str, int]] = []

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        if request.request_id != self.rid:
            return 0, False
        rest = request.num_tokens - num_computed_tokens
        return (rest if self.tokens is None else min(self.tokens, rest)), self.load_async

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self.allocated.append((request.request_id, num_external_tokens))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return KVConnectorMetadata()


@pytest.mark.parametrize("load_async", [False, True])
def test_a_connector_offering_the_whole_prompt_leaves_the_last_token_to_compute(
        load_async: bool) -> None:
    """The last prompt token is computed, never loaded (its logits are sampled): a connector
    that offers the whole prompt is held to all but that token, as vLLM's connectors are."""
    conn = _Offers("r", load_async)
    m = make_manager(full_spec(4), num_blocks=32, max_model_len=256)
    s = Scheduler(m, SchedulerConfig(), conn)
    warm = req(s, "warm", list(range(8)), max_tokens=1)
    run(s)  # caches its first 8 tokens: the next prompt hits them on the device
    assert warm.status is RequestStatus.FINISHED_LENGTH
    conn.allocated.clear()
    r = req(s, "r", list(range(19)), max_tokens=2)
    out = s.schedule()
    assert conn.allocated == [("r", 19 - 8 - 1)]
    if load_async:  # parked while the load runs: nothing computed yet
        assert not out.scheduled and r.status is RequestStatus.WAITING_FOR_REMOTE_KVS
        s.update_from_output(out, {}, KVConnectorOutput(finished_recving={"r"}))
        out = s.schedule()
    (x,) = out.scheduled
    assert (x.num_computed_tokens, x.num_new_tokens, x.samples) == (18, 1, True)
    s.update_from_output(out, {"r": 5})
    assert r.all_token_ids[-1] == 5
    run(s)
    assert r.status is RequestStatus.FINISHED_LENGTH and m.num_free_blocks == 31
    m.check_invariants()


def test_a_connector_offering_only_the_last_token_loads_nothing() -> None:
    conn = _Offers("r", load_async=True, tokens=1)
    m = make_manager(full_spec(4), num_blocks=32, max_model_len=256)
    s = Scheduler(m, SchedulerConfig(), conn)
    req(s, "warm", list(range(8)), max_tokens=1)
    run(s)
    conn.allocated.clear()
    r = req(s, "r", list(range(9)), max_tokens=1)
    out = s.schedule()  # 8 hit on the device, the one left is computed: no load to wait for
    assert conn.allocated == [("r", 0)]
    (x,) = out.scheduled
    assert (x.num_computed_tokens, x.num_new_tokens, x.samples) == (8, 1, True)
    assert r.status is RequestStatus.RUNNING and not s.loading


@pytest.mark.parametrize("chunked", [False, True])
def test_a_loaded_request_is_not_chunked_without_chunked_prefill(chunked: bool) -> None:
    """A request whose KV the connector loaded asynchronously is admitted with all its
    remaining tokens in one step when chunked prefill is off, as any other request."""
    conn = _Offers("loaded", load_async=True, tokens=8)
    m = make_manager(full_spec(4), num_blocks=64, max_model_len=32)
    s = Scheduler(m, SchedulerConfig(max_num_batched_tokens=32, enable_chunked_prefill=chunked),
                  conn)
    short = [req(s, f"s{i}", [100 + i, 200 + i], max_tokens=3) for i in range(10)]
    loaded = req(s, "loaded", list(range(31)), max_tokens=1)
    out = s.schedule()  # ten 2-token prefills; "loaded" starts loading 8 tokens
    assert [x.num_new_tokens for x in out.scheduled] == [2] * 10
    assert conn.allocated[-1] == ("loaded", 8)
    s.update_from_output(out, {x.request_id: 1 for x in out.scheduled},
                         KVConnectorOutput(finished_recving={"loaded"}))
    shares = []
    while s.has_unfinished_requests():
        out, _ = step(s)
        shares += [x.num_new_tokens for x in out.scheduled if x.request_id == "loaded"]
    # 23 tokens remain after the load; the ten decodes leave 22 of the step's 32.
    assert shares == ([22, 1] if chunked else [23])
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in [*short, loaded])
    assert m.num_free_blocks == 63


def test_a_connector_that_does_not_know_yet_keeps_the_queue_in_order() -> None:
    conn = _LookupLater()
    m = make_manager(full_spec(4), num_blocks=32, max_model_len=256)
    s = Scheduler(m, SchedulerConfig(), conn)
    a = s.kv.make_request("a", list(range(9)), max_tokens=3)
    b = s.kv.make_request("b", list(range(50, 60)), max_tokens=3)
    s.add_requests([a, b])
    for _ in range(2):  # "a" is not known yet: it is not admitted, nor is "b" behind it
        out, _ = step(s)
        assert not out.scheduled and s.num_waiting == 2 and m.pool.num_free_blocks == 31
    out, _ = step(s)
    assert [x.request_id for x in out.scheduled] == ["a"]  # b's first answer is None too
    assert conn.asked == {"a": 3, "b": 1} and conn.allocated == [("a", 0)]
    run(s)
    assert conn.asked["b"] == 3 and conn.allocated == [("a", 0), ("b", 0)]
    assert sorted(conn.finished) == ["a", "b"] and m.pool.num_free_blocks == 31
