"""Block-pool micro-benchmark, identical for kvcore and vLLM (run in a benchmark worker).

Measures ns per block for
  * ``alloc+free``: ``get_new_blocks(B)`` then ``free_blocks`` of the batch, tail first;
  * ``touch``: ``touch(B blocks)`` on free blocks spread through the queue (a prefix hit
    resurrecting cached blocks: each one is unlinked from the middle of the queue), drawn from a
    fixed working set of 512 blocks scattered over the whole pool, so the figure isolates the
    algorithm from cache misses (this is the O(1) evidence);
  * ``touch-cold``: the same, but every touched block is a fresh random one, so at large pools
    each touch misses the CPU caches (block and both queue neighbours): memory latency, not
    algorithm;
  * ``alloc+evict+free-cold``: as alloc+free, but every free block carries a hash and freed
    blocks go to the tail, so allocation cycles through the whole pool and evicts each block from
    the prefix-cache map (the steady state of a full prefix cache; cold at large pools).
at each batch size and pool size.  One sample = one run of ``blocks_per_run`` blocks.

The timed sections are as short as one ``get_new_blocks(1)`` (untimed work sits between them:
hash refills, frees after touches), far too short for the thread CPU clock (a system call of
about 1.5 µs), so this workload keeps wall-clock ``perf_counter_ns`` sections, GC off.  A worker
keeps one pool across requests: the pool is built when a case names a new size and filled with
hashes when the alloc+evict op starts, so every implementation sees the same operation sequence
as long as the driver sends the cases in the same order (it does).  Imports only the
implementation under test.
"""

from __future__ import annotations

import gc
import random
import time
from typing import Any

from .timing import Sample, wall_sample

DEFAULT_POOL_SIZES = "1000,100000,1000000"
DEFAULT_BATCH_SIZES = "1,16,256"
DEFAULT_OPS = "alloc+free,touch,touch-cold,alloc+evict+free-cold"
DEFAULT_BLOCKS_PER_RUN = 65536


def make_pool(impl: str, num_blocks: int) -> Any:
    if impl == "kvcore":
        from kvcore.block_pool import BlockPool

        return BlockPool(num_blocks, enable_caching=True)
    from vllm.v1.core.block_pool import BlockPool as VllmBlockPool

    return VllmBlockPool(num_gpu_blocks=num_blocks, enable_caching=True, hash_block_size=16)


def fill_cache(impl: str, pool: Any) -> None:
    """Give every free block a distinct hash in group 0 (as if a full prefix cache)."""
    blocks = pool.get_new_blocks(len(pool.blocks) - 1)
    if impl == "kvcore":
        cached = pool._maps.cached[0]
        for b in blocks:
            h = b.block_id.to_bytes(16, "little")
            b.block_hash = h
            b.group_id = 0
            cached[h] = b
    else:
        from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

        for b in blocks:
            key = make_block_hash_with_group_id(b.block_id.to_bytes(16, "little"), 0)
            pool._insert_block_hash(key, b, num_tokens=16)
    pool.free_blocks(blocks)


def refill_hashes(impl: str, pool: Any, blocks: list[Any], salt: int) -> None:
    if impl == "kvcore":
        cached = pool._maps.cached[0]
        for b in blocks:
            h = (b.block_id + salt).to_bytes(16, "little")
            b.block_hash = h
            b.group_id = 0
            cached[h] = b
    else:
        from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

        for b in blocks:
            key = make_block_hash_with_group_id((b.block_id + salt).to_bytes(16, "little"), 0)
            pool._insert_block_hash(key, b, num_tokens=16)


