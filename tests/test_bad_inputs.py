"""Bad input, layer by layer: every case must raise the typed error whose message names the
problem, and change nothing at all (whole-state snapshots of the manager, pool, scheduler and
engine before and after).  A coverage test checks that every public call of the manager, the
pool, the scheduler, the specs and config, the settings and the event recorder that takes
arguments appears here (or says why it cannot fail), and another that every public call added
since ff19b3b (the restructuring of 2026-11 and what came with it) does."""

from __future__ import annotations

import importlib
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers

from kvcore import KVCacheManager, Request
from kvcore.block_pool import BlockPool
from kvcore.cli import main as cli_main
from kvcore.errors import (
    BlockStateError,
    DoubleFreeError,
    InvalidArgumentError,
    InvalidGroupError,
    InvalidHitError,
    NoFreeBlocksError,
    NullBlockError,
    RequestStateError,
    UnknownRequestError,
)
from kvcore.events.recorder import EventRecorder
from kvcore.eviction import REGISTRY
from kvcore.eviction.base import Release
from kvcore.hashing import BlockHasher
from kvcore.request import RequestBlockHasher, RequestStatus
from kvcore.scheduler import RequestRejectedError, Scheduler, SchedulerConfig
from kvcore.settings import CacheSettings
from kvcore.specs import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    MambaSpec,
    SlidingWindowSpec,
)
from kvcore.testing.snapshot import manager_snapshot
from kvcore.types import KVCacheBlock, KVCacheBlocks
from runner.engine import LLM
from runner.sampler import SamplingParams
from tests.factories import full_spec, make_manager, scheduler_snapshot, swa_spec


@dataclass
class World:
    """Everything a case may touch, with requests in every state."""

    m: KVCacheManager  # full attention, block 4
    w: KVCacheManager  # full + sliding window (4), block 4
    other: KVCacheManager
    running: Request
    waiting: Request  # looked up, not admitted: hit holds 2 blocks
    hit: KVCacheBlocks
    freed: Request
    sched: Scheduler
    llm: LLM
    tmp: Path
    step: Any = None  # a scheduled step waiting for its sampled tokens (scheduler cases)

    def snapshot(self) -> tuple[object, ...]:
        return (manager_snapshot(self.m), manager_snapshot(self.w),
                manager_snapshot(self.other), scheduler_snapshot(self.sched),
                scheduler_snapshot(self.llm.scheduler), self.llm._next_id,
                tuple(sorted(p.name for p in self.tmp.iterdir())))


def _run(m: KVCacheManager, rid: str, tokens: list[int]) -> Request:
    r = m.make_request(rid, tokens)
    blocks, hit = m.get_computed_blocks(r)
    assert m.allocate_slots(r, r.num_tokens - hit, hit, blocks) is not None
    r.num_computed_tokens = r.num_tokens
    return r


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    m = make_manager(full_spec(4), num_blocks=16, max_model_len=64)
    running = _run(m, "run", list(range(10)))
    freed = _run(m, "gone", list(range(100, 112)))
    m.free(freed)
    waiting = m.make_request("wait", [*range(8), 50, 51])
    hit, n = m.get_computed_blocks(waiting)
    assert n == 8
    w = make_manager(full_spec(4), swa_spec(4, 4), num_blocks=32, max_model_len=64)
    _run(w, "wrun", list(range(12)))
    other = make_manager(full_spec(4), num_blocks=16, max_model_len=64)
    _run(other, "orun", list(range(10)))
    sm = make_manager(full_spec(4), num_blocks=16, max_model_len=64)
    sched = Scheduler(sm, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32))
    sched.add_request(sm.make_request("s1", list(range(6)), max_tokens=4))
    sched.add_request(sm.make_request("s2", list(range(20, 26)), max_tokens=4))
    out = sched.schedule()
    sched.update_from_output(out, {"s1": 1, "s2": 2})
    sched.add_request(sm.make_request("s3", list(range(40, 46)), max_tokens=4))
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1,
                                      vocab_size=300, max_position_embeddings=64)
    llm = LLM(config, block_size=4, num_blocks=32, max_model_len=48)
    return World(m, w, other, running, waiting, hit, freed, sched, llm,
                 tmp_path_factory.mktemp("cli"))


def _trace(world: World, text: str) -> str:
    path = world.tmp / "bad.jsonl"
    path.write_text(text)
    return str(path)


@dataclass(frozen=True)
class Case:
    layer: str
    name: str
    call: Callable[[World], object]
    error: type[BaseException]
    match: str
    covers: str = ""  # "Class.method" this case makes fail
    setup: Callable[[World], None] | None = None  # runs before the snapshot
    teardown: Callable[[World], None] | None = None


def _cli(world: World, *argv: str) -> None:
    """Run the CLI; a bad input must exit 2 with one line on stderr (SystemExit carries it)."""
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = cli_main(list(argv))
        except SystemExit as exc:
            rc = int(exc.code or 0)
    (world.tmp / "bad.jsonl").unlink(missing_ok=True)
    lines = err.getvalue().strip().splitlines()
    if rc == 2 and len(lines) == 1 and "Traceback" not in err.getvalue():
        raise SystemExit(lines[0])
    raise AssertionError(f"expected one line and exit 2, got {rc}: {err.getvalue()!r}")


def _overrun(r: Request) -> Request:
    r.num_computed_tokens = 12  # restored by the test
    if r.num_tokens < 12:
        r.append_output_token_ids([1, 2])
    return r


def _finished(w: World) -> Request:
    r = w.sched.kv.make_request("done", [1, 2, 3])
    r.status = RequestStatus.FINISHED_STOPPED
    return r


def _schedule(w: World) -> None:
    w.step = w.sched.schedule()


def _finish_step(w: World) -> None:
    w.sched.update_from_output(w.step, {s.request_id: 1 for s in w.step.scheduled if s.samples})
    w.step = None


M, P, S = "KVCacheManager", "BlockPool", "Scheduler"
F16 = torch.float16


def _mamba(**fields: Any) -> MambaSpec:
    return MambaSpec(**{"block_size": 4, "shapes": ((2, 4),), "dtypes": (F16,), **fields})

