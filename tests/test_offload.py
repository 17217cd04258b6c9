"""The host tier (``kvcore.connector.host_tier``), the offloading connector
(``kvcore.connector``) and the scheduler's connector path: loads, stores, delayed frees, failed
loads and failed steps."""

from __future__ import annotations

import json
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvcore.cli import main as kvcore_main
from kvcore.connector import (
    InstantTransfer,
    KVConnectorRole,
    OffloadingConnector,
    TransferHandler,
    TransferSpec,
)
from kvcore.connector.host_tier import HostOffloadingManager, OffloadKey
from kvcore.errors import BlockStateError, InvalidArgumentError
from kvcore.events import BlockRemoved, BlockStored
from kvcore.manager import KVCacheManager
from kvcore.request import Request, RequestStatus
from kvcore.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvcore.sim.cluster import ClusterConfig, replay_cluster
from kvcore.sim.replay import ReplayConfig, replay
from kvcore.sim.workloads import multi_turn
from kvcore.testing.machine import SchedulerMachine
from kvcore.testing.setups import full
from kvcore.types import BlockHash
from tests.factories import make_config, run_main

BS = 4


def key(i: int, group: int = 0) -> OffloadKey:
    return (group, BlockHash(i.to_bytes(16, "big")))


def stored_keys(host: HostOffloadingManager, model: set[OffloadKey]) -> None:
    """Apply the tier's events to ``model`` (the keys a routing index would believe held)."""
    for e in host.take_events():
        assert e.medium == "CPU"
        if isinstance(e, BlockStored):
            assert e.group_id is not None
            model.update((e.group_id, h) for h in e.block_hashes)  # type: ignore[misc]
        elif isinstance(e, BlockRemoved):
            assert e.group_id is not None
            model.difference_update((e.group_id, h) for h in e.block_hashes)  # type: ignore[misc]


# -- the host tier ------------------------------------------------------------------------------
def test_store_lookup_load_and_eviction() -> None:
    host = HostOffloadingManager(3, BS)
    out = host.prepare_store([key(1), key(2), key(1)])
    assert out is not None and out.keys_to_store == [key(1), key(2)] and not out.keys_evicted
    assert host.lookup([key(1)]) == 0  # not loadable before the copy completes
    host.complete_store(out.keys_to_store)
    assert host.lookup([key(1), key(2), key(3)]) == 2
    assert host.prepare_store([key(1)]) is None  # already stored
    spec = host.prepare_load([key(1)])
    assert spec.slots == out.store_spec.slots[:1] and spec.medium == "CPU"
    # Two more keys need two slots: the free one and the LRU unpinned ready one (key 2).
    out2 = host.prepare_store([key(3), key(4)])
    assert out2 is not None and out2.keys_evicted == [key(2)]
    host.complete_store(out2.keys_to_store)
    # Everything else is pinned or stored: key 1 is pinned by the load, so one slot is left.
    host.complete_load([key(1)])
    host.touch([key(1)])  # key 1 is now the most recent
    out3 = host.prepare_store([key(5)])
    assert out3 is not None and out3.keys_evicted == [key(3)]
    host.complete_store(out3.keys_to_store, success=False)  # the copy failed: slot freed
    assert host.lookup([key(5)]) == 0 and len(host) == 2
    host.check_invariants()
    model: set[OffloadKey] = set()
    stored_keys(host, model)
    assert model == {key(1), key(4)}


def test_pinned_slots_are_never_evicted_and_stores_take_what_fits() -> None:
    host = HostOffloadingManager(2, BS)
    out = host.prepare_store([key(1), key(2)])
    assert out is not None
    host.complete_store(out.keys_to_store)
    host.prepare_load([key(1), key(2)])
    assert host.prepare_store([key(3)]) is None and host.num_rejected_stores == 1
    host.complete_load([key(1)])
    out = host.prepare_store([key(3), key(4)])  # only one slot can be freed: a leading part
    assert out is not None and out.keys_to_store == [key(3)] and out.keys_evicted == [key(1)]
    host.check_invariants()


def test_admission_filter_stores_on_the_nth_offer() -> None:
    host = HostOffloadingManager(4, BS, admit_after=3)
    assert host.prepare_store([key(1)]) is None
    assert host.prepare_store([key(1), key(2)]) is None
    out = host.prepare_store([key(1), key(2)])
    assert out is not None and out.keys_to_store == [key(1)]


