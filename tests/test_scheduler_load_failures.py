"""Failed KV loads, aborts and reused request ids in kvcore's scheduler with a KV connector
(issue 45): a request whose load failed goes on from its first unwritten token where every
group can, else starts over; requests that hit what the load was to write are set back too; a
request id is free again only once its transfers are reported; and the scheduler-level fuzz
run (``kvcore.testing.scheduler_driver``) over every group type and admission policy, with
the content oracle on."""

from __future__ import annotations

from typing import Any

import pytest

from kvcore.connector import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
)
from kvcore.connector.base import StepOutput
from kvcore.errors import InvalidArgumentError
from kvcore.manager import KVCacheManager
from kvcore.request import Request, RequestStatus
from kvcore.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvcore.specs import KVCacheConfig, KVCacheGroup, KVCacheSpec
from kvcore.testing import assert_no_leak, checked
from kvcore.testing.scheduler_driver import (
    SCHEDULER_SETUPS,
    SchedulerDriver,
    SchedulerSetup,
    random_operation,
)
from kvcore.testing.setups import Setup, chunked, cross, full, mamba, mamba_align, swa
from kvcore.types import KVCacheBlocks


class _Offers(KVConnectorBase):
    """Offers ``tokens`` tokens beyond the device hit to the listed requests, once (so a
    request that starts over computes them; asynchronously for those in ``load_async``), and
    holds the blocks of the requests in ``store`` after they
    finish until the test reports their store done."""

    def __init__(self, tokens: dict[str, int], load_async: frozenset[str] = frozenset(),
                 store: frozenset[str] = frozenset()) -> None:
        super().__init__(KVConnectorRole.SCHEDULER)
        self.tokens = tokens
        self.load_async = load_async
        self.store = store

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        n = self.tokens.pop(request.request_id, 0)
        return n, n > 0 and request.request_id in self.load_async

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: StepOutput) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request: Request,
                         block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return request.request_id in self.store, None


def _scheduler(specs: tuple[KVCacheSpec, ...], connector: KVConnectorBase,
               **cfg: Any) -> Scheduler:
    groups = tuple(KVCacheGroup((f"layer{i}",), s) for i, s in enumerate(specs))
    m = checked(KVCacheManager(KVCacheConfig(64, groups), 64), track_contents=True)
    return Scheduler(m, SchedulerConfig(max_num_batched_tokens=64, **cfg), connector)


def _add(s: Scheduler, rid: str, tokens: list[int], max_tokens: int = 2) -> Request:
    extra = {"num_encoder_tokens": 6} if any(g.spec.reads_encoder
                                             for g in s.kv.config.groups) else {}
    req = s.kv.make_request(rid, tokens, max_tokens=max_tokens, ignore_eos=True, **extra)
    s.add_request(req)
    return req


def _run(s: Scheduler, out: SchedulerOutput | None = None,
         conn: KVConnectorOutput | None = None) -> None:
    """Report ``out`` (with ``conn``), then run until every request is done."""
    for _ in range(200):
        if out is not None:
            s.update_from_output(out, {x.request_id: 1 for x in out.scheduled if x.samples},
                                 conn)
            conn = None
        if not s.has_unfinished_requests():
            return
        out = s.schedule()
    raise AssertionError("did not finish")


def _states_exist(s: Scheduler) -> None:
    """Every running request's state groups hold a block for the state its next token reads."""
    for req in s.running:
        n = req.num_computed_tokens
        for g, (group, blocks) in enumerate(zip(s.kv.config.groups, s.kv.get_blocks(req.request_id))):
            if group.spec.holds_state and n:
                i = (n - 1) // group.spec.block_size
                assert i < len(blocks) and not blocks[i].is_null, (
                    f"request {req.request_id!r} goes on from {n} tokens, but group {g} holds no "
                    "state there")


PROMPT = [(7 * i) % 5 for i in range(33)]


@pytest.mark.parametrize(("specs", "group", "which", "resumes"), [
    ((full(4),), 0, 1, True),
    ((swa(7, 4),), 0, 0, False),
    ((chunked(13, 4),), 0, 0, False),
    ((full(4), chunked(6, 4)), 0, 1, False),
    ((full(4), chunked(6, 4)), 1, 0, True),  # the chunk's first block: nothing before it read
    ((full(4), mamba(4)), 0, 1, False),
    ((full(4), mamba(4)), 1, -1, False),  # the state the load brought
    ((full(4), mamba_align(4)), 0, 1, False),
    ((full(4), cross(4)), 0, 1, True),
], ids=["full", "swa", "chunked", "full+chunked", "chunk-start", "full+mamba", "mamba-state",
        "mamba-align", "full+cross"])
