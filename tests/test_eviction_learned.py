"""The ``learned`` eviction policy: what a release tells it, what it learns, how it ranks, and
that policies which do not read releases cost nothing more (kvcore.eviction.learned).  The
generic policy properties (invariants under random operation sequences, hints, atomicity) are
tested for every policy, ``learned`` included, in tests/test_eviction_policies.py and the hostile
fuzz setups."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import pytest
import torch

from kvcore import KVCacheConfig, KVCacheGroup, KVCacheManager, MambaSpec, Request
from kvcore.eviction import REGISTRY, make_policy
from kvcore.eviction.base import Release
from kvcore.eviction.learned import (
    DEEP,
    FRESH,
    HIT,
    LATER_TURN,
    NUM_CATEGORIES,
    UNTAGGED,
    LearnedPolicy,
    category,
    describe_category,
)
from kvcore.sim.policies import simulate, to_block_requests
from kvcore.sim.replay import ReplayConfig, replay
from kvcore.sim.workloads import multi_turn
from kvcore.types import KVCacheBlock
from tests.factories import full_spec, make_config
from tests.test_eviction_registry import MRUPolicy

BS = 2


def tokens(tag: int, n: int) -> list[int]:
    return [tag * 1000 + i for i in range(n)]


def manager(num_blocks: int = 40, policy: str = "learned") -> KVCacheManager:
    return KVCacheManager(make_config(full_spec(BS), num_blocks=num_blocks), 1024,
                          eviction_policy=policy)


def serve(m: KVCacheManager, rid: str, prompt: list[int], output_tokens: int = 0,
          free: bool = True) -> Request:
    """A request admitted with its prefix hit, decoded ``output_tokens`` tokens (as a scheduler
    does), then freed."""
    req = m.make_request(rid, prompt)
    hit, n = m.get_computed_blocks(req)
    assert m.allocate_slots(req, req.num_tokens - n, n, hit) is not None
    req.num_computed_tokens = req.num_tokens
    for k in range(output_tokens):
        req.append_output_token_ids(500_000 + 1000 * len(rid) + k)
        assert m.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
    if free:
        m.free(req)
    m.check_invariants()
    return req


def learned(m: KVCacheManager) -> LearnedPolicy:
    policy = m.pool.policy
    assert isinstance(policy, LearnedPolicy)
    return policy


def categories(m: KVCacheManager, blocks: Iterable[KVCacheBlock]) -> list[int | None]:
    return [learned(m).category_of(b) for b in blocks]


def test_it_is_a_registered_pool_policy() -> None:
    assert "learned" in REGISTRY.names(offline=False)
    assert not REGISTRY.info("learned").offline
    policy = make_policy("learned:tau=2,half_life=3,ghost_factor=1", [KVCacheBlock(1)])
    assert isinstance(policy, LearnedPolicy) and policy.tau == 2.0 and policy.half_life == 3.0


@pytest.mark.parametrize("spec, word", [("learned:tau=0", "tau"),
                                        ("learned:half_life=-1", "half_life"),
                                        ("learned:ghost_factor=100", "ghost_factor"),
                                        ("learned:deep_after=1.5", "deep_after"),
                                        ("learned:deep_after=-1", "deep_after")])
def test_bad_options_are_refused_naming_them(spec: str, word: str) -> None:
    with pytest.raises(ValueError, match=word):
        make_policy(spec, [KVCacheBlock(1)])


def test_a_release_sorts_prompt_and_generated_blocks_by_turn_and_output_length() -> None:
    m = manager(num_blocks=300)
    # A fresh request with a short answer: 3 full prompt blocks, 2 generated ones.
    a = serve(m, "a", [*tokens(1, 6), 9], output_tokens=4)
    prompt_cat = category(False, False, FRESH, 4)
    assert describe_category(prompt_cat) == "prompt, not hit, fresh, short output"
    assert sorted(c for c in categories(m, m.pool.policy) if c is not None) == sorted(
        [prompt_cat] * 3 + [category(True, False, FRESH, 4)] * 2)

    def named(req: Request) -> set[str]:
        blocks = m.pool.blocks
        return {describe_category(c) for h in req.block_hashes[:req.num_prompt_tokens // BS]
                for found in [m.pool.get_cached_block(h, [0])] if found
                for c in [learned(m).category_of(blocks[found[0].block_id])] if c is not None}

    # A request that hits a's prefix but not its tail: a prefix hit (its hit blocks are
    # tagged by it now: the latest release tells).
    b = serve(m, "b", tokens(1, 4) + tokens(2, 3), output_tokens=200)
    assert named(b) == {"prompt, hit, prefix hit, long output",
                        "prompt, not hit, prefix hit, long output"}
    # A request whose hit reaches a's last full block: a later turn.
    c = serve(m, "c", a.all_token_ids + tokens(3, 3), output_tokens=40)
    assert named(c) == {"prompt, hit, later turn, medium output",
                        "prompt, not hit, later turn, medium output"}


def test_categories_are_distinct_and_named() -> None:
    names = [describe_category(c) for c in range(NUM_CATEGORIES)]
    assert len(set(names)) == NUM_CATEGORIES
    assert sorted({category(g, h, t, n, d) for g in (False, True) for h in (False, True)
                   for t in (FRESH, HIT, LATER_TURN) for n in (0, 16, 128)
                   for d in (False, True)}) == [c for c in range(NUM_CATEGORIES) if c != UNTAGGED]
    assert category(False, True, FRESH, 0, deep=True) == category(False, True, FRESH, 0)
    assert category(True, False, FRESH, 0, deep=True) == category(True, False, FRESH, 0)
    assert describe_category(category(False, False, HIT, 200, deep=True)) == (
        "prompt, not hit, prefix hit, long output, deep")


def test_prompt_blocks_far_past_the_hit_prefix_are_deep() -> None:
    m = manager(num_blocks=300, policy="learned:deep_after=2")

    def cats(req: Request) -> list[int | None]:
        return [learned(m).category_of(m.pool.blocks[found[0].block_id])
                for h in req.block_hashes[:req.num_prompt_tokens // BS]
                for found in [m.pool.get_cached_block(h, [0])] if found]

    # Fresh: nothing hit, so the frontier is the first block; from the third block on, deep.
    a = serve(m, "a", [*tokens(1, 12), 9])
    shallow, deep = category(False, False, FRESH, 0), category(False, False, FRESH, 0, True)
    assert cats(a) == [shallow] * 2 + [deep] * 4
    # A prefix hit of a's first three blocks, then five new ones: the two after the hit
    # prefix are shallow, the rest deep.
    b = serve(m, "b", tokens(1, 6) + tokens(2, 10) + [9])
    assert cats(b) == ([category(False, True, HIT, 0)] * 3
                       + [category(False, False, HIT, 0)] * 2
                       + [category(False, False, HIT, 0, True)] * 3)
    # deep_after=0: no deep blocks.
    plain = manager(num_blocks=300, policy="learned:deep_after=0")
    c = serve(plain, "c", [*tokens(1, 12), 9])
    assert {learned(plain).category_of(b) for b in plain.pool.blocks
            if b.block_hash in set(c.block_hashes)} == {shallow}


def test_a_deep_block_is_never_worth_more_than_the_shallow_ones_before_it() -> None:
    """A hit on a deep block needs the shallow blocks before it: a deep category is ranked at
    most at the value of the shallow one of the same turn and output length, and of equal worth
    goes first (even where its own count shows more reuse)."""
    policy = LearnedPolicy([KVCacheBlock(i) for i in range(1, 9)])
    shallow = category(False, False, FRESH, 0)
    deep = category(False, False, FRESH, 0, deep=True)
    assert deep >= DEEP
    policy._freed[shallow], policy._reused[shallow] = 100.0, 20.0
    policy._freed[deep], policy._reused[deep] = 100.0, 80.0
    policy._refresh()
    assert policy._value[deep] < policy._value[shallow]
    blocks = policy.pick_victims(8, 1)
    _cached_free(policy, blocks[4:], deep)  # a request frees its tail first,
    _cached_free(policy, blocks[:4], shallow)  # in the same step
    assert policy.pick_victims(4, 1) == blocks[4:]
    # Where the deep count shows less reuse, that is its value.
    policy._freed[deep], policy._reused[deep] = 100.0, 5.0
    policy._refresh()
    assert policy._value[deep] == pytest.approx(math.log(0.05), abs=1e-4)
    assert policy.check() == []


def _train(m: KVCacheManager, rounds: int) -> None:
    """Short answers come back (their prompts are hit again while free), long ones never do."""
    for r in range(rounds):
        serve(m, f"s{r}", [*tokens(100 + r, 4), 1], output_tokens=2)
        serve(m, f"s{r}'", [*tokens(100 + r, 4), 2], output_tokens=2)  # the hit
        serve(m, f"l{r}", [*tokens(500 + r, 4), 1], output_tokens=300)


def test_it_learns_which_categories_are_reused_and_evicts_the_others_first() -> None:
    m = manager(num_blocks=400)
    _train(m, 12)
    policy = learned(m)
    short = category(False, False, FRESH, 2)
    long_ = category(False, False, FRESH, 300)
    assert policy.reuse_probability(short) > 0.5 > 0.1 > policy.reuse_probability(long_)
    # Under pressure, a long answer's prompt goes before a short answer's freed earlier.
    old_short = serve(m, "old-short", [*tokens(900, 4), 1], output_tokens=2)
    newer_long = serve(m, "newer-long", [*tokens(901, 4), 1], output_tokens=300)

    def cached(req: Request) -> bool:
        return m.pool.get_cached_block(req.block_hashes[0], [0]) is not None

    held: list[KVCacheBlock] = []
    while cached(old_short) and cached(newer_long):
        held += m.pool.get_new_blocks(1)  # kept in use: each allocation evicts one more
    assert cached(old_short) and not cached(newer_long), "a more likely reused block went first"
    m.pool.free_blocks(held)
    m.check_invariants()


def _cached_free(policy: LearnedPolicy, blocks: list[KVCacheBlock], c: int) -> None:
    """Free ``blocks`` (hashed, in use) into category ``c``, as a release then a free would."""
    for b in blocks:
        if b.block_hash is None:
            b.block_hash = bytes([b.block_id])  # type: ignore[assignment]
        b.ref_cnt = 0
        b.policy_tag = c
    policy.on_free((), blocks)


def test_age_wins_over_value_in_the_end() -> None:
    """A block of a more valuable category is kept ``tau * capacity * ln(p ratio)`` allocations
    longer, not forever: the victim has the lowest ``ln p - age / (tau * capacity)``."""
    policy = LearnedPolicy([KVCacheBlock(i) for i in range(1, 9)], tau=0.25)  # 2 per e-fold
    hi = category(False, False, FRESH, 0)
    lo = category(False, False, FRESH, 500)
    policy._freed[hi], policy._reused[hi] = 100.0, 90.0  # p = 0.9
    policy._freed[lo], policy._reused[lo] = 100.0, 10.0  # p = 0.1: ln 9 * 2 = 4.4 allocations
    policy._refresh()
    blocks = policy.pick_victims(8, 1)  # all in use now
    _cached_free(policy, blocks[:1], hi)  # at clock 0
    spare = blocks[1]
    for clock in range(8):  # a fresh lo block each time; one eviction advances the clock
        spare.block_hash = bytes([100 + clock])  # type: ignore[assignment]  # (not a return)
        _cached_free(policy, [spare], lo)
        (victim,) = policy.pick_victims(1, 1)
        if victim is blocks[0]:
            break
        assert victim is spare
    assert clock == 5  # the first clock past 4.4
    assert policy.check() == []


def test_a_ghost_return_counts_as_a_reuse_and_ranks_the_block_as_hit() -> None:
    m = manager(num_blocks=10)
    a = serve(m, "a", [*tokens(1, 4), 9], output_tokens=0)
    cat = category(False, False, FRESH, 0)
    before = learned(m)._reused[cat]
    for r in range(6):  # push a's blocks out
        serve(m, f"x{r}", [*tokens(50 + r, 4), 9])
    assert m.pool.get_cached_block(a.block_hashes[0], [0]) is None
    serve(m, "a-again", [*tokens(1, 4), 8])  # recomputed: its hashes return from the ghost
    assert learned(m)._reused[cat] > before
    hit_cat = category(False, True, FRESH, 0)
    block = m.pool.get_cached_block(a.block_hashes[0], [0])
    assert block is not None and learned(m).category_of(block[0]) == hit_cat


def test_the_learned_counts_decay() -> None:
    policy = LearnedPolicy([KVCacheBlock(i) for i in range(1, 5)], half_life=0.5)  # halve / 2
    c = category(False, False, FRESH, 0)
    blocks = policy.pick_victims(4, 1)
    _cached_free(policy, blocks, c)
    policy._freed[c], policy._reused[c] = 64.0, 32.0
    policy.pick_victims(2, 1)  # two cached evictions: one half-life
    assert policy._freed[c] == 32.0 and policy._reused[c] == 16.0
    assert policy.reuse_probability(c) == 0.5
    policy.pick_victims(2, 1)
    assert policy._freed[c] == 16.0


class _Recording(MRUPolicy):
    """A policy of one's own (test_eviction_registry's) that asks for releases and records them
    (its eviction order does not matter here)."""

    reads_releases = True

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        super().__init__(blocks)
        self.seen: list[tuple[list[list[int]], Release]] = []

    def on_release(self, groups: Sequence[Sequence[KVCacheBlock]], release: Release) -> None:
        self.seen.append(([[b.block_id for b in g] for g in groups], release))


def test_the_manager_tells_a_policy_that_reads_releases_and_no_other() -> None:
    made: list[_Recording] = []

    def factory(blocks: Sequence[KVCacheBlock]) -> _Recording:
        made.append(_Recording(blocks))
        return made[-1]

    m = KVCacheManager(make_config(full_spec(BS), full_spec(4), num_blocks=30), 64,
                       eviction_policy=factory)
    req = serve(m, "a", [*tokens(1, 8), 5], output_tokens=3, free=False)
    table = [[b.block_id for b in g] for g in m.get_blocks("a")]
    m.free(req)
    assert made[0].seen == [(table, Release(9, 3, (2, 4)))]
    other = serve(m, "b", tokens(2, 3), free=False)
    handed = m.pop_blocks_for_free(other)  # a deferred free is a release too
    assert made[0].seen[-1][1] == Release(3, 0, (2, 4))
    m.free_withheld(handed[::-1])
    m.check_invariants()
    # lru does not read releases: the manager does not gather the blocks at all.
    assert not REGISTRY.info("lru").cls.reads_releases
    plain = manager(policy="lru")
    assert plain._reads_releases is False  # (the flag the free path reads)


def test_the_simulator_reproduces_the_manager_at_concurrency_one() -> None:
    """The simulator tells the policy the same releases as the manager, so ``learned`` ranks the
    same blocks the same way (as ``lru`` is checked on the shipped trace)."""
    trace = multi_turn(num_conversations=24, turns=5, user_len=60, assistant_len=40,
                       think_ms=0.0, interval_ms=0.0, seed=3)
    cap = 60
    sim = simulate(to_block_requests(trace, 16), cap, "learned", 16)
    real = replay(trace, ReplayConfig(block_size=16, num_blocks=cap + 1, max_num_seqs=1,
                                      max_num_batched_tokens=4096, eviction_policy="learned"))
    assert real.num_finished == len(trace) and real.preemptions == 0
    assert sim.evictions > 0
    assert abs(sim.hit_rate - real.token_hit_rate) < 0.01


def test_a_hit_from_the_hint_reserve_counts_for_the_blocks_category() -> None:
    """Blocks a scheduler hint kept in the reserve since their release never reach the policy;
    a hit on them is still a reuse of the category their release gave them."""
    m = manager()
    a = serve(m, "a", [*tokens(1, 4), 9], free=False)
    waiting = m.make_request("w", [*tokens(1, 4), 7])
    m.declare_upcoming([waiting])  # a's prefix is declared: freed, it waits in the reserve
    m.free(a)
    assert len(m.pool.reserve) == 2 and all(learned(m).category_of(b) is None for b in m.pool.reserve)
    cat = category(False, False, FRESH, 0)
    freed, reused = learned(m)._freed[cat], learned(m)._reused[cat]
    hit, n = m.get_computed_blocks(waiting)
    assert n == 4 and m.allocate_slots(waiting, waiting.num_tokens - n, n, hit) is not None
    assert learned(m)._freed[cat] == freed + 2 and learned(m)._reused[cat] == reused + 2
    m.check_invariants()


@pytest.mark.parametrize("hints", [0, 8])
def test_with_more_than_one_group_it_ranks_in_lru_order(hints: int) -> None:
    """A hit needs every group's block at its end, so on a layout of more than one group (here a
    Mamba "align" state group beside full attention, as vLLM builds a hybrid model) every cached
    block ranks in one category: the replay is LRU's, evictions and hits alike.  (Ranked apart,
    the state blocks went first and took the attention blocks' hits with them.)"""
    mamba = MambaSpec(block_size=16, shapes=((2, 4),), dtypes=(torch.float32,),
                      mamba_cache_mode="align", num_prefill_checkpoint_blocks=1,
                      prefill_checkpoint_alignment=1)
    config = KVCacheConfig(num_blocks=61, groups=(KVCacheGroup(("m",), mamba),
                                                  KVCacheGroup(("a",), full_spec(16))))
    trace = multi_turn(num_conversations=24, turns=5, user_len=60, assistant_len=40,
                       think_ms=0.0, interval_ms=0.0, seed=3)

    def run(policy: str) -> tuple[int, float, int]:
        r = replay(trace, ReplayConfig(block_size=16, num_blocks=61, kv_config=config,
                                       max_num_seqs=4, max_num_batched_tokens=256,
                                       eviction_policy=policy, queue_hints=hints))
        assert r.num_finished == len(trace)
        return r.evicted_blocks, r.token_hit_rate, r.preemptions

    learned, lru = run("learned"), run("lru")
    assert learned == lru and learned[0] > 0 and learned[1] > 0


def test_a_block_touched_and_freed_without_a_release_keeps_its_category() -> None:
    """A caller that refreshes recency by touching free blocks and freeing them again (kvcore's
    SGLang backend on every lookup) must not strip their categories: freed without a release,
    a touched block returns to the category it had, now as a hit one."""
    m = manager()
    a = serve(m, "a", [*tokens(1, 8), 9], output_tokens=0)  # four full blocks of 2 tokens
    blocks = [b for b in m.pool.blocks if b.block_hash in set(a.block_hashes)]
    assert len(blocks) == 4
    assert set(categories(m, blocks)) == {category(False, False, FRESH, 0)}
    m.pool.touch(blocks, trusted=True)
    m.pool.free_blocks(blocks[::-1], trusted=True)
    m.check_invariants()
    assert set(categories(m, blocks)) == {category(False, True, FRESH, 0)}