CASES = [
    # -- manager ----------------------------------------------------------------------------------
    Case("manager", "allocate for a freed request", lambda w: w.m.allocate_slots(w.freed, 1),
         RequestStateError, "holds no blocks", f"{M}.allocate_slots"),
    Case("manager", "a negative reserve", lambda w: w.m.allocate_slots(
        w.waiting, 2, 8, w.hit, reserved_blocks=-2), InvalidArgumentError, "reserved_blocks"),
    Case("manager", "a fractional watermark", lambda w: w.m.allocate_slots(
        w.waiting, 2, 8, w.hit, watermark_blocks=0.5),  # type: ignore[arg-type]  # deliberately bad
         InvalidArgumentError, "watermark_blocks"),
    Case("manager", "a negative shared-prefix boundary", lambda w: w.m.allocate_slots(
        w.waiting, 2, 8, w.hit, shared_prefix_boundary=-4),
         InvalidArgumentError, "shared_prefix_boundary"),
    Case("manager", "report a hit without its groups", lambda w: w.w.report_prefix_hit(
        w.waiting, w.hit), InvalidArgumentError, "one block list per group (2)",
         f"{M}.report_prefix_hit"),
    Case("manager", "hit tokens without blocks",
         lambda w: w.m.allocate_slots(w.waiting, 2, 8, None), InvalidHitError,
         "num_new_computed_tokens=8"),
    Case("manager", "too few hit blocks", lambda w: w.m.allocate_slots(
        w.waiting, 2, 8, KVCacheBlocks([w.hit[0][:1]])), InvalidHitError, "has 1 hit blocks"),
    Case("manager", "hit blocks of another pool", lambda w: w.m.allocate_slots(
        w.waiting, 2, 8, KVCacheBlocks([w.other.get_blocks("orun")[0][:2]])),
         InvalidHitError, "not a block of this manager's pool"),
    Case("manager", "hit blocks out of order", lambda w: w.m.allocate_slots(
        w.waiting, 2, 8, KVCacheBlocks([tuple(reversed(w.hit[0]))])), InvalidHitError,
         "cached for a different prefix"),
    Case("manager", "null block where KV is needed", lambda w: w.m.allocate_slots(
        w.waiting, 2, 8, KVCacheBlocks([(w.m.pool.null_block, w.hit[0][1])])),
         InvalidHitError, "null block"),
    Case("manager", "hit longer than the request", lambda w: w.m.allocate_slots(
        w.waiting, 1, 12, KVCacheBlocks([w.hit[0] * 2])), InvalidHitError, "exceed"),
    Case("manager", "hit while running", lambda w: w.m.allocate_slots(w.running, 1, 8, w.hit),
         RequestStateError, "is running"),
    Case("manager", "second live request with the same id", lambda w: w.m.allocate_slots(
        w.m.make_request("run", [7, 7, 7]), 3), RequestStateError, "another live request"),
    Case("manager", "tokens computed without slots",
         lambda w: w.m.allocate_slots(_overrun(w.running), 1), RequestStateError,
         "slots for only 10"),
    Case("manager", "bool count", lambda w: w.m.allocate_slots(w.running, True),
         InvalidArgumentError, "num_new_tokens must be a non-negative int, got True"),
    Case("manager", "None lookahead", lambda w: w.m.allocate_slots(
        w.running, 1, num_lookahead_tokens=None), InvalidArgumentError,  # type: ignore[arg-type]
         "num_lookahead_tokens"),
    Case("manager", "beyond max_model_len", lambda w: w.m.allocate_slots(w.running, 60),
         InvalidArgumentError, "exceed max_model_len=64"),
    Case("manager", "wrong number of groups", lambda w: w.w.allocate_slots(
        w.w.make_request("x", [1, 2, 3]), 3, 0, KVCacheBlocks([()])), InvalidArgumentError,
         "one block list per group (2)"),
    Case("manager", "free an unknown request", lambda w: w.m.free(w.freed), UnknownRequestError,
         "'gone' holds no blocks", f"{M}.free"),
    Case("manager", "free a twin", lambda w: w.m.free(w.m.make_request("run", [1])),
         RequestStateError, "another request object"),
    Case("manager", "defer the free of an unknown request",
         lambda w: w.m.pop_blocks_for_free(w.freed), UnknownRequestError, "'gone'",
         f"{M}.pop_blocks_for_free"),
    Case("manager", "return a block that was never withheld",
         lambda w: w.m.free_withheld([w.m.get_blocks("run")[0][0]]), BlockStateError,
         "withheld 0", f"{M}.free_withheld"),
    Case("manager", "withhold a free block that caches nothing",
         lambda w: w.m.withhold([w.m.get_blocks("run")[0][0], next(
             b for b in w.m.pool.blocks[1:] if b.ref_cnt == 0 and b.block_hash is None)]),
         BlockStateError, "in use by nobody", f"{M}.withhold"),
    Case("manager", "withhold more new blocks than are free",
         lambda w: w.m.withhold_new_blocks(999), NoFreeBlocksError, "999 blocks asked for",
         f"{M}.withhold_new_blocks"),
    Case("manager", "take a pending copy whose endpoints are not withheld",
         lambda w: (w.m.coordinator.managers[0].pending_copies.append(
             (w.m.get_blocks("run")[0][0], w.m.get_blocks("run")[0][0])),
             w.m.take_block_copies()), BlockStateError, "withheld 0 time",
         f"{M}.take_block_copies"),
    Case("manager", "withhold another manager's block",
         lambda w: w.m.withhold([w.other.pool.blocks[1]]), BlockStateError,
         "not a block of this pool"),
    Case("manager", "free with a retention hint that is not a bool",
         lambda w: w.m.free(w.running, retain="yes"), InvalidArgumentError,
         "retain must be a bool, got 'yes'"),
    Case("manager", "cache beyond the slots", lambda w: w.m.cache_blocks(w.running, 11),
         RequestStateError, "slots for 10 tokens, not 11", f"{M}.cache_blocks"),
    Case("manager", "cache a negative count", lambda w: w.m.cache_blocks(w.running, -1),
         InvalidArgumentError, "num_computed_tokens"),
    Case("manager", "uncache an unknown request", lambda w: w.m.uncache_blocks(w.freed, 0),
         UnknownRequestError, "'gone'", f"{M}.uncache_blocks"),
    Case("manager", "release beyond the slots", lambda w: w.m.remove_skipped_blocks("run", 99),
         RequestStateError, "not 99", f"{M}.remove_skipped_blocks"),
    Case("manager", "resume beyond the slots", lambda w: w.m.can_resume("run", 99),
         RequestStateError, "not 99", f"{M}.can_resume"),
    Case("manager", "failed blocks of an unknown request",
         lambda w: w.m.first_token_in("nope", {1}), UnknownRequestError, "'nope'",
         f"{M}.first_token_in"),
    Case("manager", "block ids of an unknown request", lambda w: w.m.get_block_ids("nope"),
         UnknownRequestError, "'nope'", f"{M}.get_block_ids"),
    Case("manager", "blocks of an unknown request", lambda w: w.m.get_blocks("nope"),
         UnknownRequestError, "'nope'", f"{M}.get_blocks"),
    Case("manager", "common prefix of an unknown request",
         lambda w: w.m.get_num_common_prefix_blocks("nope"), UnknownRequestError, "'nope'",
         f"{M}.get_num_common_prefix_blocks"),
    Case("manager", "partial blocks of an unknown request",
         lambda w: w.m.get_partial_block_ids("nope", 3), UnknownRequestError, "'nope'",
         f"{M}.get_partial_block_ids"),
    Case("manager", "partial block at a negative position",
         lambda w: w.m.get_partial_block_ids("run", -1), InvalidArgumentError, "num_tokens"),
    Case("manager", "slots of an unknown request", lambda w: w.m.num_slots("nope"),
         UnknownRequestError, "'nope'", f"{M}.num_slots"),
    Case("manager", "declare something that is not a request",
         lambda w: w.m.declare_upcoming([w.waiting, "run"]), InvalidArgumentError,
         "declare_upcoming takes requests, got 'run'", f"{M}.declare_upcoming"),
    Case("manager", "retain the longer hits of a group that does not exist",
         lambda w: w.m.retain_longer_hits([0, 5]), InvalidGroupError, "5 is not a group id",
         f"{M}.retain_longer_hits"),
    Case("manager", "retain the longer hits of a bool group id",
         lambda w: w.m.retain_longer_hits([True]), InvalidGroupError, "True is not a group id"),
    Case("manager", "evict the null block", lambda w: w.m.evict_blocks([0]), NullBlockError,
         "null block", f"{M}.evict_blocks"),
    Case("manager", "evict a block id out of range", lambda w: w.m.evict_blocks([1, 16]),
         InvalidArgumentError, "block id 16 out of range"),
    Case("manager", "negative hit count in stats",
         lambda w: w.m.record_prefix_cache_stats(w.running, -1), InvalidArgumentError,
         "num_hit_tokens", f"{M}.record_prefix_cache_stats"),
    Case("manager", "request with an empty salt",
         lambda w: w.m.make_request("x", [1], cache_salt=""), InvalidArgumentError,
         "cache_salt must be a non-empty str", f"{M}.make_request"),
    Case("manager", "request with a negative token", lambda w: w.m.make_request("x", [1, -2]),
         InvalidArgumentError, "got -2"),
    Case("manager", "lookup without a prompt", lambda w: w.m.get_computed_blocks(Request("x", [])),
         InvalidArgumentError, "prompt is empty", f"{M}.get_computed_blocks"),
    Case("manager", "a manager without a config", lambda w: KVCacheManager(None, 8),  # type: ignore[arg-type]
         InvalidArgumentError, "config must be a KVCacheConfig"),
    # (the calls and arguments added since ff19b3b, and the flags' one rule: real bools only)
    Case("manager", "a manager with an event recorder that is not one",
         lambda w: KVCacheManager(w.m.config, 64, events="zmq"),  # type: ignore[arg-type]
         InvalidArgumentError, "events must be an EventRecorder, got 'zmq'", f"{M}.__init__"),
    Case("manager", "a negative cache-hit bound", lambda w: w.m.get_computed_blocks(
        w.waiting, -1), InvalidArgumentError, "max_cache_hit_length must be a non-negative int"),
    Case("manager", "a delay flag that is not a bool, running request (fast path)",
         lambda w: w.m.allocate_slots(w.running, 1, delay_cache_blocks="no"),
         InvalidArgumentError, "delay_cache_blocks must be a bool, got 'no'"),
    Case("manager", "a delay flag that is not a bool, admission", lambda w: w.m.allocate_slots(
        w.waiting, 2, 8, w.hit, delay_cache_blocks=1), InvalidArgumentError,
         "delay_cache_blocks must be a bool, got 1"),
    Case("manager", "a full-sequence flag that is not a bool", lambda w: w.m.allocate_slots(
        w.running, 1, full_sequence_must_fit="yes"), InvalidArgumentError,
         "full_sequence_must_fit must be a bool, got 'yes'"),
    Case("manager", "a hit group that is not a block list", lambda w: w.m.allocate_slots(
        w.waiting, 2, 8, [5]), InvalidHitError, "got 5 for group 0"),  # type: ignore[list-item]
    Case("manager", "an empty hit whose group is None", lambda w: w.m.allocate_slots(
        w.waiting, 10, 0, [None]), InvalidHitError,  # type: ignore[list-item]
         "got None for group 0"),
    Case("manager", "free with a retention hint of 1", lambda w: w.m.free(w.running, retain=1),
         InvalidArgumentError, "retain must be a bool, got 1"),
    Case("manager", "withhold one block, not a list", lambda w: w.m.withhold(
        w.m.get_blocks("run")[0][0]), InvalidArgumentError,
         "withhold's blocks must be a collection"),
    Case("manager", "withhold None", lambda w: w.m.withhold(None),  # type: ignore[arg-type]
         InvalidArgumentError, "withhold's blocks must be a collection (a list or a tuple), got "
         "None"),
    Case("manager", "return one withheld block, not a list", lambda w: w.m.free_withheld(
        w.m.get_blocks("run")[0][0]), InvalidArgumentError,
         "free_withheld's blocks must be a collection"),
    Case("manager", "report a hit that is None", lambda w: w.m.report_prefix_hit(
        w.waiting, None), InvalidArgumentError,  # type: ignore[arg-type]
         "one block list per group (1), got None"),
    Case("manager", "report a hit whose group is not a list", lambda w: w.m.report_prefix_hit(
        w.waiting, [5]), InvalidArgumentError, "got 5 for group 0"),  # type: ignore[list-item]
    Case("manager", "report another pool's block", lambda w: w.m.report_prefix_hit(
        w.waiting, [w.other.get_blocks("orun")[0][:1]]), BlockStateError,
         "not a block of this pool"),
    Case("manager", "report more hit blocks than the request has hashes",
         lambda w: w.m.report_prefix_hit(w.waiting, [w.hit[0] * 3]), InvalidArgumentError,
         "6 blocks for group 0 exceed the request's 2 block hashes"),
    Case("manager", "evict None", lambda w: w.m.evict_blocks(None),  # type: ignore[arg-type]
         InvalidArgumentError, "block_ids must be a collection"),
    # -- pool ------------------------------------------------------------------------------------
    Case("pool", "more blocks than are free", lambda w: w.m.pool.get_new_blocks(99),
         NoFreeBlocksError, "only", f"{P}.get_new_blocks"),
    Case("pool", "a bool block count", lambda w: w.m.pool.get_new_blocks(True),
         InvalidArgumentError, "num_blocks"),
    Case("pool", "touch a foreign block", lambda w: w.m.pool.touch(
        [w.m.pool.blocks[1], w.other.pool.blocks[1]]), BlockStateError,
         "not a block of this pool", f"{P}.touch"),
    Case("pool", "free a free block", lambda w: w.m.pool.free_blocks(
        [w.m.pool.blocks[1], w.m.pool.policy.first()]), DoubleFreeError, "freed",
         f"{P}.free_blocks"),
    Case("pool", "an observer without callbacks", lambda w: w.m.pool.set_observer(
        object()), InvalidArgumentError,  # type: ignore[arg-type]  # deliberately bad
         "needs a callable on_block_allocated()", f"{P}.set_observer"),
    Case("pool", "watch a list of hashes", lambda w: w.m.pool.watch(
        [b"h"]), InvalidArgumentError,  # type: ignore[arg-type]  # deliberately bad
         "frozenset of block hashes", f"{P}.watch"),
    Case("pool", "pin a foreign block", lambda w: w.m.pool.pin(
        [w.m.pool.blocks[1], w.other.pool.blocks[1]]), BlockStateError,
         "not a block of this pool", f"{P}.pin"),
    Case("pool", "retain a foreign block", lambda w: w.m.pool.retain(
        [w.m.pool.blocks[1], w.other.pool.blocks[1]]), BlockStateError,
         "not a block of this pool", f"{P}.retain"),
    Case("pool", "free a foreign block", lambda w: w.m.pool.free_blocks(
        [w.other.pool.blocks[1]]), BlockStateError, "not a block of this pool"),
    Case("pool", "cache in a group that does not exist", lambda w: w.m.pool.cache_full_blocks(
        w.running, w.m.get_blocks("run")[0], 0, 2, 4, 3), InvalidGroupError, "group id 3",
         f"{P}.cache_full_blocks"),
    Case("pool", "cache a free block", lambda w: w.m.pool.cache_full_blocks(
        w.freed, [w.m.pool.policy.first()], 0, 1, 4, 0), BlockStateError, "is free"),
    Case("pool", "partial entry off a hash boundary", lambda w: w.m.pool.cache_partial_block(
        w.running, w.m.get_blocks("run")[0][1], 6, 4, 0), InvalidArgumentError,
         "multiple of hash_block_size", f"{P}.cache_partial_block"),
    Case("pool", "move cache entries onto a cached block", lambda w: w.m.pool.move_block_hashes(
        w.m.get_blocks("run")[0][0], w.m.get_blocks("run")[0][1]), BlockStateError,
         "already cached", f"{P}.move_block_hashes"),
    Case("pool", "report a hit in a group that does not exist",
         lambda w: w.m.pool.report_cached_blocks(w.running, 1, 4, 2, w.running.block_hashes),
         InvalidGroupError, "group id 2", f"{P}.report_cached_blocks"),
    Case("pool", "report more hit blocks than hashes",
         lambda w: w.m.pool.report_cached_blocks(w.running, 9, 4, 0, w.running.block_hashes),
         InvalidArgumentError, "exceeds the 2 block hashes"),
    Case("pool", "lookup in a group that does not exist",
         lambda w: w.m.pool.get_cached_block(w.running.block_hashes[0], [5]), InvalidGroupError,
         "group id 5", f"{P}.get_cached_block"),
    Case("pool", "hints for a group that does not exist", lambda w: w.m.pool.set_hints(
        [w.running.block_hashes, ()]), InvalidArgumentError, "one hash collection per group",
         f"{P}.set_hints"),
    Case("pool", "a hint that is not a hash", lambda w: w.m.pool.set_hints(
        [[w.running.block_hashes[0], 7]]), InvalidArgumentError, "got 7"),
    Case("pool", "an unknown eviction policy", lambda w: BlockPool(8, eviction_policy="lirs"),
         InvalidArgumentError, "unknown eviction policy 'lirs'"),
    Case("pool", "an eviction policy option out of range",
         lambda w: BlockPool(8, eviction_policy="slru:protected_share=2"),
         InvalidArgumentError, "protected_share"),
    Case("pool", "an eviction policy option it does not take",
         lambda w: BlockPool(8, eviction_policy="lru:ghost_factor=2"),
         InvalidArgumentError, "takes no option"),
    Case("pool", "evict a bool block id", lambda w: w.m.pool.evict_blocks([True]),
         InvalidArgumentError, "True", f"{P}.evict_blocks"),
    Case("pool", "the map of a group that does not exist",
         lambda w: w.m.pool.cached_blocks_map(2), InvalidGroupError, "group id 2",
         f"{P}.cached_blocks_map"),
    Case("pool", "a pool with bool group count", lambda w: BlockPool(8, num_groups=True),
         InvalidArgumentError, "num_groups"),
    Case("pool", "a pool with an observer that is not one", lambda w: BlockPool(
        8, observer=5), InvalidArgumentError,  # type: ignore[arg-type]
         "a pool observer needs a callable on_block_allocated(), got 5", f"{P}.__init__"),
    Case("pool", "pin one block, not a list", lambda w: w.m.pool.pin(
        w.m.pool.blocks[1]), InvalidArgumentError,  # type: ignore[arg-type]
         "pin's blocks must be a collection"),
    Case("pool", "pin None", lambda w: w.m.pool.pin(None),  # type: ignore[arg-type]
         InvalidArgumentError, "pin's blocks must be a collection"),
    Case("pool", "touch one block, not a list", lambda w: w.m.pool.touch(
        w.m.pool.blocks[1]), InvalidArgumentError,  # type: ignore[arg-type]
         "touch's blocks must be a collection"),
    Case("pool", "retain None", lambda w: w.m.pool.retain(None),  # type: ignore[arg-type]
         InvalidArgumentError, "retain's blocks must be a collection"),
    Case("pool", "free None", lambda w: w.m.pool.free_blocks(None),  # type: ignore[arg-type]
         InvalidArgumentError, "ordered_blocks must be a collection"),
    Case("pool", "a release that is not a Release", lambda w: w.m.pool.note_release(
        w.m.get_blocks("run"), (3, 0, (4,))), InvalidArgumentError,  # type: ignore[arg-type]
         "note_release needs a Release, got (3, 0, (4,))", f"{P}.note_release"),
    Case("pool", "a release with one group too many", lambda w: w.m.pool.note_release(
        (*w.m.get_blocks("run"), []), Release(3, 0, (4,))), InvalidArgumentError,
         "one block list and one block size per group (1)"),
    Case("pool", "a release of a foreign block", lambda w: w.m.pool.note_release(
        ([KVCacheBlock(1)],), Release(3, 0, (4,))), BlockStateError,
         "note_release: KVCacheBlock(id=1"),
    Case("pool", "a release with a negative output count", lambda w: w.m.pool.note_release(
        w.m.get_blocks("run"), Release(3, -1, (4,))), InvalidArgumentError,
         "num_output_tokens"),
    Case("pool", "a release with a block size of 0", lambda w: w.m.pool.note_release(
        w.m.get_blocks("run"), Release(3, 0, (0,))), InvalidArgumentError,
         "block sizes must be positive ints, got (0,)"),
    Case("pool", "a release with a trust flag that is not a bool", lambda w: w.m.pool.note_release(
        w.m.get_blocks("run"), Release(3, 0, (4,)), trusted="yes"), InvalidArgumentError,
         "trusted must be a bool, got 'yes'"),
    Case("pool", "touch with a trust flag that is not a bool", lambda w: w.m.pool.touch(
        [w.m.pool.blocks[1]], trusted="no"), InvalidArgumentError,
         "trusted must be a bool, got 'no'"),
    Case("pool", "free with a trust flag of 1", lambda w: w.m.pool.free_blocks(
        [w.m.pool.blocks[1]], trusted=1), InvalidArgumentError, "trusted must be a bool, got 1"),
    Case("pool", "cache with a trust flag that is not a bool", lambda w: w.m.pool.cache_full_blocks(
        w.running, w.m.get_blocks("run")[0], 0, 2, 4, 0, trusted="x"), InvalidArgumentError,
         "trusted must be a bool, got 'x'"),
    Case("pool", "lookup with a group id that is a str", lambda w: w.m.pool.get_cached_block(
        w.running.block_hashes[0], ["0"]), InvalidGroupError,  # type: ignore[list-item]
         "a group id must be an int, got '0'"),
    Case("pool", "lookup with group ids that are one int", lambda w: w.m.pool.get_cached_block(
        w.running.block_hashes[0], 0), InvalidArgumentError,  # type: ignore[arg-type]
         "group_ids must be a collection of group ids, got 0"),
    # -- specs, config, settings, events (constructors: nothing to change but the new object) ----
    Case("config", "Mamba state shapes that are an int", lambda w: _mamba(shapes=5),
         InvalidArgumentError, "MambaSpec.shapes and dtypes must be sequences",
         "MambaSpec.__init__"),
    Case("config", "a Mamba state dimension of 0", lambda w: _mamba(shapes=((0, 4),)),
         InvalidArgumentError, "positive ints, got (0, 4)"),
    Case("config", "a Mamba state dimension that is a bool", lambda w: _mamba(shapes=((True,),)),
         InvalidArgumentError, "positive ints, got (True,)"),
    Case("config", "a Mamba dtype that is a str", lambda w: _mamba(dtypes=("float16",)),
         InvalidArgumentError, "must be a torch.dtype, got 'float16'"),
    Case("config", "fewer Mamba dtypes than shapes", lambda w: _mamba(
        shapes=((2,), (3,)), dtypes=(F16,)), InvalidArgumentError, "one dtype per state shape"),
    Case("config", "an unknown Mamba cache mode", lambda w: _mamba(mamba_cache_mode="full"),
         InvalidArgumentError, "mamba_cache_mode"),
    Case("config", "two Mamba prefill checkpoints", lambda w: _mamba(
        mamba_cache_mode="align", num_prefill_checkpoint_blocks=2), InvalidArgumentError,
         "num_prefill_checkpoint_blocks"),
    Case("config", "a Mamba checkpoint alignment of 0", lambda w: _mamba(
        mamba_cache_mode="align", prefill_checkpoint_alignment=0), InvalidArgumentError,
         "prefill_checkpoint_alignment"),
    Case("config", "a bounded-replay flag of 1", lambda w: SlidingWindowSpec(
        block_size=4, num_kv_heads=1, head_size=8, sliding_window=8,
        bounded_replay=1), InvalidArgumentError,  # type: ignore[arg-type]
         "bounded_replay must be a bool, got 1", "SlidingWindowSpec.__init__"),
    Case("config", "a circular buffer of 0 slots", lambda w: CircularBufferSpec(
        block_size=0, num_kv_heads=1, head_size=8), InvalidArgumentError, "block_size",
         "CircularBufferSpec.__init__"),
    Case("config", "a full-attention block size that is a bool", lambda w: FullAttentionSpec(
        block_size=True, num_kv_heads=1, head_size=8), InvalidArgumentError,
         "block_size must be a positive int, got True", "FullAttentionSpec.__init__"),
    Case("config", "a chunk of 0 tokens", lambda w: ChunkedLocalAttentionSpec(
        block_size=4, num_kv_heads=1, head_size=8, attention_chunk_size=0), InvalidArgumentError,
         "attention_chunk_size", "ChunkedLocalAttentionSpec.__init__"),
    Case("config", "cross attention with no heads", lambda w: CrossAttentionSpec(
        block_size=4, num_kv_heads=0, head_size=8), InvalidArgumentError, "num_kv_heads",
         "CrossAttentionSpec.__init__"),
    Case("config", "a config whose groups are None", lambda w: KVCacheConfig(
        8, None), InvalidArgumentError,  # type: ignore[arg-type]
         "KVCacheConfig.groups must be a collection of KVCacheGroup objects, got None",
         "KVCacheConfig.__init__"),
    Case("config", "a negative retention interval", lambda w: KVCacheConfig(
        8, w.m.config.groups, -4), InvalidArgumentError, "prefix_cache_retention_interval"),
    Case("config", "a group whose layer names are an int", lambda w: KVCacheGroup(
        5, full_spec(4)), InvalidArgumentError,  # type: ignore[arg-type]
         "non-empty sequence of layer names, got 5", "KVCacheGroup.__init__"),
    Case("config", "a negative hash lookahead", lambda w: CacheSettings(
        num_hash_lookahead_tokens=-1), InvalidArgumentError, "num_hash_lookahead_tokens",
         "CacheSettings.__init__"),
    Case("config", "a junction-tail flag of 1", lambda w: CacheSettings(
        eagle_junction_tail=1), InvalidArgumentError,  # type: ignore[arg-type]
         "eagle_junction_tail must be a bool, got 1"),
    Case("config", "EAGLE groups as a list", lambda w: CacheSettings(
        use_eagle=True, eagle_groups=[1]), InvalidArgumentError,  # type: ignore[arg-type]
         "eagle_groups must be None or a tuple of distinct group ids"),
    Case("config", "an EAGLE group past the model's groups", lambda w: make_manager(
        full_spec(4), swa_spec(8), use_eagle=True, eagle_groups=(0, 3)), InvalidGroupError,
         "eagle_groups [3] name no group"),
    Case("config", "extra retained tokens of -1", lambda w: SlidingWindowSpec(
        block_size=4, num_kv_heads=1, head_size=8, sliding_window=8,
        extra_retained_tokens=-1), InvalidArgumentError, "extra_retained_tokens must be an int"),
    Case("manager", "a negative free-block count", lambda w: w.m.set_num_free_blocks(-1),
         InvalidArgumentError, "num_free_blocks must be a non-negative int, got -1",
         f"{M}.set_num_free_blocks"),
    Case("manager", "a free-block count above the free blocks", lambda w: w.m.set_num_free_blocks(
        16), NoFreeBlocksError, "set_num_free_blocks(16): only 12 blocks are free and 0 held"),
    Case("config", "a prompt-boundary flag that is a str", lambda w: CacheSettings(
        mamba_recache_prompt_boundary="yes"), InvalidArgumentError,  # type: ignore[arg-type]
         "mamba_recache_prompt_boundary must be a bool"),
    Case("config", "a settings copy with an unknown option", lambda w: CacheSettings().replace(
        caching=False), InvalidArgumentError, "unknown cache option(s) caching",
         "CacheSettings.replace"),
    Case("config", "recommended settings with an unknown option",
         lambda w: CacheSettings.recommended(caching=False), InvalidArgumentError,
         "unknown cache option(s) caching", "CacheSettings.recommended"),
    Case("config", "an unknown policy checked by the registry", lambda w: REGISTRY.check("lirs"),
         InvalidArgumentError, "unknown eviction policy 'lirs'", "PolicyRegistry.check"),
    Case("config", "a block hasher with a negative lookahead", lambda w: RequestBlockHasher(
        4, BlockHasher(), lookahead=-1), InvalidArgumentError, "lookahead must be an int >= 0",
         "RequestBlockHasher.__init__"),
    Case("events", "a recorder with a negative lookahead", lambda w: EventRecorder(lookahead=-1),
         InvalidArgumentError, "lookahead must be an int >= 0, got -1", "EventRecorder.__init__"),
    Case("events", "a recorder with a lookahead that is a str", lambda w: EventRecorder(
        lookahead="2"), InvalidArgumentError, "got '2'"),  # type: ignore[arg-type]
    Case("events", "a recorder whose medium is not a str", lambda w: EventRecorder(
        medium=None), InvalidArgumentError, "medium must be a str"),  # type: ignore[arg-type]
    Case("events", "a recorder for no config", lambda w: EventRecorder.for_config(
        None), InvalidArgumentError,  # type: ignore[arg-type]
         "config must be a KVCacheConfig, got None", "EventRecorder.for_config"),
    # -- scheduler -------------------------------------------------------------------------------
    Case("scheduler", "duplicate request id", lambda w: w.sched.add_request(
        w.sched.kv.make_request("s1", [1, 2])), InvalidArgumentError, "already in the scheduler",
         f"{S}.add_request"),
    Case("scheduler", "a prompt that leaves no room", lambda w: w.sched.add_request(
        w.sched.kv.make_request("long", list(range(64)))), RequestRejectedError,
         "max_model_len=64"),
    Case("scheduler", "a finished request again", lambda w: w.sched.add_request(_finished(w)),
         InvalidArgumentError, "is not new"),
    Case("scheduler", "one bad request in a batch", lambda w: w.sched.add_requests(
        [w.sched.kv.make_request("ok", [1, 2], max_tokens=2),
         w.sched.kv.make_request("s2", [3])]),
         InvalidArgumentError, "'s2' is already", f"{S}.add_requests"),
    Case("scheduler", "abort an unknown request", lambda w: w.sched.abort_request("nope"),
         UnknownRequestError, "'nope'", f"{S}.abort_request"),
    Case("scheduler", "a sampled token missing", lambda w: w.sched.update_from_output(
        w.step, {"s1": 1}), InvalidArgumentError, "no sampled token",
         f"{S}.update_from_output", setup=_schedule, teardown=_finish_step),
    Case("scheduler", "a negative sampled token", lambda w: w.sched.update_from_output(
        w.step, {"s1": 1, "s2": -4}), InvalidArgumentError, "got -4",
         setup=_schedule, teardown=_finish_step),
    Case("scheduler", "wrong number of sampled tokens", lambda w: w.sched.update_from_output(
        w.step, [1]), InvalidArgumentError, "1 sampled tokens for",
         setup=_schedule, teardown=_finish_step),
    Case("scheduler", "a config without sequences", lambda w: SchedulerConfig(max_num_seqs=0),
         InvalidArgumentError, "max_num_seqs"),
    # -- runner ----------------------------------------------------------------------------------
    Case("runner", "a token outside the vocabulary", lambda w: w.llm.generate(
        [[1, 2], [3, 300]], use_tqdm=False), InvalidArgumentError,
         "prompt 1: token id 300 at position 1 is outside the vocabulary [0, 300)"),
    Case("runner", "a prompt as long as max_model_len", lambda w: w.llm.generate(
        [[1] * 48], use_tqdm=False), InvalidArgumentError, "max_model_len=48"),
    Case("runner", "an empty prompt", lambda w: w.llm.generate([[]], use_tqdm=False),
         InvalidArgumentError, "prompt 0 is empty"),
    Case("runner", "fewer sampling params than prompts", lambda w: w.llm.generate(
        [[1], [2]], [SamplingParams()], use_tqdm=False), InvalidArgumentError,
         "1 sampling params for 2 prompts"),
    Case("runner", "NaN temperature", lambda w: SamplingParams(temperature=float("nan")),
         InvalidArgumentError, "temperature"),
    Case("runner", "top_p above 1", lambda w: SamplingParams(top_p=1.5), InvalidArgumentError,
         "top_p"),
    Case("runner", "max_tokens 0", lambda w: SamplingParams(max_tokens=0), InvalidArgumentError,
         "max_tokens"),
    # -- command line ----------------------------------------------------------------------------
    Case("cli", "a NaN timestamp", lambda w: _cli(w, "replay", _trace(
        w, '{"timestamp": NaN, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n')),
         SystemExit, "bad.jsonl:1: timestamp must be a finite number"),
    Case("cli", "a negative output length", lambda w: _cli(w, "replay", _trace(
        w, '{"timestamp": 0, "input_length": 5, "output_length": -1, "hash_ids": [1]}\n')),
         SystemExit, "output_length must be an integer >= 0, got -1"),
    Case("cli", "hash ids that do not match the length", lambda w: _cli(w, "replay", _trace(
        w, '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}\n')),
         SystemExit, "needs 2 hash ids"),
    Case("cli", "zero blocks", lambda w: _cli(w, "replay", "--num-blocks", "0"), SystemExit,
         "expected a positive integer, got 0"),
    Case("cli", "a missing trace", lambda w: _cli(w, "replay", str(w.tmp / "none.jsonl")),
         SystemExit, "trace file not found"),
    Case("cli", "an unknown fuzz setup", lambda w: _cli(w, "bench", "fuzz", "--setup", "nope",
                                                       "--ops", "1"),
         SystemExit, "no setup named"),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c.layer}: {c.name}" for c in CASES])
