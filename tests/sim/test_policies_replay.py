"""Policy simulator (LRU/FIFO/LFU/Belady) and replay through the real scheduler and manager."""

from __future__ import annotations

import pytest

from kvcore.errors import InvalidArgumentError
from kvcore.sim import workloads as W
from kvcore.sim.policies import (
    POLICIES,
    BlockRequest,
    hit_rate_curve,
    ideal_hit_rate,
    simulate,
    to_block_requests,
)
from kvcore.sim.replay import ReplayConfig, replay
from kvcore.sim.traces import default_trace_path, load_mooncake
from tests.sim import small_workload

TRACE = default_trace_path()
needs_trace = pytest.mark.skipif(TRACE is None, reason="shipped Mooncake trace not present")


def test_lifecycle_by_hand() -> None:
    # Capacity 4, block size 4.  A: 2 prompt blocks + 1 output block; B shares A's first block.
    a = BlockRequest(("x", "y"), 8, 4)
    b = BlockRequest(("x", "z"), 9, 0)
    # Capacity 4: B hits "x", then its 2 fresh blocks take the last free block and evict the
    # least recent cached one, A's output block (the real pool pops the same block).
    r = simulate([a, b], 4, "lru", 4)
    assert r.hit_tokens == 4 and r.prompt_tokens == 17 and r.evictions == 1
    # With capacity 3, B's 3 blocks (1 hit pinned + 2 fresh) evict A's output, then A's "y".
    r = simulate([a, b], 3, "lru", 4)
    assert r.hit_tokens == 4 and r.evictions == 2
    # The last prompt token is never a hit: an identical 8-token prompt hits only 1 block.
    assert simulate([a, BlockRequest(("x", "y"), 8, 0)], 8, "lru", 4).hit_tokens == 4
    # Requests that can never fit are skipped, as the scheduler rejects them.
    assert simulate([BlockRequest(("p",) * 5, 20, 0)], 4, "fifo", 4).skipped == 1


def test_policy_differences_on_a_small_trace() -> None:
    hot = BlockRequest(("h1", "h2"), 9, 0)
    cold = [BlockRequest((f"c{i}",), 5, 0) for i in range(3)]
    seq = [hot, cold[0], hot, cold[1], cold[2], hot]
    lru = simulate(seq, 3, "lru", 4)
    fifo = simulate(seq, 3, "fifo", 4)
    lfu = simulate(seq, 3, "lfu", 4)
    belady = simulate(seq, 3, "belady", 4)
    assert belady.hit_tokens >= max(lru.hit_tokens, fifo.hit_tokens, lfu.hit_tokens)
    assert lfu.hit_tokens > fifo.hit_tokens  # the hot prefix survives cold traffic under LFU


def test_bad_policy_and_capacity() -> None:
    with pytest.raises(InvalidArgumentError, match="unknown eviction policy"):
        simulate([], 4, "mru", 4)
    with pytest.raises(InvalidArgumentError):
        simulate([], 0, "lru", 4)


@pytest.mark.parametrize("name", list(W.WORKLOADS))
def test_infinite_capacity_gives_ideal_and_belady_dominates(name: str) -> None:
    reqs = to_block_requests(small_workload(name), 16)
    ideal = ideal_hit_rate(reqs, 16)
    for policy in POLICIES:
        assert simulate(reqs, 10**7, policy, 16).hit_rate == pytest.approx(ideal)
    caps = [64, 256, 1024, 4096]
    curves = hit_rate_curve(reqs, caps, POLICIES, 16)
    for i in range(len(caps)):
        best_online = max(curves[p][i].hit_tokens for p in ("lru", "fifo", "lfu"))
        assert curves["belady"][i].hit_tokens >= best_online
        # Knowing which blocks come back (not when) never loses to recency alone here.
        assert curves["reuse_oracle"][i].hit_tokens >= curves["lru"][i].hit_tokens
    rates = [r.hit_rate for r in curves["lru"]]
    assert rates == sorted(rates)  # more capacity never hurts LRU here


