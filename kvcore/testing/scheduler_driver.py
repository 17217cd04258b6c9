"""A driver that runs kvcore's :class:`~kvcore.scheduler.Scheduler` with a KV connector whose
loads fail, over a :func:`~kvcore.testing.checked` manager with its contents tracked.

It plays the clients and the engine: requests with shared prefixes and tenants are submitted,
aborted and submitted again under an id used before (the old request finished, aborted, or
still live: then the scheduler must refuse it); steps run, and some of them fail in the
forward pass.  The connector (:class:`FlakyConnector`, both of its roles) offers tokens beyond
each device prefix hit, loaded synchronously or asynchronously (reported a few steps later),
fails random blocks of some loads (``invalid_block_ids``), and keeps the blocks of some
finished requests for a store that completes later (delayed frees).

After every operation it checks, besides the manager's invariants and the content oracle
(every adopted hit and running table holds the request's own KV where its next token reads):

* every scheduled request is the live request object of its id (an aborted or finished one
  is never scheduled again, and a request submitted under a reused id is never lost);
* after a failed load, no block that failed is still in the prefix cache, and no request
  counts a token held in a failed block as computed;
* an encoder-decoder request runs with a cross-attention table for its encoder tokens;
* an id is refused exactly while a request of that id is live or its blocks still wait for
  the connector, and accepted otherwise.

:meth:`SchedulerDriver.drain` then finishes everything: every accepted request ends finished
(those not aborted with all their tokens), and no block is held or leaked.  A broken rule
raises ``AssertionError`` (an :class:`~kvcore.errors.InvariantError` from the checked manager).
:func:`random_operation` draws operations for the long fuzz run (``python -m kvcore.bench fuzz
--scheduler``); :data:`SCHEDULER_SETUPS` are the configurations it runs.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvcore.connector.base import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
    StepOutput,
)
from kvcore.errors import InvalidArgumentError
from kvcore.manager import KVCacheManager
from kvcore.request import Request, RequestStatus
from kvcore.scheduler import RequestRejectedError, Scheduler, SchedulerConfig, SchedulerOutput
from kvcore.specs import KVCacheSpec
from kvcore.testing.checked import assert_no_leak, checked, step_failed
from kvcore.testing.setups import SETUPS, Setup
from kvcore.types import KVCacheBlocks

VOCAB = 3  # tiny: equal blocks at different positions and after different prefixes are common
SALTS = (None, None, "tenant-a", "tenant-b")
ENCODER_TOKENS = (3, 6, 9)  # encoder tokens of an encoder-decoder request (cross attention)
POLICIES = ("fcfs", "lpm", "dfs-weight")


@dataclass(frozen=True)
class SchedulerSetup:
    """A manager configuration and the scheduler's admission policy."""

    setup: Setup
    policy: str

    @property
    def name(self) -> str:
        return f"{self.setup.name} {self.policy}"


_GROUPS = ("full", "full-bs2", "swa7", "chunked13", "chunked6", "full+chunked13",
           "full4+swa12/8", "full+swa5+swa5", "full+mamba", "full+cross", "full+mamba-align",
           "nocache full+swa", "full8+swa4", "full verify")

SCHEDULER_SETUPS: tuple[SchedulerSetup, ...] = tuple(
    SchedulerSetup(s, policy) for s in SETUPS if s.name in _GROUPS for policy in POLICIES)
"""Every group type (full, sliding window, chunked local with chunks that are not multiples of
the block size, Mamba in both modes, cross attention, hybrids, caching off, ``verify_hits``)
under every admission policy, each with the flaky connector."""


@dataclass
class _Load:
    """One connector load: the request, its device blocks written by it, whether it is
    asynchronous."""

    request_id: str
    block_ids: list[int]
    load_async: bool


class FlakyMetadata(KVConnectorMetadata):
    """The loads a step starts."""

    def __init__(self, loads: list[_Load]) -> None:
        self.loads = loads


