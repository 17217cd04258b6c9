"""The simulator's eviction policies against libCacheSim (the ``libcachesim`` package).

:func:`~kvcore.sim.policies.simulate_accesses` runs a plain block-level cache (one block per
access) with the same policy objects the pool uses; libCacheSim runs its own implementations over
the same keys with unit-size objects, so ``cache_size`` is a capacity in blocks.

* ``lru``, ``fifo`` and ``belady`` are the classic algorithms: the per-access hit/miss sequences
  must be identical.  libCacheSim's Belady admits every missed object (no bypass), like kvcore's,
  and reads each request's ``next_access_vtime`` (set here; INT64_MAX for "never again").
* ``s3fifo``, ``slru`` and ``arc`` are adapted to a pool whose hit blocks leave the free side while in use
  and re-enter at the tail of their segment when freed, so only their miss ratios are compared
  (tolerances below), and on the skewed traces they must beat LRU wherever libCacheSim's do: a
  kvcore S3-FIFO or SLRU that degenerated to FIFO or LRU fails.

Inputs that abort libCacheSim's process (S3-FIFO under 20 objects, a next access time of -1) are
avoided.  ``hashpower=16`` keeps libCacheSim from allocating a 2**24-bucket table per cache
(up to 0.2 s each); the table only chains more, results are identical.
"""

from __future__ import annotations

import random
from functools import cache
from typing import Any

import pytest

from kvcore.sim.policies import simulate_accesses

lcs = pytest.importorskip("libcachesim")

NUM_ACCESSES = 20_000
NUM_KEYS = 2_000
# name -> (Zipf exponent, seed); exponent 0 is uniform.
TRACES = {"zipf0.8": (0.8, 1), "zipf1.0": (1.0, 42), "zipf1.2": (1.2, 2), "uniform": (0.0, 3)}
SKEWED = [name for name, (alpha, _) in TRACES.items() if alpha > 0]
CAPACITIES = (20, 50, 200, 800)  # libCacheSim's S3-FIFO caches nothing below 20 objects
HASHPOWER = 16
INT64_MAX = 2**63 - 1

# Miss-ratio tolerances (absolute, as a fraction of accesses), measured on a wider sweep: Zipf
# exponents 0.6/0.8/1.0/1.2/1.4 with 3 seeds each plus 3 uniform traces, capacities 20, 30, 50,
# 100, 200, 400, 800 and 1500 (168 cells, 20k accesses over 2000 keys).
# * S3-FIFO: |kvcore - libCacheSim| was at most 0.89 points (Zipf 0.6, capacity 400, kvcore the
#   lower); the in-use adaptation (a hit block rejoins the tail of its FIFO) and libCacheSim's
#   warm-up rule (inserting into main before the first eviction) move single decisions, not the
#   algorithm.  1.5 points leaves margin yet is below S3-FIFO's lead over FIFO (2-14 points on
#   the skewed cells here) and over LRU (1.5-12 points, except 0.3 at Zipf 1.2 / capacity 800,
#   close to the compulsory misses), where the beat-LRU check takes over.
# * 2-segment SLRU without ghost: at most 0.125 points; libCacheSim differs only in capping
#   probation at half the cache and evicting when a hit cools probation.  0.5 points.
# The differences have no systematic sign: their mean over one trace's capacities was between
# -0.24 and +0.02 points for S3-FIFO and between -0.05 and 0 for SLRU (kvcore a little lower).
# A bias bound on the mean over the skewed cells catches a subtler break than the per-cell
# bound: an S3-FIFO that ignores hits (only its ghost table left) is 1.5-2.4 points worse in
# every skewed cell, which some cells' 1.5-point bound alone lets through.
# * ARC: at most 0.10 points on 30 cells (Zipf 0.6-1.4 and uniform, capacities 20-1500); the
#   pool learns a hash when its block is first freed, so ghost hits and ARC's tie-break on a B2
#   hit move single decisions.  An ARC whose target never adapts (stuck at 0) is off by up to
#   1.0 point and by -0.5 on average over the skewed cells, which the bias bound catches.
S3FIFO_TOLERANCE, S3FIFO_BIAS = 0.015, 0.005
SLRU_TOLERANCE, SLRU_BIAS = 0.005, 0.001
ARC_TOLERANCE, ARC_BIAS = 0.003, 0.001

# kvcore spec -> libCacheSim cache factory, configured as alike as the two allow.  kvcore's
# S3-FIFO promotes a small-FIFO block hit once (move_to_main_threshold=1), both cap frequency at
# 3, small share 10%, ghost of one capacity's worth of evicted keys.  kvcore's SLRU with
# protected_share=0.5 and no ghost corresponds to libCacheSim's SLRU with two equal segments.
EXACT = ("lru", "fifo", "belady")
ADAPTED = {
    "s3fifo": ("s3fifo:small_share=0.1,ghost_factor=1", S3FIFO_TOLERANCE, S3FIFO_BIAS),
    "slru": ("slru:protected_share=0.5,ghost_factor=0", SLRU_TOLERANCE, SLRU_BIAS),
    "arc": ("arc", ARC_TOLERANCE, ARC_BIAS),
}


