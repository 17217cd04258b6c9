"""Whole-state snapshots, for "a failed call changes nothing" checks.

Each snapshot is a nested tuple of everything observable: comparing two snapshots with ``==``
tells whether anything changed in between (objects such as prefix nodes and requests compare by
identity).  They are O(pool size): fine after every operation of a test, not in production.
"""

from __future__ import annotations

from dataclasses import astuple

from kvcore.block_pool import BlockPool
from kvcore.manager import KVCacheManager
from kvcore.scheduler import Scheduler


def pool_snapshot(pool: BlockPool) -> tuple[object, ...]:
    """Everything observable about a pool: the policy's order and segments, every block's
    fields and links (prefix nodes by identity), every map entry in order (duplicates
    included), the hint reserve and declared hints, pending events and counters."""
    blocks = tuple((b.block_id, b.ref_cnt, b.block_hash, b.group_id, b.prefix_node, b.free_stamp,
                    b.policy_segment, b.policy_mark, b.policy_tag, b.policy_tail,
                    None if b.prev_free is None else b.prev_free.block_id,
                    None if b.next_free is None else b.next_free.block_id) for b in pool.blocks)
    maps = tuple(tuple((h, b.block_id) for h, b in pool.iter_cached(g))
                 for g in range(pool.num_groups))
    # Partial entries: how many tokens a block's partial hash covers (None: a full block's).
    partial = tuple(pool.partial_primary_tokens(b) for b in pool.blocks)
    policy = pool.policy
    segments = tuple(tuple(b.block_id for b in q) for q in policy.queues())
    return (tuple(b.block_id for b in policy), len(policy), segments, policy.check(), blocks,
            maps, partial, tuple(b.block_id for b in pool.reserve), pool.hints, (pool.events.pending if pool.events is not None else ()),
            pool.num_evicted_blocks, pool.num_rejected_hits)


def manager_snapshot(manager: KVCacheManager) -> tuple[object, ...]:
    """Pool snapshot plus every request's block tables, cached watermarks and slots, the tracked
    request objects (by identity), verify-mode prefix chains, Mamba step state, the blocks
    deferred frees withheld and stats."""
    coord = manager.coordinator
    tables = tuple(
        tuple(sorted((rid, tuple(b.block_id for b in blocks))
                     for rid, blocks in m.req_to_blocks.items()))
        for m in coord.managers)
    cached = tuple(tuple(sorted(m.num_cached_block.items())) for m in coord.managers)
    mamba = tuple(m.step_state() for m in coord.managers)
    # Partial hits' copies-on-write still to make (producers' partial tails included).  (Block
    # copies recorded and not taken are left out: an outside holder may append to them.)
    partial = tuple(tuple(sorted((rid, i, b.block_id) for rid, (i, b) in
                                 m.partial_hit_reqs.items())) for m in coord.managers)
    chains: tuple[object, ...] = ()
    if coord.prefix_chains is not None:
        chains = tuple(sorted(
            (rid, bs, chain.base, tuple(chain.tail))
            for rid, per_size in coord.prefix_chains._chains.items()
            for bs, chain in per_size.items()))
    stats = manager.prefix_cache_stats
    boundaries = tuple(sorted(coord.shared_prefix_boundaries.items()))
    return (pool_snapshot(coord.pool), tables, cached, mamba, partial, chains, boundaries,
            tuple(sorted((rid, id(t[0]), t[1])
                         for rid, t in manager._requests.items())),
            tuple(sorted(manager.withheld_blocks().items())),
            None if stats is None else astuple(stats))


def scheduler_snapshot(scheduler: Scheduler) -> tuple[object, ...]:
    """Manager snapshot plus the scheduler's queues, request table, stats and every known
    request's progress."""
    reqs = tuple(sorted(
        (rid, r.status.value, r.num_computed_tokens, tuple(r.all_token_ids), r.num_preemptions,
         r.num_cached_tokens) for rid, r in scheduler.requests.items()))
    return (manager_snapshot(scheduler.kv), tuple(r.request_id for r in scheduler.waiting),
            tuple(r.request_id for r in scheduler.running), reqs, astuple(scheduler.stats),
            tuple(scheduler._finished_ids))