@needs_trace
def test_shipped_trace_belady_bound_and_ideal() -> None:
    reqs = to_block_requests(load_mooncake(TRACE), 512)  # type: ignore[arg-type]
    ideal = ideal_hit_rate(reqs, 512)
    assert 0.6 < ideal < 0.7  # the Mooncake paper reports ~66% for this workload
    assert simulate(reqs, 10**6, "lru", 512).hit_rate == pytest.approx(ideal)
    caps = [1000, 4000, 16000]
    curves = hit_rate_curve(reqs, caps, POLICIES, 512)
    for i in range(len(caps)):
        assert curves["belady"][i].hit_rate >= max(curves[p][i].hit_rate for p in ("lru", "fifo", "lfu"))


@needs_trace
def test_lru_reproduces_the_real_manager_at_concurrency_one() -> None:
    trace = load_mooncake(TRACE)  # type: ignore[arg-type]
    cap = 4000
    sim = simulate(to_block_requests(trace, 512), cap, "lru", 512)
    real = replay(trace, ReplayConfig(block_size=512, num_blocks=cap + 1, max_num_seqs=1,
                                      max_num_batched_tokens=16384))
    assert real.num_finished == len(trace) and real.preemptions == 0
    assert abs(sim.hit_rate - real.token_hit_rate) < 0.005
    assert abs(sim.evictions - real.evicted_blocks) <= 0.001 * real.evicted_blocks


def test_replay_shared_prefix_workload() -> None:
    trace = W.shared_prefix(num_groups=4, prompts_per_group=8, system_len=256, question_len=32,
                            output_len=16)
    res = replay(trace, ReplayConfig(block_size=16, capacity_tokens=64 * 1024, max_num_seqs=8,
                                     max_num_batched_tokens=512))
    assert res.num_finished == 32 and res.num_rejected == 0
    assert 0.6 < res.token_hit_rate < 0.9
    assert res.usage and all(0.0 <= u <= 1.0 for _, u in res.usage)
    assert res.steps > 0 and res.cpu_us_per_step_median > 0
    off = replay(trace, ReplayConfig(block_size=16, capacity_tokens=64 * 1024, max_num_seqs=8,
                                     enable_caching=False))
    assert off.token_hit_rate == 0.0 and off.num_finished == 32


def test_replay_under_memory_pressure_preempts_and_rejects() -> None:
    trace = W.random_prompts(num_requests=20, min_len=100, max_len=500, output_len=100,
                             interval_ms=0.0, seed=1)
    res = replay(trace, ReplayConfig(block_size=16, num_blocks=30, max_num_seqs=8,
                                     max_num_batched_tokens=256))
    assert res.preemptions > 0
    assert res.num_finished + res.num_rejected == 20 and res.num_rejected > 0
    with pytest.raises(InvalidArgumentError):
        replay(trace, ReplayConfig(num_blocks=10, capacity_tokens=100))
    with pytest.raises(InvalidArgumentError):
        replay([], ReplayConfig())


def test_reuse_oracle_order_by_hand() -> None:
    from kvcore.eviction.offline import INFINITE, ReuseOraclePolicy
    from kvcore.sim.policies import make_sim_policy
    from kvcore.types import BlockHash, KVCacheBlock

    blocks = [KVCacheBlock(i) for i in range(1, 6)]
    policy = make_sim_policy("reuse_oracle", blocks)
    assert isinstance(policy, ReuseOraclePolicy)
    taken = policy.pick_victims(5, 1)
    for b in taken:
        b.block_hash = BlockHash(bytes([b.block_id]))
        b.ref_cnt = 0
    # Freed oldest first: 1, 2, 3, 4, 5; blocks 2 and 4 are never needed again.
    for b in taken:
        policy.next_use[b.block_id] = INFINITE if b.block_id in (2, 4) else 10.0 + b.block_id
        policy.on_free((), (b,))
    order = [b.block_id for b in policy.pick_victims(5, 1)]
    assert order == [2, 4, 1, 3, 5]  # never-again first, then least recently freed
