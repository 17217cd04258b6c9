"""Block-pool micro-benchmark, identical for kvcore and vLLM (``--impl kvcore|vllm``).

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
at each batch size and pool size.  Each figure is the median of ``--repeats`` runs.
Prints JSON to stdout.  Imports only the implementation under test.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from typing import Any


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
        cached = pool._cached[0]
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
        cached = pool._cached[0]
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


def time_alloc_free(pool: Any, batch: int, total: int) -> float:
    get, free = pool.get_new_blocks, pool.free_blocks
    rounds = max(1, total // batch)
    t0 = time.perf_counter_ns()
    for _ in range(rounds):
        blocks = get(batch)
        free(blocks[::-1])
    return (time.perf_counter_ns() - t0) / (rounds * batch)


def time_alloc_evict_free(impl: str, pool: Any, batch: int, total: int) -> float:
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
    return elapsed / (rounds * batch)


HOT_SET = 512


def time_touch(pool: Any, batch: int, total: int, rng: random.Random, cold: bool) -> float:
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
    return elapsed / (rounds * per_round)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=["kvcore", "vllm"], required=True)
    ap.add_argument("--pool-sizes", default="1000,100000,1000000")
    ap.add_argument("--batch-sizes", default="1,16,256")
    ap.add_argument("--ops", default="alloc+free,touch,touch-cold,alloc+evict+free-cold")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--blocks-per-run", type=int, default=65536)
    args = ap.parse_args()
    rng = random.Random(0)
    out = []
    ops = args.ops.split(",")
    for size in (int(x) for x in args.pool_sizes.split(",")):
        pool = make_pool(args.impl, size)
        gc.collect()
        gc.disable()
        for op in ops:
            if op == "alloc+evict+free-cold":
                fill_cache(args.impl, pool)
            for batch in (int(x) for x in args.batch_sizes.split(",")):
                if batch > size - 1:
                    continue
                samples = []
                for _ in range(args.repeats):
                    if op == "alloc+free":
                        samples.append(time_alloc_free(pool, batch, args.blocks_per_run))
                    elif op in ("touch", "touch-cold"):
                        samples.append(time_touch(pool, batch, args.blocks_per_run, rng,
                                                  cold=op == "touch-cold"))
                    else:
                        samples.append(time_alloc_evict_free(args.impl, pool, batch,
                                                             args.blocks_per_run))
                out.append({"op": op, "pool_size": size, "batch": batch,
                            "ns_per_block": statistics.median(samples),
                            "samples": samples})
        gc.enable()
        del pool
    print(json.dumps(out))


if __name__ == "__main__":
    main()