def test_a_failed_synchronous_load_resumes_only_where_every_group_can(
        specs: tuple[KVCacheSpec, ...], group: int, which: int, resumes: bool) -> None:
    """The load of 28 tokens fails in one block (the ``which``-th real block of group
    ``group``).  Where the tables still hold everything the request reads from there on, it
    goes on from that block; where a window or chunk released what it reads, or a state group
    has no state there, it starts over.  Before, it always went on from the block, reading
    null positions (the checked manager's ``[wrong-kv]``) or a missing state."""
    s = _scheduler(specs, _Offers({"r": 28}))
    r = _add(s, "r", PROMPT)
    out = s.schedule()
    assert r.num_computed_tokens == 33  # 28 loaded, 5 computed
    bad = [b for b in s.kv.get_block_ids("r")[group] if b][which]
    s.update_from_output(out, {"r": 1}, KVConnectorOutput(invalid_block_ids={bad}))
    assert r.num_output_tokens == 0 and s.stats.load_failures == 1
    assert s.kv.pool.blocks[bad].block_hash is None  # never served from the cache
    _states_exist(s)
    assert (r.status is RequestStatus.RUNNING) == resumes, r.status
    assert r.num_computed_tokens == (s.kv.config.groups[group].spec.block_size
                                     * s.kv.get_block_ids("r")[group].index(bad)
                                     if resumes else 0)
    _run(s)
    assert r.status is RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 2
    assert_no_leak(s.kv)


def test_requests_that_hit_a_failed_load_in_its_step_are_set_back_too() -> None:
    """"b" is admitted in the step that loads "a"'s prefix and hits those blocks (they are
    cached at allocation) and the one "a" computes after them; one of the loaded blocks
    fails.  Both are set back, each recomputes, and both tables stay consistent (before, both
    went on from the failed block into the blocks they share: recomputed twice, cached for
    one of them only — a broken invariant)."""
    s = _scheduler((full(4),), _Offers({"a": 12}))
    a = _add(s, "a", PROMPT[:20])
    b = _add(s, "b", [*PROMPT[:16], 4, 4, 4, 4, 4])
    out = s.schedule()
    assert [(x.request_id, x.num_computed_tokens) for x in out.scheduled] == [("a", 12), ("b", 16)]
    bad = s.kv.get_block_ids("a")[0][1]
    assert bad in s.kv.get_block_ids("b")[0]
    s.update_from_output(out, {"a": 1, "b": 1}, KVConnectorOutput(invalid_block_ids={bad}))
    assert a.num_output_tokens == b.num_output_tokens == 0
    assert all(x.num_computed_tokens <= 4 for x in (a, b))
    _run(s)
    assert a.num_output_tokens == b.num_output_tokens == 2
    assert_no_leak(s.kv)


def test_a_loading_request_that_hit_a_failed_load_starts_over() -> None:
    """"b" hits "a"'s synchronously loaded blocks in the same step and waits for its own
    asynchronous load; one of "a"'s blocks fails.  "b" counts nothing computed from then on
    and starts over once its load is reported (before, it ran on the failed block)."""
    s = _scheduler((full(4),), _Offers({"a": 12, "b": 8}, load_async=frozenset({"b"})))
    a = _add(s, "a", PROMPT[:20])
    b = _add(s, "b", PROMPT[:30])
    out = s.schedule()
    assert b.status is RequestStatus.WAITING_FOR_REMOTE_KVS and b.num_computed_tokens == 20
    bad = s.kv.get_block_ids("a")[0][0]
    s.update_from_output(out, {"a": 1}, KVConnectorOutput(invalid_block_ids={bad}))
    assert b.num_computed_tokens == 0
    _run(s, s.schedule(), KVConnectorOutput(finished_recving={"b"}))
    assert a.num_output_tokens == b.num_output_tokens == 2
    assert s.stats.load_failures == 3  # a, b's hit, b's load restarted
    assert_no_leak(s.kv)