def _lcs_cache(policy: str, capacity: int) -> Any:
    if policy == "lru":
        return lcs.LRU(capacity, hashpower=HASHPOWER)
    if policy == "fifo":
        return lcs.FIFO(capacity, hashpower=HASHPOWER)
    if policy == "belady":
        return lcs.Belady(capacity, hashpower=HASHPOWER)
    if policy == "s3fifo":
        return lcs.S3FIFO(capacity, hashpower=HASHPOWER, small_size_ratio=0.1,
                          ghost_size_ratio=1.0, move_to_main_threshold=1)
    if policy == "arc":
        return lcs.ARC(capacity, hashpower=HASHPOWER)
    if policy == "slru":
        # The SLRU wrapper class fixes 4 segments; the segment count goes through the C init.
        params = lcs.libcachesim_python.CommonCacheParams(
            cache_size=capacity, default_ttl=86400 * 300, hashpower=HASHPOWER,
            consider_obj_metadata=False)
        return lcs.CacheBase(_cache=lcs.libcachesim_python.SLRU_init(params, "n-seg=2"))
    raise AssertionError(policy)


@cache
def trace(name: str) -> tuple[int, ...]:
    """``NUM_ACCESSES`` keys, Zipf-distributed over ``NUM_KEYS`` ids in a random rank order."""
    alpha, seed = TRACES[name]
    rng = random.Random(seed)
    ids = list(range(1, NUM_KEYS + 1))
    rng.shuffle(ids)
    weights = [1.0 / rank**alpha for rank in range(1, NUM_KEYS + 1)]
    return tuple(rng.choices(ids, weights=weights, k=NUM_ACCESSES))


def next_access_times(keys: tuple[int, ...]) -> list[int]:
    """Per access, the index of the next access to the same key (INT64_MAX if none)."""
    out = [INT64_MAX] * len(keys)
    later: dict[int, int] = {}
    for i in range(len(keys) - 1, -1, -1):
        out[i] = later.get(keys[i], INT64_MAX)
        later[keys[i]] = i
    return out


@cache
def lcs_hits(policy: str, trace_name: str, capacity: int) -> tuple[bool, ...]:
    keys = trace(trace_name)
    cache_ = _lcs_cache(policy, capacity)
    nxt = next_access_times(keys) if policy == "belady" else None
    req = lcs.Request()
    req.obj_size = 1
    hits: list[bool] = []
    for i, key in enumerate(keys):
        req.obj_id = key
        if nxt is not None:
            req.next_access_vtime = nxt[i]
        hits.append(bool(cache_.get(req)))
    return tuple(hits)


@cache
def kvcore_hits(spec: str, trace_name: str, capacity: int) -> tuple[bool, ...]:
    return tuple(simulate_accesses(trace(trace_name), capacity, spec))


def miss_ratio(hits: tuple[bool, ...]) -> float:
    return hits.count(False) / len(hits)


@pytest.mark.parametrize("capacity", CAPACITIES)
@pytest.mark.parametrize("trace_name", TRACES)
@pytest.mark.parametrize("policy", EXACT)
def test_classic_policies_match_per_access(policy: str, trace_name: str, capacity: int) -> None:
    ours = kvcore_hits(policy, trace_name, capacity)
    theirs = lcs_hits(policy, trace_name, capacity)
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    assert first is None, (
        f"{policy} at capacity {capacity} on {trace_name}: access {first} (key "
        f"{trace(trace_name)[first]}) is a {'hit' if ours[first] else 'miss'} in kvcore, not in "
        f"libCacheSim; misses {ours.count(False)} vs {theirs.count(False)}")
    assert len(ours) == len(theirs) == NUM_ACCESSES


@pytest.mark.parametrize("capacity", CAPACITIES)
@pytest.mark.parametrize("trace_name", TRACES)
@pytest.mark.parametrize("policy", ADAPTED)
def test_adapted_policies_miss_ratio_close(policy: str, trace_name: str, capacity: int) -> None:
    spec, tolerance, _ = ADAPTED[policy]
    ours = miss_ratio(kvcore_hits(spec, trace_name, capacity))
    theirs = miss_ratio(lcs_hits(policy, trace_name, capacity))
    assert abs(ours - theirs) <= tolerance, (
        f"{spec} at capacity {capacity} on {trace_name}: miss ratio {ours:.4f}, libCacheSim "
        f"{theirs:.4f}")


@pytest.mark.parametrize("capacity", CAPACITIES)
@pytest.mark.parametrize("trace_name", SKEWED)
@pytest.mark.parametrize("policy", ADAPTED)
def test_adapted_policies_beat_lru_where_libcachesim_does(policy: str, trace_name: str,
                                                          capacity: int) -> None:
    spec, _, _ = ADAPTED[policy]
    lru = lcs_hits("lru", trace_name, capacity).count(False)
    theirs = lcs_hits(policy, trace_name, capacity).count(False)
    ours = kvcore_hits(spec, trace_name, capacity).count(False)
    assert theirs < lru, f"libCacheSim's {policy} no longer beats LRU here: pick another cell"
    assert ours < lru, (
        f"{spec} at capacity {capacity} on {trace_name}: {ours} misses, LRU {lru}, "
        f"libCacheSim's {policy} {theirs}")


@pytest.mark.parametrize("policy", ADAPTED)
def test_adapted_policies_no_systematic_bias(policy: str) -> None:
    spec, _, bias = ADAPTED[policy]
    diffs = [miss_ratio(kvcore_hits(spec, name, capacity))
             - miss_ratio(lcs_hits(policy, name, capacity))
             for name in SKEWED for capacity in CAPACITIES]
    mean = sum(diffs) / len(diffs)
    assert abs(mean) <= bias, (
        f"{spec}: miss ratio differs from libCacheSim's by {mean:+.4f} on average over the skewed "
        f"traces (per cell: {', '.join(f'{d:+.4f}' for d in diffs)})")