def time_alloc_free(pool: Any, batch: int, total: int) -> tuple[int, int]:
    """(elapsed ns, blocks)"""
    get, free = pool.get_new_blocks, pool.free_blocks
    rounds = max(1, total // batch)
    t0 = time.perf_counter_ns()
    for _ in range(rounds):
        blocks = get(batch)
        free(blocks[::-1])
    return time.perf_counter_ns() - t0, rounds * batch


def time_alloc_evict_free(impl: str, pool: Any, batch: int, total: int) -> tuple[int, int]:
    """Each allocation pops hashed blocks (evicting them); the refill of hashes is not timed."""
    get, free = pool.get_new_blocks, pool.free_blocks
    rounds = max(1, total // batch)
    elapsed = 0
    salt = 1 << 40
    for r in range(rounds):
        t0 = time.perf_counter_ns()
        blocks = get(batch)
        elapsed += time.perf_counter_ns() - t0
        refill_hashes(impl, pool, blocks, salt + r * 1_000_003)
        t0 = time.perf_counter_ns()
        free(blocks[::-1])
        elapsed += time.perf_counter_ns() - t0
    return elapsed, rounds * batch


HOT_SET = 512


def time_touch(pool: Any, batch: int, total: int, rng: random.Random,
               cold: bool) -> tuple[int, int]:
    n = len(pool.blocks) - 1
    if cold:
        per_round = min(n, total) // batch * batch
        rounds = 1
    else:
        per_round = min(n, HOT_SET) // batch * batch
        rounds = max(1, total // per_round)
    elapsed = 0
    touch, free = pool.touch, pool.free_blocks
    hot = rng.sample(range(1, n + 1), per_round)
    for _ in range(rounds):
        ids = rng.sample(range(1, n + 1), per_round) if cold else hot
        blocks = [pool.blocks[i] for i in ids]
        batches = [blocks[i:i + batch] for i in range(0, per_round, batch)]
        t0 = time.perf_counter_ns()
        for b in batches:
            touch(b)
        elapsed += time.perf_counter_ns() - t0
        for b in batches:
            free(b)
    return elapsed, rounds * per_round


def _csv(params: dict[str, Any], key: str, default: str) -> list[str]:
    return [x for x in str(params.get(key, default)).split(",") if x]


def cases(impl: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for size in (int(x) for x in _csv(params, "pool_sizes", DEFAULT_POOL_SIZES)):
        for op in _csv(params, "ops", DEFAULT_OPS):
            for batch in (int(x) for x in _csv(params, "batch_sizes", DEFAULT_BATCH_SIZES)):
                if batch <= size - 1:
                    out.append({"name": f"{op} | {size} blocks | batch {batch}", "op": op,
                                "pool_size": size, "batch": batch})
    return out


_state: dict[str, Any] = {}
"""This worker's pool: ``size``, ``pool``, ``op`` (the op it was last set up for), ``rng``."""


def _pool_for(impl: str, size: int, op: str) -> Any:
    if _state.get("size") != size:
        _state.pop("pool", None)
        gc.unfreeze()
        gc.collect()
        pool = make_pool(impl, size)
        gc.collect()
        gc.freeze()  # later collections need not walk the pool's blocks
        _state.update(size=size, pool=pool, op=None)
        _state.setdefault("rng", random.Random(0))
    pool = _state["pool"]
    if _state["op"] != op:
        if op == "alloc+evict+free-cold":
            fill_cache(impl, pool)
        _state["op"] = op
    return pool


def measure(impl: str, case: str, params: dict[str, Any], repeat: int,
            warmup: bool = False) -> Sample:
    by_name = {c["name"]: c for c in cases(impl, params)}
    if case not in by_name:
        raise KeyError(f"unknown pool case {case!r}")
    c = by_name[case]
    op, batch = c["op"], c["batch"]
    total = int(params.get("blocks_per_run", DEFAULT_BLOCKS_PER_RUN))
    pool = _pool_for(impl, c["pool_size"], op)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        if op == "alloc+free":
            ns, blocks = time_alloc_free(pool, batch, total)
        elif op in ("touch", "touch-cold"):
            ns, blocks = time_touch(pool, batch, total, _state["rng"], cold=op == "touch-cold")
        elif op == "alloc+evict+free-cold":
            ns, blocks = time_alloc_evict_free(impl, pool, batch, total)
        else:
            raise KeyError(f"unknown pool op {op!r}")
    finally:
        if was_enabled:
            gc.enable()
    return wall_sample(ns, blocks)
