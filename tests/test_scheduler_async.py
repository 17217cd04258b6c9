"""Async scheduling (``SchedulerConfig(async_scheduling=True)``): step N+1 is scheduled before
step N's tokens are reported, with placeholders for the tokens in flight.

A fake device keeps the KV cache's contents (the token written at each slot) and computes every
sampled token from what it *reads back through the block table*, so a wrong table, a prefix hit
serving another request's KV, or a placeholder filled from the wrong step changes the tokens.
Async runs must produce exactly the sync runs' outputs, under chunked prefill, preemption,
prefix hits, EOS/stop tokens and hybrid sliding-window groups, with the manager's invariants
checked after every step.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from kvcore.connector import KVConnectorRole, OffloadingConnector
from kvcore.errors import InvalidArgumentError
from kvcore.request import Request, RequestStatus
from kvcore.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvcore.specs import KVCacheSpec
from tests.factories import full_spec, make_manager, swa_spec

VOCAB = 23
EOS = 0


class FakeDevice:
    """The KV cache's contents per (group, slot) and a 'model' reading them back."""

    def __init__(self, specs: tuple[KVCacheSpec, ...]) -> None:
        self.specs = specs
        self.kv: dict[tuple[int, int], tuple[int, int]] = {}  # (group, slot) -> (pos, token)

    def run(self, out: SchedulerOutput, in_flight: dict[str, int] | None) -> dict[str, int]:
        """Write the step's tokens, sample from what the block tables read back.  Positions
        the scheduler left as placeholders take the token the in-flight step sampled."""
        sampled: dict[str, int] = {}
        for s in out.scheduled:
            tokens = s.token_ids
            missing = s.num_new_tokens - len(tokens)
            assert missing in (0, 1), (s, missing)
            if missing:
                assert in_flight is not None and s.request_id in in_flight, s
                tokens = [*tokens, in_flight[s.request_id]]
            tables = s.block_ids
            start = s.num_computed_tokens
            self._read_context(s.request.all_token_ids, tables, start)
            for pos, tok in enumerate(tokens, start):
                for g, spec in enumerate(self.specs):
                    block = tables[g][pos // spec.block_size]
                    assert block != 0, (s, g, pos)
                    self.kv[g, block * spec.block_size + pos % spec.block_size] = (pos, tok)
            if s.samples:
                sampled[s.request_id] = self._next(tables, start + s.num_new_tokens)
        return sampled

    def _read_context(self, known: list[int], tables: tuple[list[int], ...], start: int) -> None:
        """What the step's first new token attends to in the cache, per group: positions
        [start - window + 1, start) (all of [0, start) for full attention) must hold KV written
        for that position and, where the token is known, that token."""
        for g, spec in enumerate(self.specs):
            bs = spec.block_size
            window = getattr(spec, "sliding_window", None) or start + 1
            for pos in range(max(0, start - window + 1), start):
                block = tables[g][pos // bs]
                got = self.kv.get((g, block * bs + pos % bs))
                assert block != 0 and got is not None and got[0] == pos, (g, pos, block, got)
                assert pos >= len(known) or got[1] == known[pos], (g, pos, got, known[pos])

    def _next(self, tables: tuple[list[int], ...], length: int) -> int:
        """A token from the KV of positions [0, length) as group 0 (full attention) reads them;
        the other groups must read the same tokens over their windows."""
        seq: list[int] = []
        for g, spec in enumerate(self.specs):
            bs = spec.block_size
            window = getattr(spec, "sliding_window", None) or length
            for pos in range(max(0, length - window), length):
                got = self.kv.get((g, tables[g][pos // bs] * bs + pos % bs))
                assert got is not None and got[0] == pos, (g, pos, got)
                if g == 0:
                    seq.append(got[1])
                else:
                    assert got[1] == seq[pos], (g, pos)
        h = 0
        for t in seq:
            h = (h * 31 + t + 7) % 1_000_003
        return h % VOCAB


@dataclass
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]
    stop: list[tuple[int, ...]]


def workload(rng: random.Random) -> Workload:
    base = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(4, 24))]
    prompts = []
    for _ in range(rng.randrange(2, 9)):
        own = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 30))]
        prompts.append(base[:rng.randrange(len(base) + 1)] + own if rng.random() < 0.6 else own)
    return Workload(prompts, [rng.randrange(1, 20) for _ in prompts],
                    [tuple(rng.sample(range(1, VOCAB), rng.randrange(0, 2))) for _ in prompts])