def test_bad_input_is_refused_and_changes_nothing(world: World, case: Case) -> None:
    saved = (world.running.num_computed_tokens, list(world.running.all_token_ids),
             list(world.running.block_hashes))
    if case.setup is not None:
        case.setup(world)
    before = world.snapshot()
    try:
        with pytest.raises(case.error) as info:
            case.call(world)
        assert case.match in str(info.value), f"{type(info.value).__name__}: {info.value}"
        assert world.snapshot() == before, "a refused call changed something"
    finally:
        world.running.num_computed_tokens = saved[0]
        world.running.all_token_ids[:] = saved[1]
        world.running.block_hashes[:] = saved[2]
        if case.teardown is not None:
            case.teardown(world)


def test_the_table_is_large_and_spans_every_layer() -> None:
    assert len(CASES) >= 30
    assert {c.layer for c in CASES} == {"manager", "pool", "config", "events", "scheduler",
                                        "runner", "cli"}


# Public calls that take arguments but cannot fail on bad state, with the reason.
CANNOT_FAIL = {
    f"{M}.check_invariants": "raises InvariantError on a corrupt state by design",
    f"{M}.requests": "returns a copy",
    f"{M}.take_events": "drains a list",
    f"{M}.withheld_blocks": "returns a copy",
    f"{M}.held_free_blocks": "returns a copy",
    f"{M}.make_prefix_cache_stats": "starts a new interval",
    f"{M}.reset_prefix_cache": "refuses with False, changing nothing (tested in test_manager)",
    f"{M}.new_step": "clears a per-step set",
    f"{M}.shared_prefix_boundary": "read-only",
    f"{P}.reset_prefix_cache": "refuses with False, changing nothing",
    f"{P}.take_events": "drains a list",
    f"{P}.iter_cached": "read-only",
    f"{P}.num_cached_blocks": "read-only",
    f"{P}.has_partial_primary": "read-only",
    f"{P}.partial_primary_tokens": "read-only",
    f"{P}.secondary_keys": "read-only",
    f"{S}.schedule": "allocates only through calls whose inputs it computes itself",
    f"{S}.fail_step": "aborts what its output scheduled (tested in test_scheduler)",
    f"{S}.take_events": "drains the manager's and the connector's event lists",
    f"{S}.blocks_needed": "read-only",
    f"{S}.has_unfinished_requests": "read-only",
}