def test_an_id_is_free_again_once_its_transfers_are_reported() -> None:
    """A finished request whose blocks the connector still stores holds its id: a new request
    under it is refused (the store's report would be taken for the new one's) until the store
    is reported; then it runs (before: accepted, then refused by the manager, which still held
    the old request's blocks under the id)."""
    conn = _Offers({}, store=frozenset({"a"}))
    s = _scheduler((full(4),), conn)
    old = _add(s, "a", PROMPT[:10], max_tokens=1)
    out = s.schedule()
    s.update_from_output(out, {"a": 1})
    assert old.status is RequestStatus.FINISHED_LENGTH and s.has_unfinished_requests()
    with pytest.raises(InvalidArgumentError, match=r"'a'.*still transfers"):
        _add(s, "a", PROMPT[:12])
    assert "a" not in s.requests
    conn.store = frozenset()
    s.update_from_output(s.schedule(), {}, KVConnectorOutput(finished_sending={"a"}))
    new = _add(s, "a", PROMPT[:12])
    _run(s)
    assert new.status is RequestStatus.FINISHED_LENGTH and new.num_output_tokens == 2
    assert_no_leak(s.kv)


@pytest.mark.parametrize("bad", [0, 64, -1, "3"])
def test_a_block_id_that_is_not_the_pools_is_refused_before_anything_changes(bad: Any) -> None:
    s = _scheduler((full(4),), _Offers({"r": 8}))
    r = _add(s, "r", PROMPT[:12])
    out = s.schedule()
    with pytest.raises(InvalidArgumentError, match="invalid_block_ids"):
        s.update_from_output(out, {"r": 1}, KVConnectorOutput(invalid_block_ids={bad}))
    assert r.num_output_tokens == 0 and r.num_computed_tokens == 12 and s.stats.load_failures == 0
    _run(s, out)
    assert r.num_output_tokens == 2


# -- the scheduler-level fuzz run -----------------------------------------------------------
@pytest.mark.parametrize("ssetup", SCHEDULER_SETUPS, ids=[s.name for s in SCHEDULER_SETUPS])
def test_scheduler_fuzz(ssetup: SchedulerSetup) -> None:
    """A short seeded run per group type and admission policy (the long one:
    ``python -m kvcore.bench fuzz --scheduler``): submits, resubmissions under used ids,
    aborts, steps and failed steps with a connector whose sync and async loads fail; the
    checked manager's oracle and the driver's checks after every operation, then a drain."""
    driver = SchedulerDriver(ssetup, seed=11)
    for _ in range(200):
        random_operation(driver)
    driver.drain()
    assert driver.counts["step"] > 0 and driver.counts["finished"] > 0


def test_scheduler_fuzz_covers_what_it_claims() -> None:
    """Over the short runs of a few setups: failed sync and async loads, preemptions, aborts,
    failed steps, and ids used again, accepted and refused."""
    total: dict[str, int] = {}
    for ssetup in SCHEDULER_SETUPS[:6]:
        driver = SchedulerDriver(ssetup, seed=11)
        for _ in range(120):
            random_operation(driver)
        driver.drain()
        for k, v in driver.counts.items():
            total[k] = total.get(k, 0) + v
    for key in ("failed loads (sync)", "failed loads (async)", "preemptions", "abort",
                "fail_step", "resubmission refused", "delayed frees", "load failures recomputed"):
        assert total.get(key, 0) > 0, (key, total)
    assert total["resubmit"] > total["resubmission refused"]  # some were accepted


class _AlwaysResumes(KVCacheManager):
    """A planted bug: every request may go on from its failed block (as before issue 45)."""

    def can_resume(self, request_id: str, num_computed_tokens: Any) -> bool:
        return True


def test_scheduler_fuzz_catches_a_request_going_on_into_released_blocks() -> None:
    setup = Setup("swa7 planted", (swa(7, 4),), manager_class=_AlwaysResumes)
    with pytest.raises(AssertionError, match="wrong-kv"):
        for seed in range(10):
            driver = SchedulerDriver(SchedulerSetup(setup, "fcfs"), seed=seed)
            for _ in range(300):
                random_operation(driver)
            driver.drain()


def test_the_long_run_command(capsys: pytest.CaptureFixture[str]) -> None:
    from kvcore.bench.__main__ import main

    assert main(["fuzz", "--scheduler", "--ops", "200", "--round-ops", "100", "--setup",
                 "swa7 lpm"]) == 0
    out = capsys.readouterr().out
    assert "200 operations in 2 rounds over 1 setups" in out and "0 violations" in out
    assert "failed loads (sync, async)" in out and "swa7 lpm" in out