def make(specs: tuple[KVCacheSpec, ...], num_blocks: int, async_scheduling: bool,
         budget: int, max_num_seqs: int = 8, policy: str = "fcfs") -> Scheduler:
    m = make_manager(*specs, num_blocks=num_blocks, max_model_len=96)
    return Scheduler(m, SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                        async_scheduling=async_scheduling,
                                        schedule_policy=policy, max_waiting_steps=4))


def submit(s: Scheduler, w: Workload) -> list[Request]:
    reqs = [s.kv.make_request(str(i), p, max_tokens=mt, eos_token_id=EOS, stop_token_ids=st)
            for i, (p, mt, st) in enumerate(zip(w.prompts, w.max_tokens, w.stop))]
    s.add_requests(reqs)
    return reqs


def drive_sync(s: Scheduler, dev: FakeDevice) -> None:
    for _ in range(5000):
        if not s.has_unfinished_requests():
            return
        out = s.schedule()
        s.update_from_output(out, dev.run(out, None))
        s.kv.check_invariants()
    raise AssertionError("sync run did not finish")


def drive_async(s: Scheduler, dev: FakeDevice,
                fail: Callable[[int, SchedulerOutput], bool] | None = None) -> bool:
    """Schedule N+1, run it, then report N, until everything finished.  ``fail(i, out)``
    true (asked only while a step is in flight, and until it once answers true): the step in
    flight and the just-scheduled ``out`` fail instead, the device forgetting both steps'
    writes.  Returns whether a failure was injected."""
    in_flight: tuple[SchedulerOutput, dict[str, int]] | None = None
    before_in_flight = dict(dev.kv)  # the device's KV before the step in flight ran
    failed = False
    for i in range(5000):
        if not s.has_unfinished_requests() and in_flight is None:
            return failed
        out = s.schedule()
        s.kv.check_invariants()
        for x in out.scheduled:  # nothing runs past its limits, counting what is in flight
            r = x.request
            assert r.num_computed_tokens <= r.num_tokens + r.num_output_placeholders - (
                0 if x.samples else 1)
            assert r.max_tokens is None or r.num_output_tokens + r.num_output_placeholders \
                <= r.max_tokens
        if fail is not None and in_flight is not None and not failed and fail(i, out):
            failed = True
            dev.kv = before_in_flight  # neither step wrote anything
            s.fail_step(in_flight[0])
            s.fail_step(out)
            s.kv.check_invariants()
            in_flight = None
            continue
        before = dict(dev.kv)
        sampled = dev.run(out, in_flight[1] if in_flight else None)  # asserts what it reads
        if in_flight is not None:
            s.update_from_output(*in_flight)
            s.kv.check_invariants()
        before_in_flight = before
        in_flight = (out, sampled) if out.scheduled else None
    raise AssertionError("async run did not finish")


SPECS = {
    "full": (full_spec(4),),
    "full-bs3": (full_spec(3),),
    "hybrid": (full_spec(4), swa_spec(8, 4)),
    "swa": (swa_spec(8, 4),),
}


@pytest.mark.parametrize("kind", sorted(SPECS))
@pytest.mark.parametrize(("seed", "policy"), [(seed, "fcfs") for seed in range(12)]
                         + [(seed, p) for seed in range(4) for p in ("lpm", "dfs-weight")])