def test_bad_calls_are_refused_and_change_nothing() -> None:
    host = HostOffloadingManager(2, BS)
    out = host.prepare_store([key(1)])
    assert out is not None
    with pytest.raises(BlockStateError, match="not being stored"):
        host.complete_store([key(1), key(9)])
    assert host.lookup([key(1)]) == 0
    host.complete_store([key(1)])
    with pytest.raises(BlockStateError, match="does not hold"):
        host.prepare_load([key(1), key(2)])
    with pytest.raises(BlockStateError, match="not being loaded"):
        host.complete_load([key(1)])
    host.check_invariants()
    assert host.slots[out.store_spec.slots[0]].ref_cnt == 0
    for bad in (0, -1, True, 1.5):
        with pytest.raises(InvalidArgumentError):
            HostOffloadingManager(bad, BS)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        HostOffloadingManager(4, BS, eviction_policy="mru")


class HostTierMachine(RuleBasedStateMachine):
    """Random (and invalid) calls; invariants after every one; the events always describe
    exactly the ready keys."""

    policy = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.host = HostOffloadingManager(6, BS, eviction_policy=self.policy, admit_after=1)
        self.model: set[OffloadKey] = set()
        self.writing: list[list[OffloadKey]] = []
        self.loading: list[list[OffloadKey]] = []

    @rule(ids=st.lists(st.integers(0, 12), min_size=1, max_size=5))
    def store(self, ids: list[int]) -> None:
        out = self.host.prepare_store([key(i) for i in ids])
        if out is not None:
            assert len(out.keys_to_store) == len(out.store_spec.slots)
            self.writing.append(out.keys_to_store)

    @rule(data=st.data(), success=st.booleans())
    def finish_store(self, data: st.DataObject, success: bool) -> None:
        if self.writing:
            keys = self.writing.pop(data.draw(st.integers(0, len(self.writing) - 1)))
            self.host.complete_store(keys, success)

    @rule(ids=st.lists(st.integers(0, 12), min_size=1, max_size=4))
    def load(self, ids: list[int]) -> None:
        keys = [key(i) for i in ids]
        n = self.host.lookup(keys)
        if n:
            self.host.prepare_load(keys[:n])
            self.loading.append(keys[:n])
        if n < len(keys):
            with pytest.raises(BlockStateError):
                self.host.prepare_load(keys)

    @rule(data=st.data())
    def finish_load(self, data: st.DataObject) -> None:
        if self.loading:
            self.host.complete_load(
                self.loading.pop(data.draw(st.integers(0, len(self.loading) - 1))))
        else:
            with pytest.raises(BlockStateError):
                self.host.complete_load([key(0)])

    @rule(ids=st.lists(st.integers(0, 12), max_size=4))
    def touch(self, ids: list[int]) -> None:
        self.host.touch([key(i) for i in ids])

    @invariant()
    def consistent(self) -> None:
        self.host.check_invariants()
        stored_keys(self.host, self.model)
        assert self.model == {k for k in (key(i) for i in range(13)) if k in self.host}


class ARCHostTierMachine(HostTierMachine):
    policy = "arc"


TestHostTierLRU = HostTierMachine.TestCase
TestHostTierLRU.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestHostTierARC = ARCHostTierMachine.TestCase
TestHostTierARC.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)


