"""The nano-vllm BlockManager adapter, driven the way nano-vllm's current scheduler drives its
block manager (``can_allocate`` → ``allocate(seq, num_cached_blocks)``, chunked prefill of the
first waiting sequence, ``hash_blocks`` in ``postprocess``, decode with ``can_append`` /
``may_append`` and preemption of the newest running sequence), with a content oracle that
checks every computed position reads KV written for exactly its own prefix."""

from __future__ import annotations

import random
from collections import deque
from enum import Enum, auto
from itertools import count
from typing import Any

import pytest

from kvcore.errors import (
    InvalidArgumentError,
    InvalidHitError,
    NoFreeBlocksError,
    UnknownRequestError,
)
from kvcore.integrations.nanovllm import BlockManager
from kvcore.testing import CollidingHasher


class Status(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Seq:
    """The fields of nano-vllm's Sequence that its scheduler and block manager use."""

    _ids = count()

    def __init__(self, token_ids: list[int], max_tokens: int) -> None:
        self.seq_id = next(Seq._ids)
        self.status = Status.WAITING
        self.token_ids = list(token_ids)
        self.num_tokens = len(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.num_cached_tokens = 0  # tokens whose KV has been computed
        self.num_scheduled_tokens = 0  # tokens computed in the current step
        self.is_prefill = True
        self.block_table: list[int] = []
        self.max_tokens = max_tokens

    def __len__(self) -> int:
        return self.num_tokens

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.num_tokens += 1


class NanoScheduler:
    """nano-vllm's scheduling loop: prefill-only steps while anything waits (only the first
    sequence of a step may be chunked), otherwise one decode token per running sequence."""

    def __init__(self, bm: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.bm = bm
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Seq] = deque()
        self.running: deque[Seq] = deque()
        self.num_preemptions = 0
        self.admitted_hits: list[int] = []  # num_cached_blocks of every admission

    def schedule(self) -> tuple[list[Seq], bool]:
        batch: list[Seq] = []
        used = 0
        while self.waiting and len(batch) < self.max_num_seqs:
            seq = self.waiting[0]
            room = self.max_num_batched_tokens - used
            if room == 0:
                break
            fresh = not seq.block_table
            if fresh:
                num_cached_blocks = self.bm.can_allocate(seq)
                if num_cached_blocks == -1:
                    break
                todo = seq.num_tokens - num_cached_blocks * self.bm.block_size
            else:  # a prefill chunked in an earlier step goes on
                todo = seq.num_tokens - seq.num_cached_tokens
            if batch and todo > room:
                break
            if fresh:
                self.bm.allocate(seq, num_cached_blocks)
                self.admitted_hits.append(num_cached_blocks)
            seq.num_scheduled_tokens = min(todo, room)
            used += seq.num_scheduled_tokens
            if seq.num_cached_tokens + seq.num_scheduled_tokens == seq.num_tokens:
                seq.status = Status.RUNNING
                self.running.append(self.waiting.popleft())
            batch.append(seq)
        if batch:
            return batch, True
        while self.running and len(batch) < self.max_num_seqs:
            seq = self.running.popleft()
            while not self.bm.can_append(seq):
                if self.running:
                    self.preempt(self.running.pop())
                else:
                    self.preempt(seq)
                    break
            else:
                seq.num_scheduled_tokens = 1
                seq.is_prefill = False
                self.bm.may_append(seq)
                batch.append(seq)
        assert batch, "nano-vllm's scheduler requires progress"
        self.running.extendleft(reversed(batch))
        return batch, False

    def preempt(self, seq: Seq) -> None:
        seq.status = Status.WAITING
        seq.is_prefill = True
        self.bm.deallocate(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def postprocess(self, seqs: list[Seq], token_ids: list[int], is_prefill: bool) -> None:
        for seq, token_id in zip(seqs, token_ids):
            self.bm.hash_blocks(seq)
            seq.num_cached_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            if is_prefill and seq.num_cached_tokens < seq.num_tokens:
                continue  # mid-prompt chunk: nothing sampled
            seq.append_token(token_id)
            if seq.num_completion_tokens == seq.max_tokens:
                seq.status = Status.FINISHED
                self.bm.deallocate(seq)
                self.running.remove(seq)


class KVOracle:
    """What a model would have written in each slot: the whole prefix the token at that slot
    was computed for.  ``forward`` runs one batched step: every position a sequence reads must
    hold its own prefix's KV from earlier steps (a batch cannot read what it writes), then the
    positions it computes are written."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[tuple[int, int], tuple[int, ...]] = {}

    def _slot(self, seq: Seq, pos: int) -> tuple[int, int]:
        return seq.block_table[pos // self.block_size], pos % self.block_size

    def forward(self, batch: list[Seq]) -> None:
        for seq in batch:
            start, n = seq.num_cached_tokens, seq.num_scheduled_tokens
            assert n > 0 and start + n <= len(seq) <= len(seq.block_table) * self.block_size
            for pos in range(start):
                got = self.slots.get(self._slot(seq, pos))
                assert got == tuple(seq.token_ids[:pos + 1]), (
                    f"seq {seq.seq_id} position {pos} reads KV of another prefix")
        for seq in batch:
            start = seq.num_cached_tokens
            for pos in range(start, start + seq.num_scheduled_tokens):
                self.slots[self._slot(seq, pos)] = tuple(seq.token_ids[:pos + 1])


def run(bm: BlockManager, seqs: list[Seq], *, max_num_seqs: int = 8,
        max_num_batched_tokens: int = 64, max_steps: int = 10_000, seed: int = 0) -> NanoScheduler:
    sched = NanoScheduler(bm, max_num_seqs, max_num_batched_tokens)
    sched.waiting.extend(seqs)
    oracle = KVOracle(bm.block_size)
    rng = random.Random(seed)
    for _ in range(max_steps):
        if not sched.waiting and not sched.running:
            break
        batch, is_prefill = sched.schedule()
        for seq in batch:
            assert all(0 <= b < bm.manager.pool.num_blocks - 1 for b in seq.block_table)
        oracle.forward(batch)
        bm.manager.check_invariants()
        sched.postprocess(batch, [rng.randrange(50) for _ in batch], is_prefill)
        bm.manager.check_invariants()
    else:
        pytest.fail("did not finish")
    assert all(s.status is Status.FINISHED for s in seqs)
    assert bm.num_free_blocks == bm.manager.pool.num_blocks - 1 and bm.manager.usage == 0.0
    return sched


def test_prefill_decode_and_shared_prefix_hits() -> None:
    bm = BlockManager(num_blocks=64, block_size=4)
    system = list(range(100, 116))
    seqs = [Seq([*system, i, i + 1, i + 2], max_tokens=6) for i in range(6)]
    sched = run(bm, seqs, max_num_batched_tokens=24)  # one prompt per prefill step
    # The first prompt is cached only after its step; every later one hits the 4 system blocks.
    assert sched.admitted_hits == [0, 4, 4, 4, 4, 4]
    stats = bm.manager.make_prefix_cache_stats()
    assert stats is not None and stats.hits == 5 * 16


def test_blocks_enter_the_cache_only_once_their_step_ran() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    a = Seq(list(range(20)), max_tokens=1)
    assert bm.can_allocate(a) == 0
    bm.allocate(a, 0)
    assert len(a.block_table) == 5 and a.num_cached_tokens == 0
    b = Seq(list(range(20)), max_tokens=1)
    assert bm.can_allocate(b) == 0  # a's blocks are allocated, their KV not written yet
    a.num_scheduled_tokens = 10  # a chunk: blocks 0 and 1 become full, block 2 half
    bm.hash_blocks(a)
    a.num_cached_tokens, a.num_scheduled_tokens = 10, 0
    assert bm.can_allocate(b) == 2
    a.num_scheduled_tokens = 10
    bm.hash_blocks(a)
    a.num_cached_tokens, a.num_scheduled_tokens = 20, 0
    assert bm.can_allocate(b) == 4  # all 5 blocks cached, the last token's block never a hit
    bm.allocate(b, 4)
    assert b.block_table[:4] == a.block_table[:4] and b.num_cached_tokens == 16
    assert b.block_table[4] != a.block_table[4]
    bm.manager.check_invariants()


def test_chunked_prefill_of_a_long_prompt() -> None:
    bm = BlockManager(num_blocks=32, block_size=4)
    long = Seq(list(range(50)), max_tokens=3)
    short = Seq(list(range(1000, 1006)), max_tokens=3)
    sched = run(bm, [long, short], max_num_batched_tokens=16)
    assert sched.admitted_hits == [0, 0]


def test_last_prompt_block_is_recomputed_like_nano_vllm() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    run(bm, [Seq(list(range(12)), max_tokens=1)])
    # 12 tokens fill 3 blocks, all cached; nano-vllm and kvcore both serve only the first 2.
    again = Seq(list(range(12)), max_tokens=1)
    assert bm.can_allocate(again) == 2
    longer = Seq(list(range(13)), max_tokens=1)
    assert bm.can_allocate(longer) == 3


def test_allocate_takes_at_most_the_offered_hit() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    run(bm, [Seq(list(range(12)), max_tokens=1)])
    fewer = Seq(list(range(12)), max_tokens=1)
    bm.allocate(fewer, 1)  # a scheduler may use less of the hit than offered
    assert fewer.num_cached_tokens == 4
    more = Seq(list(range(12)), max_tokens=1)
    with pytest.raises(InvalidHitError):
        bm.allocate(more, 3)
    assert more.block_table == [] and more.num_cached_tokens == 0
    bm.manager.check_invariants()


def test_preemption_under_memory_pressure_and_rehit() -> None:
    bm = BlockManager(num_blocks=12, block_size=4)
    seqs = [Seq(list(range(i * 10, i * 10 + 9)), max_tokens=10) for i in range(4)]
    sched = run(bm, seqs)
    assert sched.num_preemptions > 0
    stats = bm.manager.make_prefix_cache_stats()
    assert stats is not None and stats.preempted_requests > 0 and stats.preempted_hits > 0


@pytest.mark.parametrize("seed", range(6))
def test_random_workload_with_shared_prefixes(seed: int) -> None:
    rng = random.Random(seed)
    bs = rng.choice((2, 4, 8))
    prefixes = [[rng.randrange(100) for _ in range(rng.randrange(0, 24))] for _ in range(3)]
    seqs = [Seq([*rng.choice(prefixes), *(rng.randrange(100) for _ in range(rng.randrange(1, 20)))],
                max_tokens=rng.randrange(1, 12)) for _ in range(20)]
    need = max(-(-(len(s) + s.max_tokens) // bs) for s in seqs)
    bm = BlockManager(num_blocks=need + rng.randrange(0, 3 * need), block_size=bs,
                      verify_hits=bool(seed % 2))
    run(bm, seqs, max_num_seqs=rng.randrange(1, 9), max_num_batched_tokens=rng.randrange(8, 64),
        seed=seed)


@pytest.mark.parametrize("kwargs", [{"verify_hits": True}, {"enable_caching": False}])
def test_colliding_hashes_never_serve_wrong_kv(kwargs: dict[str, Any]) -> None:
    """Block hashes that ignore the parent make equal blocks after different prefixes collide;
    nano-vllm's token comparison cannot tell them apart, kvcore's verified hits can."""
    bm = BlockManager(num_blocks=32, block_size=4, block_hasher=CollidingHasher("tokens"),
                      **kwargs)
    tail = [7, 7, 7, 7, 9]
    seqs = [Seq([1, 2, 3, 4, *tail], max_tokens=2), Seq([5, 6, 7, 8, *tail], max_tokens=2)]
    run(bm, seqs, max_num_batched_tokens=9)  # one prompt per step: the second could hit


def test_colliding_hashes_without_verification_are_caught_by_the_oracle() -> None:
    bm = BlockManager(num_blocks=32, block_size=4, block_hasher=CollidingHasher("tokens"))
    seqs = [Seq([1, 2, 3, 4, 7, 7, 7, 7, 9], max_tokens=2),
            Seq([1, 2, 3, 4, 7, 7, 7, 7, 9], max_tokens=2),
            Seq([7, 7, 7, 7, 7, 7, 7, 7, 9], max_tokens=2)]
    with pytest.raises(AssertionError, match="another prefix"):
        run(bm, seqs, max_num_batched_tokens=9)


def test_misuse_raises() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    big = Seq(list(range(20)), max_tokens=1)
    assert bm.can_allocate(big) == -1
    with pytest.raises(InvalidArgumentError, match="max_model_len"):
        bm.allocate(big, 0)  # longer than the whole cache
    roomy = BlockManager(num_blocks=2, block_size=4, max_model_len=64)
    with pytest.raises(NoFreeBlocksError):
        roomy.allocate(big, 0)
    assert roomy.num_free_blocks == 2
    with pytest.raises(UnknownRequestError):
        bm.deallocate(Seq([1], 1))
    with pytest.raises(UnknownRequestError):
        bm.hash_blocks(Seq([1], 1))
    with pytest.raises(UnknownRequestError):
        bm.may_append(Seq([1], 1))
    s = Seq([1, 2], 1)
    with pytest.raises(InvalidArgumentError):
        bm.allocate(s, -1)
    bm.allocate(s, 0)
    with pytest.raises(InvalidArgumentError):
        bm.allocate(s, 0)
    s.num_scheduled_tokens = 3
    with pytest.raises(InvalidArgumentError):
        bm.hash_blocks(s)  # more tokens than the sequence has
    with pytest.raises(InvalidArgumentError):
        BlockManager(num_blocks=0, block_size=4)