class FlakyConnector(KVConnectorBase):
    """A connector to a store that holds every request's own KV (so what it loads is right)
    but whose loads fail at random: both roles in one object.

    Scheduler side: offers a random number of tokens beyond the device hit (or "not known
    yet"), synchronously or asynchronously, and keeps the blocks of some finished requests
    for a store.  Worker side (:meth:`run`): fails a random subset of the blocks of some loads,
    reports asynchronous loads and stores 0-2 steps after they start."""

    def __init__(self, rng: random.Random, specs: tuple[KVCacheSpec, ...],
                 fail_rate: float = 0.25) -> None:
        super().__init__(KVConnectorRole.SCHEDULER)
        self.rng = rng
        self.specs = specs
        self.fail_rate = fail_rate
        # Request id -> (computed tokens, asynchronous) of the latest offer made for it.
        self._offers: dict[str, tuple[int, bool]] = {}
        self._new_loads: list[_Load] = []
        self.storing: dict[str, int] = {}  # request id -> steps until its store completes
        # Asynchronous loads started: request id -> (steps until reported, failed blocks).
        self.in_flight: dict[str, tuple[int, set[int]]] = {}
        self.counts: Counter[str] = Counter()

    # -- scheduler side -------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        rng = self.rng
        r = rng.random()
        if r < 0.05:
            return None, False
        if r < 0.5:
            self._offers[request.request_id] = (num_computed_tokens, False)
            return 0, False
        load_async = rng.random() < 0.5
        self._offers[request.request_id] = (num_computed_tokens, load_async)
        return rng.randint(1, max(request.num_tokens - num_computed_tokens, 1)), load_async

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        if not num_external_tokens:
            return
        start, load_async = self._offers.pop(request.request_id)
        end = start + num_external_tokens
        ids: list[int] = []
        for spec, table in zip(self.specs, blocks):
            if spec.reads_encoder:
                continue  # never loaded (vLLM's connectors load the decoder's KV)
            bs = spec.block_size
            ids.extend(b.block_id for b in table[start // bs:-(-end // bs)] if not b.is_null)
        self._new_loads.append(_Load(request.request_id, ids, load_async))

    def build_connector_meta(self, scheduler_output: StepOutput) -> KVConnectorMetadata:
        loads, self._new_loads = self._new_loads, []
        return FlakyMetadata(loads)

    def request_finished(self, request: Request,
                         block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        if (request.status is RequestStatus.WAITING_FOR_REMOTE_KVS
                or not any(block_ids) or self.rng.random() < 0.6):
            return False, None  # (a loading request's blocks wait for its load anyway)
        self.storing[request.request_id] = self.rng.randint(0, 2)
        self.counts["delayed frees"] += 1
        return True, None

    def failed_step_output(self, metadata: KVConnectorMetadata | None) -> KVConnectorOutput:
        """The step never ran: its loads never started; each is reported finished and
        failed."""
        out = KVConnectorOutput()
        for load in metadata.loads if isinstance(metadata, FlakyMetadata) else ():
            if load.load_async:
                out.finished_recving.add(load.request_id)
            out.invalid_block_ids.update(load.block_ids)
        return out

    # -- worker side ----------------------------------------------------------------------------
    def run(self, metadata: KVConnectorMetadata | None) -> KVConnectorOutput:
        """Execute a step's loads and report what finished: synchronous loads now (their failed
        blocks), asynchronous loads and stores once their delay has passed."""
        out = KVConnectorOutput()
        rng = self.rng
        for load in metadata.loads if isinstance(metadata, FlakyMetadata) else ():
            failed: set[int] = set()
            if load.block_ids and rng.random() < self.fail_rate:
                failed = set(rng.sample(load.block_ids, rng.randint(1, len(load.block_ids))))
                self.counts["failed loads (async)" if load.load_async
                            else "failed loads (sync)"] += 1
            self.counts["loads (async)" if load.load_async else "loads (sync)"] += 1
            if load.load_async:
                self.in_flight[load.request_id] = (rng.randint(0, 2), failed)
            else:
                out.invalid_block_ids |= failed
        for rid, (left, failed) in list(self.in_flight.items()):
            if left:
                self.in_flight[rid] = (left - 1, failed)
            else:
                del self.in_flight[rid]
                out.finished_recving.add(rid)
                out.invalid_block_ids |= failed
        for rid, left in list(self.storing.items()):
            if left:
                self.storing[rid] = left - 1
            else:
                del self.storing[rid]
                out.finished_sending.add(rid)
        return out

    @property
    def idle(self) -> bool:
        return not (self.in_flight or self.storing)


@dataclass
class SchedulerDriver:
    """Drives one scheduler built from ``ssetup`` (see the module docstring)."""

    ssetup: SchedulerSetup
    seed: int = 0
    counts: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        setup = self.ssetup.setup
        self.rng = random.Random(self.seed)
        self.m: KVCacheManager = checked(setup.build(), track_contents=True)
        self.connector = FlakyConnector(self.rng, setup.specs)
        self.sched = self.make_scheduler(self.m, self.connector)
        self._cross = [g for g, s in enumerate(setup.specs) if s.reads_encoder]
        self._families = [[(7 * f + 3 * i + i // 5) % VOCAB for i in range(40)]
                          for f in range(3)]
        self._counter = 0
        self.accepted: list[Request] = []  # every request the scheduler took, in order
        self.aborted: set[int] = set()  # id() of the accepted requests aborted
        self.ids: list[str] = []  # ids used so far

    def make_scheduler(self, manager: KVCacheManager, connector: KVConnectorBase) -> Scheduler:
        """The scheduler under test (override to drive a subclass)."""
        config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16,
                                 schedule_policy=self.ssetup.policy, max_waiting_steps=3,
                                 lpm_lookups_per_step=2)
        return Scheduler(manager, config, connector)

    # -- requests -------------------------------------------------------------------------------
    def _request(self, rid: str) -> Request:
        rng = self.rng
        base = self._families[rng.randrange(len(self._families))]
        tokens = base[:rng.randrange(len(base) + 1)] + [rng.randrange(VOCAB)
                                                         for _ in range(rng.randint(1, 20))]
        tokens = tokens[:self.ssetup.setup.max_model_len - 2]
        extra: dict[str, Any] = {}
        if self._cross:
            extra["num_encoder_tokens"] = rng.choice(ENCODER_TOKENS)
        return self.m.make_request(rid, tokens, max_tokens=rng.randint(1, 6), ignore_eos=True,
                                   cache_salt=rng.choice(SALTS), **extra)

    def _busy(self, rid: str) -> bool:
        """A request of this id is live, or its blocks still wait for the connector."""
        c = self.connector
        return rid in self.sched.requests or rid in c.storing or rid in c.in_flight

    def _submit(self, req: Request) -> None:
        busy = self._busy(req.request_id)
        try:
            self.sched.add_request(req)
        except RequestRejectedError:
            assert not busy, f"request id {req.request_id!r} is live, yet refused as too big"
            self.counts["rejected"] += 1
            return
        except InvalidArgumentError as exc:
            assert busy, f"request id {req.request_id!r} is free, yet refused: {exc}"
            self.counts["resubmission refused"] += 1
            return
        assert not busy, (f"request id {req.request_id!r} accepted while a request of that id "
                          "is live or its blocks wait for the connector")
        self.accepted.append(req)
        if req.request_id not in self.ids:
            self.ids.append(req.request_id)
        self.counts["accepted"] += 1

    def submit(self) -> None:
        """A new request under a new id."""
        self._counter += 1
        self._submit(self._request(f"r{self._counter}"))

    def resubmit(self) -> None:
        """A new request under an id used before (its request finished, was aborted, or is
        still live: then it must be refused)."""
        if not self.ids:
            return
        rid = self.ids[-1 - self.rng.randrange(min(len(self.ids), 6))]
        self.counts["resubmit"] += 1
        self._submit(self._request(rid))

    def abort(self) -> None:
        if not self.sched.requests:
            return
        rid = self.rng.choice(sorted(self.sched.requests))
        req = self.sched.requests[rid]
        self.sched.abort_request(rid)
        self.aborted.add(id(req))
        self.counts["abort"] += 1

    # -- steps ----------------------------------------------------------------------------------
    def step(self) -> None:
        """A step that runs: the engine samples a token for each sampling request; the connector
        reports what finished."""
        out = self.sched.schedule()
        self._check_scheduled(out)
        conn_out = self.connector.run(out.kv_connector_metadata)
        sampled = {s.request_id: self.rng.randrange(VOCAB) for s in out.scheduled if s.samples}
        self.sched.update_from_output(out, sampled, conn_out)
        if conn_out.invalid_block_ids:
            self._check_failed(conn_out.invalid_block_ids)
        self.counts["step"] += 1

    def fail_step(self) -> None:
        """A step whose forward pass fails: reported to the checked manager, then the
        scheduler (its loads never ran)."""
        out = self.sched.schedule()
        self._check_scheduled(out)
        step_failed(self.m)
        failed = self.sched.fail_step(out)
        invalid = self.connector.failed_step_output(out.kv_connector_metadata).invalid_block_ids
        if invalid:
            self._check_failed(invalid)
        self.aborted.update(id(r) for r in failed)
        self.counts["fail_step"] += 1

    # -- checks ---------------------------------------------------------------------------------
    def _check_scheduled(self, out: SchedulerOutput) -> None:
        live = self.sched.requests
        for s in out.scheduled:
            assert live.get(s.request_id) is s.request, (
                f"scheduled {s.request!r} (status {s.request.status.value}) is not the live "
                f"request of id {s.request_id!r} ({live.get(s.request_id)!r})")
            for g in self._cross:
                have = len(self.m.get_block_ids(s.request_id)[g])
                want = -(-s.request.num_encoder_tokens // self.ssetup.setup.specs[g].block_size)
                assert have == want, (f"request {s.request_id!r} runs with {have} cross-attention "
                                      f"blocks for {s.request.num_encoder_tokens} encoder tokens")

    def _check_failed(self, invalid: set[int]) -> None:
        """No block a load failed to write stays cached, and no request counts a token in one
        of them as computed."""
        blocks = self.m.pool.blocks
        cached = sorted(b for b in invalid if blocks[b].block_hash is not None)
        assert not cached, f"blocks {cached} failed to load but are still in the prefix cache"
        specs = self.ssetup.setup.specs
        for rid, req in self.m.requests().items():
            tables = self.m.get_block_ids(rid)
            for g, (spec, ids) in enumerate(zip(specs, tables)):
                for i, b in enumerate(ids):
                    if b not in invalid:
                        continue
                    where = 0 if spec.reads_encoder else i * spec.block_size
                    assert req.num_computed_tokens <= where, (
                        f"request {rid!r} counts {req.num_computed_tokens} tokens computed, but "
                        f"block {b} (group {g} position {i}) failed to load")
        self.counts["steps with failed loads"] += 1

    def drain(self, max_steps: int = 2000) -> None:
        """Finish every request and transfer; then everything accepted is finished (with all
        its tokens unless aborted) and nothing is held or leaked."""
        for _ in range(max_steps):
            if not self.sched.has_unfinished_requests() and self.connector.idle:
                break
            self.step()
        else:
            raise AssertionError(f"not drained in {max_steps} steps: "
                                 f"{sorted(self.sched.requests)} still unfinished")
        assert_no_leak(self.m)
        max_len = self.ssetup.setup.max_model_len
        for req in self.accepted:
            assert req.status.is_finished, (
                f"request {req!r} was accepted but never finished (status "
                f"{req.status.value}): it was lost")
            if req.status is RequestStatus.FINISHED_LENGTH:
                assert req.max_tokens is not None
                assert (req.num_output_tokens == req.max_tokens
                        or req.num_tokens >= max_len), f"{req!r} finished early"
            elif req.status is not RequestStatus.FINISHED_REJECTED:
                assert id(req) in self.aborted, f"{req!r} finished {req.status.value}"
        stats = self.sched.stats
        self.counts["preemptions"] += stats.num_preemptions
        self.counts["load failures recomputed"] += stats.load_failures
        self.counts["finished"] += stats.num_finished
        self.counts.update(self.connector.counts)


OPERATIONS = ("submit", "resubmit", "abort", "step", "fail_step")
_WEIGHTS = (6, 2, 1, 12, 1)


def random_operation(driver: SchedulerDriver) -> str:
    """Apply one operation drawn from the driver's generator; returns its name."""
    op = driver.rng.choices(OPERATIONS, weights=_WEIGHTS)[0]
    if op in ("submit", "resubmit") and len(driver.sched.requests) >= 8:
        op = "step"
    getattr(driver, op)()
    return op