SPECS = [FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec, MambaSpec,
         CrossAttentionSpec, CircularBufferSpec]

# Public calls left unchecked on purpose: the layers below the manager (coordinators, single-type
# managers, the pool's event recorder, the specs' per-step queries) and the scheduler's helpers
# are called by kvcore itself with values it computed from checked input, many on the hot path;
# a user reaches them through the checked calls above.  Each with its caller.
INTERNAL = {
    **{f"{spec.__name__}.{name}": reason for spec in SPECS for name, reason in [
        ("event_stamp", "takes no argument"),
        ("needed_positions", "the managers' and the oracle's query, with a count they computed"),
        ("max_blocks_per_request", "sizing read by KVCacheManager.__init__ and the scheduler "
                                   "with their checked max_model_len"),
        ("max_memory_usage_bytes", "sizing over max_blocks_per_request (same callers)")]},
    "EventRecorder.stored": "the pool's and the host tier's, with blocks they just cached",
    "EventRecorder.stored_keys": "the host tier's, with keys it just stored",
    "EventRecorder.removed": "the pool's, with a block it just evicted",
    "EventRecorder.cleared": "takes no argument",
    "EventRecorder.take": "drains a list",
    "HitVerifier.__init__": "built by the manager per lookup, lookahead from CacheSettings",
    "PrefixChains.__init__": "built by the coordinator, lookahead from CacheSettings",
    "num_hashable_blocks": "the manager's hashing arithmetic (hot), with its own counts",
    "hash_extra_keys": "the block hasher's, per block (hot)",
    "BlockHashView.count": "a list method over a request's hashes; any value gives a count",
    "BlockHashView.index": "a list method: raises ValueError for a missing value, as list does",
    "EngineHashes.hash_block": "the block hasher's per-block call (hot)",
    "lookup_boundary": "returns 0 for anything but a stamped hit of that request (its contract)",
    "evictions_since_lookup": "returns 0 for anything but a stamped hit of that request",
    **{f"KVCacheCoordinator.{name}": "KVCacheManager's, after its checks (one per call)"
       for name in ("allocate_new", "allocate_running", "common_prefix_blocks", "hint_hashes",
                    "partial_block_ids", "pop_blocks", "report_prefix_hit", "uncache_blocks",
                    "num_blocks_to_allocate")},
    "HybridCoordinator.find_longest_cache_hit_per_group": "the vLLM adapter's coordinator view, "
                                                          "with the request's own hashes",
    **{f"{cls}.{name}": "the coordinator's, per group, after the manager's checks"
       for cls, names in [
           ("SingleTypeKVCacheManager", ("count_state_blocks", "pop_blocks")),
           ("CrossAttentionManager", ("add_computed_blocks",)),
           ("CircularBufferManager", (
               "add_computed_blocks", "allocate_external_computed_blocks", "allocate_new_blocks",
               "count_state_blocks", "find_longest_cache_hit", "get_num_blocks_to_allocate",
               "get_num_freeable_skipped_blocks", "remove_skipped_blocks", "uncache_blocks")),
           ("MambaAlignManager", (
               "__init__", "allocate_new_blocks", "cache_mask", "count_state_blocks",
               "get_num_blocks_to_allocate", "get_num_freeable_skipped_blocks", "pop_blocks",
               "remove_skipped_blocks", "take_boundary_state_offloads"))]
       for name in names},
    "check_observer": "the check itself: raises InvalidArgumentError (BlockPool's cases)",
    **{f"PoolObserver.{name}": "a callback the user implements; the pool calls it"
       for name in ("on_block_accessed", "on_block_allocated", "on_block_evicted", "reset")},
    "ManagerState.withheld_blocks": "a protocol: what the invariant checks read",
    "holds_place": "the scheduler's predicate over its own requests",
    "hint_key": "the schedulers' value of what they declare, over their own requests",
    "WaitingOrder.__init__": "built by the scheduler from its checked SchedulerConfig",
}