def test_async_outputs_equal_sync(kind: str, seed: int, policy: str) -> None:
    """(Non-FCFS admission orders too: reordered, async and sync still read only the KV they
    wrote, so every request's output is the same.)"""
    rng = random.Random(seed)
    w = workload(rng)
    specs = SPECS[kind]
    budget = rng.choice([5, 16, 64])
    probe = make(specs, 1000, False, budget)
    need = max(probe.blocks_needed(r) for r in submit(probe, w))
    num_blocks = need + 1 + rng.choice([0, 3, 200])  # small pools preempt
    results = []
    for async_scheduling in (False, True):
        s = make(specs, num_blocks, async_scheduling, budget, policy=policy)
        reqs = submit(s, w)
        dev = FakeDevice(specs)
        if async_scheduling:
            drive_async(s, dev)
        else:
            drive_sync(s, dev)
        assert s.kv.num_free_blocks == num_blocks - 1
        assert all(r.num_output_placeholders == 0 for r in reqs)
        results.append([(r.output_token_ids, r.status) for r in reqs])
    assert results[0] == results[1]


def test_placeholder_positions_are_scheduled_before_the_token_is_known() -> None:
    s = make((full_spec(4),), 32, True, 64)
    (r,) = submit(s, Workload([[5, 6, 7]], [3], [()]))
    first = s.schedule()
    assert first.scheduled[0].samples and r.num_output_placeholders == 1
    second = s.schedule()  # before the first step's token is reported
    (x,) = second.scheduled
    assert (x.num_computed_tokens, x.num_new_tokens, x.token_ids) == (3, 1, [])
    assert x.samples and r.num_output_placeholders == 2 and r.num_computed_tokens == 4
    s.update_from_output(first, {"0": 9})
    assert r.output_token_ids == [9] and r.num_output_placeholders == 1
    assert second.scheduled[0].token_ids == [9]  # known now
    third = s.schedule()  # output 1 known, 1 in flight, 1 to sample: max_tokens=3 reached
    assert [x.num_new_tokens for x in third.scheduled] == [1]
    s.update_from_output(second, {"0": 4})
    assert s.schedule().scheduled == []  # the third and last token is in flight


def test_no_step_is_scheduled_past_max_tokens() -> None:
    s = make((full_spec(4),), 32, True, 64)
    (r,) = submit(s, Workload([[5, 6, 7]], [1], [()]))
    first = s.schedule()
    assert s.schedule().scheduled == []  # its only token is in flight
    s.update_from_output(first, {"0": 4})
    assert r.status is RequestStatus.FINISHED_LENGTH and s.kv.num_free_blocks == 31


def test_eos_drops_the_extra_step_and_frees_everything() -> None:
    s = make((full_spec(4),), 32, True, 64)
    (r,) = submit(s, Workload([[5, 6, 7]], [10], [()]))
    first = s.schedule()
    second = s.schedule()
    assert s.update_from_output(first, {"0": EOS}) == [r]
    assert r.status is RequestStatus.FINISHED_STOPPED and s.kv.num_free_blocks == 31
    assert s.update_from_output(second, {"0": 3}) == []  # dropped: it finished
    assert r.output_token_ids == [EOS] and not s.has_unfinished_requests()


def test_request_preempted_in_flight_keeps_its_token_and_can_finish_waiting() -> None:
    s = make((full_spec(4),), 6, True, 64)  # 5 usable blocks
    _, b = submit(s, Workload([[1] * 8, [2] * 8], [5, 5], [(), (7,)]))
    first = s.schedule()  # both prefill: 2 + 2 blocks
    assert [x.request_id for x in first.scheduled] == ["0", "1"]
    second = s.schedule()  # both need a 3rd block: the newest (b) is preempted
    assert second.preempted_request_ids == ["1"] and b.status is RequestStatus.PREEMPTED
    assert [x.request_id for x in second.scheduled] == ["0"]
    finished = s.update_from_output(first, {"0": 3, "1": 7})  # b's token is a stop token
    assert finished == [b] and b.output_token_ids == [7]
    assert b.status is RequestStatus.FINISHED_STOPPED and b not in s.waiting
    s.kv.check_invariants()


