"""The nano-vllm BlockManager adapter driven by a nano-vllm-style scheduling loop
(prefill-first batches, decode with preemption of the newest running sequence)."""

from __future__ import annotations

import random
from collections import deque
from enum import Enum, auto
from itertools import count

import pytest

from kvcore import InvalidArgumentError, NoFreeBlocksError, UnknownRequestError
from kvcore.compat.nanovllm import BlockManager


class Status(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Seq:
    """The parts of nano-vllm's Sequence a scheduler and block manager touch."""

    _ids = count()

    def __init__(self, token_ids: list[int], max_tokens: int) -> None:
        self.seq_id = next(Seq._ids)
        self.status = Status.WAITING
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.num_cached_tokens = 0
        self.block_table: list[int] = []
        self.max_tokens = max_tokens

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


class Scheduler:
    """A nano-vllm-shaped scheduler; it only ever calls the five BlockManager methods."""

    def __init__(self, bm: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.bm = bm
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Seq] = deque()
        self.running: deque[Seq] = deque()
        self.num_preemptions = 0

    def schedule(self) -> tuple[list[Seq], bool]:
        scheduled: list[Seq] = []
        tokens = 0
        while self.waiting and len(scheduled) < self.max_num_seqs:
            seq = self.waiting[0]
            if tokens + len(seq) > self.max_num_batched_tokens or not self.bm.can_allocate(seq):
                break
            self.bm.allocate(seq)
            tokens += len(seq) - seq.num_cached_tokens
            seq.status = Status.RUNNING
            self.running.append(self.waiting.popleft())
            scheduled.append(seq)
        if scheduled:
            return scheduled, True
        while self.running and len(scheduled) < self.max_num_seqs:
            seq = self.running.popleft()
            while not self.bm.can_append(seq):
                victim = self.running.pop() if self.running else seq
                self.preempt(victim)
                if victim is seq:
                    break
            else:
                self.bm.may_append(seq)
                scheduled.append(seq)
        self.running.extendleft(reversed(scheduled))
        return scheduled, False

    def preempt(self, seq: Seq) -> None:
        seq.status = Status.WAITING
        self.bm.deallocate(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def postprocess(self, seqs: list[Seq], tokens: list[int]) -> None:
        for seq, tok in zip(seqs, tokens):
            seq.token_ids.append(tok)
            if seq.num_completion_tokens == seq.max_tokens:
                seq.status = Status.FINISHED
                self.bm.deallocate(seq)
                self.running.remove(seq)


def run(bm: BlockManager, seqs: list[Seq], max_steps: int = 10_000) -> Scheduler:
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=256)
    sched.waiting.extend(seqs)
    rng = random.Random(0)
    for _ in range(max_steps):
        if not sched.waiting and not sched.running:
            break
        batch, _is_prefill = sched.schedule()
        assert batch, "scheduler made no progress"
        for seq in batch:
            # Every token the model will see has a slot: table covers len(seq) tokens.
            assert len(seq.block_table) * bm.block_size >= len(seq)
            assert all(0 <= b < bm.manager.pool.num_blocks - 1 for b in seq.block_table)
        bm.manager.check_invariants()
        sched.postprocess(batch, [rng.randrange(50) for _ in batch])
    else:
        pytest.fail("did not finish")
    return sched


def test_prefill_decode_and_shared_prefix_hits() -> None:
    bm = BlockManager(num_blocks=64, block_size=4)
    system = list(range(100, 116))
    seqs = [Seq([*system, i, i + 1, i + 2], max_tokens=6) for i in range(6)]
    run(bm, seqs)
    assert all(s.status is Status.FINISHED for s in seqs)
    assert bm.num_free_blocks == 64 and bm.manager.usage == 0.0
    stats = bm.manager.make_prefix_cache_stats()
    assert stats is not None and stats.hits >= 5 * 16  # later sequences hit the system prompt


def test_preemption_under_memory_pressure_and_rehit() -> None:
    bm = BlockManager(num_blocks=12, block_size=4)
    seqs = [Seq(list(range(i * 10, i * 10 + 9)), max_tokens=10) for i in range(4)]
    sched = run(bm, seqs)
    assert sched.num_preemptions > 0
    assert all(s.status is Status.FINISHED for s in seqs)
    assert bm.num_free_blocks == 12
    stats = bm.manager.make_prefix_cache_stats()
    assert stats is not None and stats.preempted_requests > 0 and stats.preempted_hits > 0


def test_block_tables_use_zero_based_ids_and_hits_set_num_cached_tokens() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = Seq(list(range(10)), max_tokens=1)
    assert bm.can_allocate(a)
    bm.allocate(a)
    assert a.block_table == [0, 1, 2] and a.num_cached_tokens == 0
    b = Seq(list(range(9)), max_tokens=1)
    bm.allocate(b)
    assert b.block_table[:2] == [0, 1] and b.num_cached_tokens == 8
    b.token_ids.append(7)  # decode: the 10th token goes into b's third block
    assert bm.can_append(b)
    bm.may_append(b)
    assert len(b.block_table) == 3


def test_misuse_raises() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    big = Seq(list(range(20)), max_tokens=1)
    assert not bm.can_allocate(big)
    with pytest.raises(InvalidArgumentError, match="max_model_len"):
        bm.allocate(big)  # longer than the whole cache
    roomy = BlockManager(num_blocks=2, block_size=4, max_model_len=64)
    with pytest.raises(NoFreeBlocksError):
        roomy.allocate(big)
    assert roomy.num_free_blocks == 2
    with pytest.raises(UnknownRequestError):
        bm.deallocate(Seq([1], 1))
    s = Seq([1, 2], 1)
    bm.allocate(s)
    with pytest.raises(InvalidArgumentError):
        bm.allocate(s)
    with pytest.raises(InvalidArgumentError):
        BlockManager(num_blocks=0, block_size=4)