# Every public method and function of the manager, the pool, the coordinators and single-type
# managers, the specs, the settings, the events, hashing, the connectors' step view and the
# scheduler added since ff19b3b (`git diff ff19b3b f9e81f1`, read with `ast`: new functions and
# methods, and those that took new arguments): each is fed bad input above, or says why not.
# (Properties without arguments are left out; the vLLM integration, the Dynamo interop, the
# testing kit and the benchmarks are not the API this suite walks.)
NEW_SINCE_FF19B3B = [
    "kvcore.manager:KVCacheManager.__init__", "kvcore.manager:KVCacheManager.get_computed_blocks",
    "kvcore.manager:KVCacheManager.allocate_slots", "kvcore.manager:KVCacheManager.withhold",
    "kvcore.manager:KVCacheManager.free_withheld",
    "kvcore.manager:KVCacheManager.pop_blocks_for_free",
    "kvcore.manager:KVCacheManager.withheld_blocks", "kvcore.manager:lookup_boundary",
    "kvcore.manager:evictions_since_lookup",
    "kvcore.block_pool:BlockPool.__init__", "kvcore.block_pool:BlockPool.pin",
    "kvcore.block_pool:BlockPool.set_observer", "kvcore.block_pool:BlockPool.touch",
    "kvcore.block_pool:BlockPool.free_blocks", "kvcore.block_pool:BlockPool.cache_full_blocks",
    "kvcore.pool.observer:check_observer", "kvcore.pool.observer:PoolObserver.on_block_accessed",
    "kvcore.pool.observer:PoolObserver.on_block_allocated",
    "kvcore.pool.observer:PoolObserver.on_block_evicted", "kvcore.pool.observer:PoolObserver.reset",
    "kvcore.specs:CircularBufferSpec.__init__",
    "kvcore.specs:CircularBufferSpec.max_blocks_per_request",
    "kvcore.specs:CircularBufferSpec.needed_positions", "kvcore.specs:MambaSpec.__init__",
    "kvcore.specs:SlidingWindowSpec.__init__",
    "kvcore.settings:CacheSettings.__init__", "kvcore.settings:CacheSettings.replace",
    "kvcore.eviction.registry:PolicyRegistry.check",
    "kvcore.events.recorder:EventRecorder.__init__",
    "kvcore.events.recorder:EventRecorder.for_config",
    "kvcore.request:RequestBlockHasher.__init__", "kvcore.verify:HitVerifier.__init__",
    "kvcore.verify:PrefixChains.__init__", "kvcore.hashing:num_hashable_blocks",
    "kvcore.hashing:hash_extra_keys", "kvcore.hashing:BlockHashView.count",
    "kvcore.hashing:BlockHashView.index", "kvcore.hashing:EngineHashes.hash_block",
    *[f"kvcore.coordinator.base:KVCacheCoordinator.{name}" for name in (
        "allocate_new", "allocate_running", "common_prefix_blocks", "hint_hashes",
        "partial_block_ids", "pop_blocks", "report_prefix_hit", "uncache_blocks",
        "num_blocks_to_allocate")],
    "kvcore.coordinator.hybrid:HybridCoordinator.find_longest_cache_hit_per_group",
    "kvcore.managers.base:SingleTypeKVCacheManager.count_state_blocks",
    "kvcore.managers.base:SingleTypeKVCacheManager.pop_blocks",
    "kvcore.managers.cross_attention:CrossAttentionManager.add_computed_blocks",
    *[f"kvcore.managers.circular_buffer:CircularBufferManager.{name}" for name in (
        "add_computed_blocks", "allocate_external_computed_blocks", "allocate_new_blocks",
        "count_state_blocks", "find_longest_cache_hit", "get_num_blocks_to_allocate",
        "get_num_freeable_skipped_blocks", "remove_skipped_blocks", "uncache_blocks")],
    *[f"kvcore.managers.mamba:MambaAlignManager.{name}" for name in (
        "__init__", "allocate_new_blocks", "cache_mask", "count_state_blocks",
        "get_num_blocks_to_allocate", "get_num_freeable_skipped_blocks", "pop_blocks",
        "remove_skipped_blocks", "take_boundary_state_offloads")],
    "kvcore.invariants:ManagerState.withheld_blocks",
    "kvcore.scheduler.core:holds_place", "kvcore.scheduler.admission:hint_key",
    "kvcore.scheduler.admission:WaitingOrder.__init__",
]