# -- the connector in the scheduler --------------------------------------------------------------
class ContentTransfer(TransferHandler):
    """Copies *contents*: each device block and host slot holds the token prefix its KV was
    computed for.  A store must read the storing request's own prefix, and a load must bring
    the loading request's own prefix; ``delay`` polls pass before a store is reported."""

    def __init__(self, delay: int = 0) -> None:
        self.device: dict[int, tuple[int, ...]] = {}
        self.host: dict[int, tuple[int, ...]] = {}
        self.expect: dict[int, tuple[int, ...]] = {}  # device block -> what a load must bring
        self.delay = delay
        self.fail_loads: set[str] = set()
        self._stores: list[tuple[int, int]] = []  # (polls left, job)
        self._loads: set[str] = set()
        self._failed: set[int] = set()
        self.loaded_blocks = 0

    def computed(self, out: SchedulerOutput, block_size: int) -> None:
        """The forward wrote these blocks: record what each holds."""
        for s in out.scheduled:
            end = s.num_computed_tokens + s.num_new_tokens
            table = s.block_ids[0]
            for i in range(s.num_computed_tokens // block_size, -(-end // block_size)):
                self.device[table[i]] = tuple(s.request.all_token_ids[:(i + 1) * block_size])

    def load(self, request_id: str, spec: TransferSpec) -> None:
        self._loads.add(request_id)
        if request_id in self.fail_loads:
            self.fail_loads.discard(request_id)
            self._failed.update(spec.device_block_ids)
            return
        for block, slot in zip(spec.device_block_ids, spec.host_slots, strict=True):
            assert self.host[slot] == self.expect.pop(block), "a load brought another prefix"
            self.device[block] = self.host[slot]
            self.loaded_blocks += 1

    def store(self, job_id: int, spec: TransferSpec) -> None:
        for block, slot in zip(spec.device_block_ids, spec.host_slots, strict=True):
            self.host[slot] = self.device[block]
        self._stores.append((self.delay, job_id))

    def poll(self) -> tuple[set[int], set[str], set[int]]:
        done = {job for left, job in self._stores if left == 0}
        self._stores = [(left - 1, job) for left, job in self._stores if left > 0]
        loads, self._loads = self._loads, set()
        failed, self._failed = self._failed, set()
        return done, loads, failed


class Engine:
    """A fake engine: scheduler + worker-side connector + content-checking transfers."""

    def __init__(self, num_blocks: int = 12, host_blocks: int = 32, delay: int = 0,
                 load_async: bool = True, manager: KVCacheManager | None = None) -> None:
        self.kv = manager or KVCacheManager(make_config(full(BS), num_blocks=num_blocks), 128)
        self.connector = OffloadingConnector(KVConnectorRole.SCHEDULER, self.kv.config,
                                             num_host_blocks=host_blocks, load_async=load_async)
        self.transfer = ContentTransfer(delay)
        self.reqs: dict[str, Request] = {}
        self.worker = OffloadingConnector(KVConnectorRole.WORKER, transfer=self.transfer,
                                          load_async=load_async)
        self.sched = Scheduler(self.kv, SchedulerConfig(max_num_seqs=4,
                                                        max_num_batched_tokens=64),
                               self.connector)

    def add(self, rid: str, prompt: list[int], max_tokens: int = 2) -> Request:
        req = self.kv.make_request(rid, prompt, max_tokens=max_tokens, ignore_eos=True)
        self.sched.add_request(req)
        self.reqs[rid] = req
        return req

    def step(self) -> SchedulerOutput:
        return self.run(self.sched.schedule())

    def run(self, out: SchedulerOutput) -> SchedulerOutput:
        meta = out.kv_connector_metadata
        for rid, spec in getattr(meta, "loads", {}).items():
            req = self.sched.loading.get(rid) or self.sched.requests.get(rid) or self.reqs[rid]
            table = self.kv.get_block_ids(rid)[0]
            for block in spec.device_block_ids:
                i = table.index(block)
                self.transfer.expect[block] = tuple(req.all_token_ids[:(i + 1) * BS])
        self.worker.bind_connector_metadata(meta)  # type: ignore[arg-type]
        self.worker.start_load_kv()
        self.transfer.computed(out, BS)
        self.worker.wait_for_save()
        conn_out = self.worker.connector_output(set(out.finished_request_ids))
        self.worker.clear_connector_metadata()
        sampled = {s.request_id: 1000 + s.request.num_tokens for s in out.scheduled if s.samples}
        self.sched.update_from_output(out, sampled, conn_out)
        self.kv.check_invariants()
        assert self.connector.host is not None
        self.connector.host.check_invariants()
        return out

    def drain(self, limit: int = 200) -> None:
        for _ in range(limit):
            if not self.sched.has_unfinished_requests():
                return
            self.step()
        raise AssertionError("did not drain")

    def assert_clean(self) -> None:
        assert not self.sched.has_unfinished_requests()
        assert self.kv.pool.num_free_blocks == self.kv.config.num_blocks - 1
        host = self.connector.host
        assert host is not None
        assert all(b.ref_cnt == 0 for b in host.slots), "a host slot stayed pinned or written"


def prompt(base: int, n: int = 17) -> list[int]:
    return list(range(base, base + n))


def evict_a_prefix(eng: Engine) -> None:
    """Run request "a" (16 of its tokens go to the host tier), then "b", whose blocks evict
    a's from a 7-block device cache (``Engine(num_blocks=8)``)."""
    eng.add("a", prompt(0))
    eng.drain()
    eng.add("b", prompt(500, 24))
    eng.drain()


def test_a_prefix_evicted_from_the_device_is_loaded_from_the_host() -> None:
    eng = Engine(num_blocks=8)
    eng.add("a", prompt(0))
    eng.drain()
    assert eng.connector.host is not None and len(eng.connector.host) == 4  # 16 tokens stored
    eng.add("b", prompt(500, 24))  # evicts a's blocks from the 7-block device cache
    eng.drain()
    b2 = eng.add("a2", [*prompt(0), 7, 7, 7])
    out = eng.sched.schedule()
    assert b2.status is RequestStatus.WAITING_FOR_REMOTE_KVS and not out.scheduled
    assert eng.sched.stats.external_hit_tokens == 16 and b2.num_computed_tokens == 0
    eng.sched.update_from_output(out, {})  # no connector output yet: it keeps waiting
    assert b2.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    eng.run(out)  # the worker loads; its report puts the request back in the queue
    assert b2.status is RequestStatus.WAITING and b2.num_computed_tokens == 16
    out = eng.step()  # the load finished: scheduled from token 16
    assert [(s.request_id, s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled] == [
        ("a2", 16, 4)]
    assert eng.transfer.loaded_blocks == 4
    eng.drain()
    eng.assert_clean()


def test_a_finished_request_refreshes_its_host_copies_even_after_device_hits() -> None:
    # a's and then b's blocks fill the 8-slot tier; a2 is served from the device cache alone,
    # and its end refreshes a's copies (as vLLM's offloading manager touches a finished
    # request's keys), so c's stores evict b's copies, not the older a's.
    eng = Engine(num_blocks=32, host_blocks=8)
    a = eng.add("a", prompt(0))
    eng.drain()
    b = eng.add("b", prompt(500))
    eng.drain()
    a2 = eng.add("a2", [*prompt(0), 9])
    eng.drain()
    assert a2.num_cached_tokens == 16 and eng.sched.stats.external_hit_tokens == 0
    eng.add("c", prompt(900))
    eng.drain()
    host = eng.connector.host
    assert host is not None
    assert all((0, h) in host for h in a.block_hashes[:4])
    assert not any((0, h) in host for h in b.block_hashes[:4])
    eng.assert_clean()


def test_synchronous_loads_compute_in_the_same_step() -> None:
    eng = Engine(num_blocks=8, load_async=False)
    evict_a_prefix(eng)
    eng.add("a2", [*prompt(0), 1])
    out = eng.step()
    assert [(s.request_id, s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled] == [
        ("a2", 16, 2)]
    eng.drain()
    eng.assert_clean()


@pytest.mark.parametrize("load_async", [True, False])
def test_a_failed_load_falls_back_to_recompute(load_async: bool) -> None:
    eng = Engine(num_blocks=8, load_async=load_async)
    evict_a_prefix(eng)
    eng.transfer.fail_loads.add("a2")
    req = eng.add("a2", [*prompt(0), 1])
    eng.step()
    if load_async:
        eng.step()
    assert eng.sched.stats.load_failures == 1
    assert req.num_output_tokens == 0  # no token was taken from unwritten KV
    eng.drain()
    assert req.num_output_tokens == 2 and req.status is RequestStatus.FINISHED_LENGTH
    # The recomputed blocks were cached as its own: a new lookup on the device hits them.
    probe = eng.kv.make_request("p", [*prompt(0), 1])
    assert eng.kv.get_computed_blocks(probe)[1] == 16
    eng.assert_clean()


def test_blocks_being_stored_outlive_their_request() -> None:
    eng = Engine(num_blocks=12, delay=2)
    req = eng.add("a", prompt(0), max_tokens=1)
    eng.step()
    assert req.status is RequestStatus.FINISHED_LENGTH
    assert eng.kv.pool.num_free_blocks < eng.kv.config.num_blocks - 1  # held for the copy
    assert eng.sched.has_unfinished_requests()
    eng.drain()
    eng.assert_clean()
    host = eng.connector.host
    assert host is not None and len(host) == 4


def test_aborting_a_loading_request_frees_its_blocks_after_the_load() -> None:
    eng = Engine(num_blocks=8)
    evict_a_prefix(eng)
    eng.add("a2", [*prompt(0), 1])
    out = eng.sched.schedule()  # a2 is parked; its load is in this step's metadata
    assert "a2" in eng.sched.loading
    eng.sched.abort_request("a2")
    free_before = eng.kv.pool.num_free_blocks
    assert eng.sched.has_unfinished_requests()  # its blocks wait for the load
    eng.run(out)
    assert eng.kv.pool.num_free_blocks > free_before
    eng.drain()
    eng.assert_clean()


def test_a_failed_step_gives_back_its_slots_and_recomputes_its_loads() -> None:
    eng = Engine(num_blocks=8)
    evict_a_prefix(eng)
    req = eng.add("a2", [*prompt(0), 1])
    eng.add("c", prompt(900, 9))
    out = eng.sched.schedule()  # a2 loads, c computes (a store job for its blocks)
    assert "a2" in eng.sched.loading and out.scheduled
    eng.sched.fail_step(out)  # the engine never ran it
    assert req.status is RequestStatus.WAITING and req.num_computed_tokens == 0
    assert eng.sched.stats.load_failures == 1
    host = eng.connector.host
    assert host is not None
    assert all(b.ref_cnt == 0 for b in host.slots)
    eng.drain()
    eng.assert_clean()


def test_connector_configuration_is_checked() -> None:
    from tests.factories import swa_spec

    with pytest.raises(InvalidArgumentError, match="full-attention"):
        OffloadingConnector(KVConnectorRole.SCHEDULER,
                            make_config(full(4), swa_spec(8), num_blocks=8), num_host_blocks=4)
    with pytest.raises(InvalidArgumentError, match="KV-cache config"):
        OffloadingConnector(KVConnectorRole.SCHEDULER, num_host_blocks=4)
    with pytest.raises(InvalidArgumentError, match="role"):
        OffloadingConnector("scheduler")  # type: ignore[arg-type]


class ConnectorSchedulerMachine(SchedulerMachine):
    """kvcore's scheduler with a host tier, driven by random requests and aborts over a checked
    manager (every hit holds the request's own KV); transfers check contents and stores
    complete a poll late."""

    num_blocks = 12
    delay = 1

    def make_scheduler(self, manager: KVCacheManager) -> Any:
        self.engine = Engine(manager=manager, host_blocks=10, delay=self.delay)
        return self.engine.sched

    def step(self) -> None:
        self.engine.step()

    def unfinished(self) -> list[str]:
        return sorted(self.scheduler.requests)

    def teardown(self) -> None:
        self.engine.drain()  # finishes the requests and the transfers still holding blocks
        super().teardown()
        self.engine.assert_clean()


class NoDelayMachine(ConnectorSchedulerMachine):
    delay = 0


TestNoDelay = NoDelayMachine.TestCase
TestNoDelay.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
TestConnectorScheduler = ConnectorSchedulerMachine.TestCase
TestConnectorScheduler.settings = settings(max_examples=40, stateful_step_count=30,
                                           deadline=None)


# -- replays ------------------------------------------------------------------------------------
def test_replay_with_a_host_tier_reports_device_host_and_misses() -> None:
    reqs = multi_turn(num_conversations=8, turns=4)
    base = ReplayConfig(block_size=16, num_blocks=60, max_num_seqs=8)
    alone = replay(reqs, base)
    tiered = replay(reqs, ReplayConfig(block_size=16, num_blocks=60, max_num_seqs=8,
                                       host_blocks=400))
    assert alone.host_hit_tokens == 0
    assert tiered.host_hit_tokens > 0 and tiered.num_finished == len(reqs)
    assert tiered.token_hit_rate + tiered.host_hit_rate > alone.token_hit_rate + 0.2
    assert tiered.hit_tokens + tiered.host_hit_tokens <= tiered.prompt_tokens
    again = replay(reqs, ReplayConfig(block_size=16, num_blocks=60, max_num_seqs=8,
                                      host_blocks=400))
    assert (again.hit_tokens, again.host_hit_tokens, again.steps) == (
        tiered.hit_tokens, tiered.host_hit_tokens, tiered.steps)  # deterministic


def test_cluster_replay_indexes_host_copies() -> None:
    reqs = multi_turn(num_conversations=6, turns=3)
    cfg = ReplayConfig(block_size=16, num_blocks=60, max_num_seqs=8, host_blocks=300)
    result = replay_cluster(reqs, cfg, ClusterConfig(2, "prefix"))
    assert result.host_hit_tokens > 0 and result.num_finished == len(reqs)
    assert sum(r.host_hit_tokens for r in result.replicas) == result.host_hit_tokens
    # The index learned every block each replica's host tier holds from its CPU events (and
    # forgot the ones the tier evicted), next to the device blocks.
    for rep in result.replicas:
        assert rep.host_blocks_held > 0
        assert rep.indexed_blocks.get("CPU") == rep.host_blocks_held
        assert rep.indexed_blocks.get("GPU", 0) > 0


def test_cli_host_blocks(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_main(kvcore_main, capsys, "replay", "--workload", "multi-turn",
                            "--capacity-tokens", "1000", "--host-blocks", "500",
                            "--host-policy", "arc", "--json")
    assert code == 0
    rep = json.loads(out)["replay"]
    assert rep["host_hit_tokens"] > 0 and 0 < rep["host_hit_rate"] <= 1
    code, out, _ = run_main(kvcore_main, capsys, "replay", "--workload", "multi-turn",
                            "--capacity-tokens", "1000", "--host-blocks", "500")
    assert code == 0 and "loaded from host" in out and "recomputed" in out
    code, _, err = run_main(kvcore_main, capsys, "replay", "--host-blocks", "-1")
    assert code == 2 and "--host-blocks" in err
    # A partial-tail block size (hash block 16 != 32) is refused with a clear error.
    code, _, err = run_main(kvcore_main, capsys, "replay", "--host-policy", "nope")
    assert code == 2 and "--host-policy" in err


def test_instant_transfer_reports_everything_at_the_next_poll() -> None:
    t = InstantTransfer()
    t.store(3, TransferSpec((1, 2), (0, 1)))
    t.fail_loads.add("x")
    t.load("x", TransferSpec((5,), (2,)))
    t.load("y", TransferSpec((6,), (3,)))
    assert t.poll() == ({3}, {"x", "y"}, {5})
    assert t.poll() == (set(), set(), set())
    assert t.num_stored_blocks == 2 and t.num_loaded_blocks == 1


def test_host_tier_events_are_self_describing() -> None:
    """The host tier announces each stored block as the device does: its tokens, its parent
    hash, its block size and its group's spec (vLLM 0.32's self-describing offload events), so a
    router can index host copies without having seen the device's events."""
    from kvcore.events import MEDIUM_CPU, MEDIUM_GPU, BlockStored
    from kvcore.sim.replay import ReplayConfig, replay
    from kvcore.sim.workloads import shared_prefix

    reqs = shared_prefix(num_groups=2, prompts_per_group=3, system_len=64, seed=0)
    batches: list[list[object]] = []
    replay(reqs, ReplayConfig(block_size=16, num_blocks=40, host_blocks=64),
           event_sink=batches.append)
    events = [e for batch in batches for e in batch if isinstance(e, BlockStored)]
    host = [e for e in events if e.medium == MEDIUM_CPU]
    device = [e for e in events if e.medium == MEDIUM_GPU]
    assert host and device
    # Every device block's (parent, tokens) by its hash; the host's events must agree.
    known: dict[bytes, tuple[object, tuple[int, ...]]] = {}
    for e in device:
        parent = e.parent_block_hash
        for i, h in enumerate(e.block_hashes):
            known[h] = (parent, tuple(e.token_ids[16 * i:16 * (i + 1)]))
            parent = h
    for e in host:
        assert len(e.block_hashes) == 1 and e.block_size == 16 and len(e.token_ids) == 16
        assert e.kv_cache_spec_kind == "full_attention" and e.group_id == 0
        h = e.block_hashes[0]
        assert known[h] == (e.parent_block_hash, tuple(e.token_ids))
