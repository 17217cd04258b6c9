"""Hypothesis state machines over KVCacheManager, mixing valid and hostile calls.

Each machine drives a :class:`kvcore.testing.driver.HostileDriver`: admissions with prefix hits
(and tokens computed elsewhere, loaded now or later), chunked prefill, decode, preemption,
failed steps, frees (immediate and deferred), evictions and resets, interleaved with calls a buggy scheduler makes
(freed or duplicate requests, hits without blocks, foreign, stale or perturbed hits, null
blocks where KV is needed, bad counts).  After every step: ``check_invariants()``, every running
table holds its request's KV (content oracle), refused calls changed nothing, no leak once idle.

The machines cover full, sliding-window and chunked-local attention (chunk sizes that are not
multiples of the block size), hybrids with different block sizes (Mamba in both modes among
them, with lookahead hashes, sparse retention and each eviction policy), Mamba and cross
attention, caching off, and colliding hashers under ``verify_hits``.  The seeded fuzz in test_fuzz.py runs
every setup of ``kvcore.testing.driver.SETUPS``.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcore.testing.driver import PERTURBATIONS, VOCAB, HostileDriver
from kvcore.testing.setups import SETUPS, Setup

INDEX = st.integers(0, 99)


class HostileMachine(RuleBasedStateMachine):
    setup: Setup = SETUPS[0]

    def __init__(self) -> None:
        super().__init__()
        self.d = HostileDriver(self.setup)

    # -- valid ----------------------------------------------------------------------------------
    @rule(family=st.integers(0, 2), keep=st.integers(0, 40),
          tail=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24),
          salt=st.integers(0, 3), lora=st.integers(0, 3), image=st.booleans())
    def add(self, family: int, keep: int, tail: list[int], salt: int, lora: int,
            image: bool) -> None:
        self.d.add(family, keep, tail, salt, lora, image)

    @precondition(lambda self: bool(self.d.waiting))
    @rule(i=INDEX, chunk=st.integers(1, 40), external=st.sampled_from([0, 0, 0, 3, 9]),
          lookahead=st.sampled_from([0, 0, 2]), delay=st.booleans())
    def admit(self, i: int, chunk: int, external: int, lookahead: int, delay: bool) -> None:
        self.d.admit(i, chunk, external, lookahead, delay)

    @precondition(lambda self: bool(self.d.running))
    @rule(i=INDEX, chunk=st.integers(1, 16), token=st.integers(0, VOCAB - 1),
          lookahead=st.sampled_from([0, 0, 0, 2]))
    def step(self, i: int, chunk: int, token: int, lookahead: int) -> None:
        self.d.step(i, chunk, token, lookahead)

    @precondition(lambda self: bool(self.d.running or self.d.loading))
    @rule(i=INDEX, preempt=st.booleans())
    def free(self, i: int, preempt: bool) -> None:
        self.d.free(i, preempt)

    @precondition(lambda self: bool(self.d.running or self.d.loading))
    @rule(i=INDEX, preempt=st.booleans())
    def defer_free(self, i: int, preempt: bool) -> None:
        self.d.defer_free(i, preempt)

    @precondition(lambda self: bool(self.d.withheld))
    @rule(i=INDEX)
    def return_withheld(self, i: int) -> None:
        self.d.return_withheld(i)

    @precondition(lambda self: bool(self.d.loading))
    @rule(i=INDEX)
    def finish_load(self, i: int) -> None:
        self.d.finish_load(i)

    @rule()
    def fail_step(self) -> None:
        self.d.fail_step()

    @rule()
    def new_step(self) -> None:
        self.d.new_step()

    @rule(ids=st.lists(INDEX, min_size=1, max_size=3))
    def evict(self, ids: list[int]) -> None:
        self.d.evict(ids)

    @rule()
    def reset(self) -> None:
        self.d.reset()

    # -- hostile --------------------------------------------------------------------------------
    @rule(i=INDEX, arg=st.integers(0, 4), value=st.integers(0, 4))
    def bad_count(self, i: int, arg: int, value: int) -> None:
        self.d.bad_count(i, arg, value)

    @rule(i=INDEX)
    def return_twice(self, i: int) -> None:
        self.d.return_twice(i)

    @rule(i=INDEX)
    def use_freed(self, i: int) -> None:
        self.d.use_freed(i)

    @rule(i=INDEX, blocks=st.integers(0, 2))
    def claim_without_blocks(self, i: int, blocks: int) -> None:
        self.d.claim_without_blocks(i, blocks)

    @rule(i=INDEX)
    def foreign_hit(self, i: int) -> None:
        self.d.foreign_hit(i)

    @rule(i=INDEX)
    def stale_hit(self, i: int) -> None:
        self.d.stale_hit(i)

    @rule(i=INDEX)
    def duplicate_id(self, i: int) -> None:
        self.d.duplicate_id(i)

    @rule(i=INDEX, extra=st.integers(0, 3))
    def overrun(self, i: int, extra: int) -> None:
        self.d.overrun(i, extra)

    @rule(i=INDEX)
    def null_where_needed(self, i: int) -> None:
        self.d.null_where_needed(i)

    @rule(i=INDEX)
    def hit_while_running(self, i: int) -> None:
        self.d.hit_while_running(i)

    @rule(i=INDEX)
    def bad_calls(self, i: int) -> None:
        self.d.bad_calls(i)

    @rule(i=INDEX, j=INDEX, how=st.integers(0, len(PERTURBATIONS) - 1), k=INDEX)
    def perturbed_hit(self, i: int, j: int, how: int, k: int) -> None:
        self.d.perturbed_hit(i, j, how, k)

    @invariant()
    def checked(self) -> None:
        self.d.check()

    def teardown(self) -> None:
        self.d.drain()


def _machine(name: str) -> type[RuleBasedStateMachine]:
    setup = next(s for s in SETUPS if s.name == name)
    return type(f"Hostile[{name}]", (HostileMachine,), {"setup": setup})


TestFull = _machine("full").TestCase
TestSlidingWindowVerify = _machine("swa7 verify").TestCase
TestChunkedOddChunk = _machine("chunked13").TestCase
TestHybridFullChunkedOddChunk = _machine("full+chunked13").TestCase
TestHybridBlockSizesColliding = _machine("full4+swa12/8 tokens").TestCase
TestHybridFullMambaColliding = _machine("full+mamba constant").TestCase
TestHybridFullCross = _machine("full+cross").TestCase
TestTwoSlidingGroupsTruncatedHash = _machine("full+swa5+swa5 truncated").TestCase
TestNoPrefixCache = _machine("nocache full+swa").TestCase
TestPartialTailEntriesEagleVerify = _machine("full8+swa4 eagle verify").TestCase
TestHybridThreeTypesEagleColliding = _machine("full+swa7+mamba eagle tokens").TestCase
# MTP/EAGLE on a hybrid model: speculative Mamba state blocks moved along an "align" table, its
# checkpoints at EAGLE's replay boundary.
TestMambaAlignSpeculativeEagleVerify = _machine("full+mamba-align spec3 eagle verify").TestCase
# Different block sizes per group (the hit alignment larger than the Mamba group's blocks, or
# the hashes finer than the Mamba group's), crossed with lookahead hashes, sparse retention and
# each eviction policy: the content oracle proves every hit and table.
TestMixedAlignCheckpointLookahead = _machine("mixed-bs full8+mamba-align4 la3 dense lru").TestCase
TestMixedAlignRetentionSLRU = _machine("mixed-bs full8+mamba-align4 la0 ret0 slru").TestCase
TestMixedThreeTypesS3FIFO = _machine("mixed-bs full8+swa6/4+mamba-align4 la3 ret16 s3fifo"
                                     ).TestCase
TestMixedLargerMambaBlocksARC = _machine("mixed-bs full4+mamba-align8 la3 ret0 arc").TestCase
TestMixedMambaNoneLookaheadSLRU = _machine("mixed-bs full8+mamba4 la3 dense slru").TestCase
TestMixedSlidingRetentionARC = _machine("mixed-bs full4+swa12/8 la0 ret16 arc").TestCase