# The classes whose every public call is walked (constructors included, but the Scheduler's:
# Scheduler(None) raises AttributeError, left to the scheduler's own change).
WALKED = [KVCacheManager, BlockPool, Scheduler, CacheSettings, KVCacheConfig, KVCacheGroup,
          *SPECS, EventRecorder]


@pytest.mark.parametrize("cls", WALKED, ids=lambda cls: cls.__name__)
def test_every_public_call_is_covered(cls: type) -> None:
    covered = {c.covers for c in CASES if c.covers}
    names = [name for name, _ in inspect.getmembers(cls, inspect.isfunction)
             if not name.startswith("_")]
    names += [name for name, value in vars(cls).items()
              if isinstance(value, classmethod) and not name.startswith("_") and name != "of"]
    if cls is not Scheduler:
        names.append("__init__")
    for name in names:
        qual = f"{cls.__name__}.{name}"
        assert qual in covered or qual in CANNOT_FAIL or qual in INTERNAL, (
            f"{qual}: add a failing case or a reason")


def test_every_public_call_added_since_ff19b3b_is_covered() -> None:
    covered = {c.covers for c in CASES if c.covers}
    for entry in NEW_SINCE_FF19B3B:
        module, _, qual = entry.partition(":")
        target: object = importlib.import_module(module)
        for part in qual.split("."):
            target = getattr(target, part)  # it exists where the list says
        assert callable(target), entry
        assert qual in covered or qual in CANNOT_FAIL or qual in INTERNAL, (
            f"{qual}: add a failing case or a reason")