def test_preempted_request_is_readmitted_only_after_its_token_is_reported() -> None:
    s = make((full_spec(4),), 6, True, 64)
    _, b = submit(s, Workload([[1] * 8, [2] * 8], [5, 5], [(), ()]))
    first = s.schedule()
    second = s.schedule()  # preempts b with its first token in flight
    assert b.status is RequestStatus.PREEMPTED and b.num_output_placeholders == 1
    s.abort_request("0")  # room for b, but its token is unknown: not admitted yet
    assert s.schedule().scheduled == [] and b.status is RequestStatus.PREEMPTED
    s.update_from_output(first, {"0": 3, "1": 4})
    s.update_from_output(second, {"0": 5})
    third = s.schedule()
    (x,) = third.scheduled
    # Re-admitted with its prompt's KV still cached: it computes the reported token only.
    assert x.request is b and (x.num_computed_tokens, x.token_ids) == (8, [4])
    assert b.num_output_placeholders == 1


def test_async_scheduling_is_refused_with_a_connector_and_must_be_a_bool() -> None:
    m = make_manager(full_spec(4), num_blocks=16)
    conn = OffloadingConnector(KVConnectorRole.SCHEDULER, m.config, num_host_blocks=8)
    with pytest.raises(InvalidArgumentError, match="connector"):
        Scheduler(m, SchedulerConfig(async_scheduling=True), conn)
    with pytest.raises(InvalidArgumentError, match="async_scheduling"):
        SchedulerConfig(async_scheduling=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", sorted(SPECS))
@pytest.mark.parametrize(("seed", "policy"), [(seed, "fcfs") for seed in range(10)]
                         + [(seed, "lpm") for seed in range(3)])
def test_failing_the_in_flight_step_after_the_next_schedule(kind: str, seed: int,
                                                            policy: str) -> None:
    """Step N fails after step N+1 was scheduled on top of it (and preempted some of its
    requests, or moved sliding windows): both are failed and the device forgets both steps'
    writes.  No later step may read KV they did not write, nothing is stuck, and new traffic
    sharing their prompts finishes."""
    rng = random.Random(seed)
    w = workload(rng)
    specs = SPECS[kind]
    budget = rng.choice([5, 16, 64])
    probe = make(specs, 1000, False, budget)
    num_blocks = max(probe.blocks_needed(r) for r in submit(probe, w)) + 1 + rng.choice([0, 3])
    s = make(specs, num_blocks, True, budget, policy=policy)
    submit(s, w)

    def fail(i: int, out: SchedulerOutput) -> bool:
        if not (out.preempted_request_ids or i % 7 == 3):
            return False
        more = [s.kv.make_request(f"n{j}", list(p), max_tokens=2, eos_token_id=EOS)
                for j, p in enumerate(w.prompts)]  # new traffic sharing their prompts
        s.add_requests([r for r in more if s.blocks_needed(r) < num_blocks])
        return True

    failed = drive_async(s, FakeDevice(specs), fail)
    assert failed and s.kv.num_free_blocks == num_blocks - 1


@pytest.mark.parametrize("kind", ["swa", "hybrid"])
def test_failed_step_that_completed_a_block_the_next_schedule_slid_past(kind: str) -> None:
    """Step N completes a sliding-window block that step N-1 partly filled and runs on past the
    window, so step N+1's schedule frees that block from the request's table; then step N
    fails.  The block's hash (made in step N) must leave the prefix cache with the rest: a
    later request with the same prompt may not be served KV that was never written."""
    specs = SPECS[kind]
    prompt = [(7 * i) % (VOCAB - 1) + 1 for i in range(30)]
    s = make(specs, 40, True, budget=14)
    s.add_requests([s.kv.make_request("a", prompt, max_tokens=2, eos_token_id=EOS)])

    def fail(i: int, out: SchedulerOutput) -> bool:
        if i != 2:  # in flight: step 1 (tokens 14..27, completing block 12..15)
            return False
        s.add_requests([s.kv.make_request("b", [*prompt, 5, 6], max_tokens=3, eos_token_id=EOS)])
        return True

    assert drive_async(s, FakeDevice(specs), fail)  # the device asserts what it reads back
    assert s.kv.num_free_blocks == 40 - 1