def test_cli_error_output_is_json_free_one_line(world: World, capsys: pytest.CaptureFixture[str]
                                                ) -> None:
    rc = cli_main(["replay", "--json", _trace(world, "[1, 2]\n")])
    out, err = capsys.readouterr()
    assert rc == 2 and not out and len(err.strip().splitlines()) == 1
    with pytest.raises(json.JSONDecodeError):
        json.loads(err)


def test_one_rule_for_counts_in_the_pool_and_the_manager() -> None:
    """Every count kvcore takes follows one rule, from one helper: an int or another integer
    type (numpy's) >= 0; bools, floats and negatives are refused naming the value.  (The pool
    once had a helper of its own that refused numpy integers the manager took.)"""
    import re

    import numpy as np

    from kvcore import block_pool, manager, validation

    m = make_manager(full_spec(4), num_blocks=16, max_model_len=64)
    r = m.make_request("r", list(range(40)))
    assert m.allocate_slots(r, np.int64(40)) is not None  # type: ignore[arg-type]
    taken = m.pool.get_new_blocks(np.int64(1))  # type: ignore[arg-type]
    assert len(taken) == 1 and m.num_free_blocks == 4
    m.pool.free_blocks(taken)
    for bad in (True, np.int64(-1), 1.0):
        before = manager_snapshot(m)
        with pytest.raises(InvalidArgumentError, match=re.escape(f"got {bad!r}")):
            m.pool.get_new_blocks(bad)  # type: ignore[arg-type]
        s = m.make_request("s", list(range(8)))
        with pytest.raises(InvalidArgumentError, match=re.escape(f"got {bad!r}")):
            m.allocate_slots(s, bad)  # type: ignore[arg-type]
        assert manager_snapshot(m) == before
    assert manager.check_count is block_pool.check_count is validation.check_count


def test_one_rule_for_flags() -> None:
    """Every boolean flag kvcore takes follows one rule (kvcore.validation.check_flag): a real
    bool, anything else refused naming the value, changing nothing, in both builds; the hot
    ones (allocate_slots', the pool's ``trusted``) on their fast path and off it.  (Before,
    ``allocate_slots(delay_cache_blocks="no")`` was read as true and ``touch(trusted="no")``
    skipped the pool's checks, while ``free(retain=1)`` was refused.)"""
    m = make_manager(full_spec(4), num_blocks=16, max_model_len=64)
    running = m.make_request("run", list(range(10)))
    assert m.allocate_slots(running, 10) is not None
    running.num_computed_tokens = 10
    waiting = m.make_request("wait", [*range(8), 50, 51])
    hit, num_hit = m.get_computed_blocks(waiting)
    block = m.get_blocks("run")[0][0]
    calls: list[tuple[str, Callable[[object], object]]] = [
        ("delay_cache_blocks", lambda v: m.allocate_slots(running, 1, delay_cache_blocks=v)),
        ("delay_cache_blocks", lambda v: m.allocate_slots(waiting, 2, num_hit, hit,
                                                          delay_cache_blocks=v)),
        ("full_sequence_must_fit", lambda v: m.allocate_slots(running, 1,
                                                              full_sequence_must_fit=v)),
        ("full_sequence_must_fit", lambda v: m.allocate_slots(waiting, 2, num_hit, hit,
                                                              full_sequence_must_fit=v)),
        ("retain", lambda v: m.free(running, retain=v)),
        ("trusted", lambda v: m.pool.touch([block], trusted=v)),
        ("trusted", lambda v: m.pool.free_blocks([block], trusted=v)),
        ("trusted", lambda v: m.pool.cache_full_blocks(running, m.get_blocks("run")[0], 0, 2, 4,
                                                       0, trusted=v)),
        # (the dataclasses' fields say bool: the point is a value that is not one)
        ("enable_caching", lambda v: CacheSettings(enable_caching=v)),  # type: ignore[arg-type]
        ("bounded_replay", lambda v: SlidingWindowSpec(
            block_size=4, num_kv_heads=1, head_size=8, sliding_window=8,
            bounded_replay=v)),  # type: ignore[arg-type]
    ]
    for name, call in calls:
        for bad in (1, 0, "no", None, np.bool_(True)):
            before = manager_snapshot(m)
            with pytest.raises(InvalidArgumentError, match=f"{name} must be a bool, got "):
                call(bad)
            assert manager_snapshot(m) == before, (name, bad)
    # and the bools themselves are taken
    assert m.allocate_slots(running, 1, delay_cache_blocks=True) is not None
    m.check_invariants()


def test_a_refused_hit_report_records_no_group() -> None:
    """report_prefix_hit checks every group before it records any: a hit too long for the
    second group leaves no event of the first behind (it used to record the first group's
    BlockStored, then raise)."""
    m = make_manager(full_spec(4), swa_spec(8, 4), num_blocks=32, max_model_len=64,
                     enable_events=True)
    r = m.make_request("r", list(range(12)))
    assert m.allocate_slots(r, 12) is not None
    r.num_computed_tokens = 12
    twin = m.make_request("twin", [*range(12), 99])
    hit, num_hit = m.get_computed_blocks(twin)
    assert num_hit == 12
    m.take_events()
    before = manager_snapshot(m)
    with pytest.raises(InvalidArgumentError, match="4 blocks for group 1 exceed"):
        m.report_prefix_hit(twin, [hit[0], [*hit[1], hit[1][-1]]])
    assert manager_snapshot(m) == before and m.take_events() == []
    m.report_prefix_hit(twin, hit)  # the hit as it was found is reported, one event per group
    assert len(m.take_events()) == 2
