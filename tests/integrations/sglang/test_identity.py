"""kvcore's backend with ``lru`` against SGLang's own ``RadixCache``, stepped through the same
random operation traces (requests sharing document prefixes in four namespaces, unaligned
lengths, finishes, evictions) at page sizes 1, 16 and 64."""

from __future__ import annotations

import pytest

from tests.integrations.sglang.helpers import (
    Driver,
    evictable_before,
    make_cache,
    random_ops,
    run,
)

PAGE_SIZES = (1, 16, 64)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("seed", [1, 2])
def test_identical_to_radix_cache_without_pressure(page_size: int, seed: int) -> None:
    """With room for everything: every hit length and the evictable and protected sizes after
    every operation are SGLang's, namespaces included."""
    ops = random_ops(seed, page_size, 200, evictions=False)
    sglang = run(Driver(make_cache("sglang", 2000, page_size)), ops)
    kvcore = run(Driver(make_cache("kvcore:lru", 2000, page_size), deep=False), ops)
    assert len(sglang) == len(kvcore)
    assert sum(s.hit for s in sglang) > 0  # the trace has hits to compare
    assert any(s.protected and s.evictable for s in sglang)
    for i, (a, b) in enumerate(zip(sglang, kvcore)):
        assert a == b, f"step {i} ({ops[i][0]}): SGLang {a}, kvcore {b}"


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_lru_under_pressure_measured(page_size: int) -> None:
    """Under memory pressure the two differ by design, and the test measures by how much.

    SGLang's tree evicts whole leaf nodes (a node holds every page one insert added), so it
    frees at least what was asked and often more; kvcore evicts exactly the pages asked for,
    least recent first.  Measured on this trace (40 pages, 300 operations, seed 2): kvcore's
    total hit is within 5% of SGLang's and never below it (1: 99 vs 86 tokens, 16: 1520 vs 1424,
    64: 6080 vs 5760), because it keeps the pages SGLang's leaf granularity throws away."""
    ops = random_ops(2, page_size, 300, evictions=True)
    sglang = run(Driver(make_cache("sglang", 40, page_size)), ops)
    kvcore = run(Driver(make_cache("kvcore:lru", 40, page_size, check_every=1)), ops)
    asked = [op[1] for op in ops if op[0] == "evict"]
    kv_evictions = [s for s in kvcore if s.op == "evict"]
    sg_evictions = [s for s in sglang if s.op == "evict"]
    assert len(kv_evictions) == len(asked) == len(sg_evictions)
    for n, step, evictable in zip(asked, kv_evictions, evictable_before(kvcore)):
        pages = -(-n // page_size)  # kvcore: exactly the pages asked for, if evictable
        assert step.evicted == min(pages * page_size, evictable), (n, step, evictable)
    overshoot = 0
    for n, step, evictable in zip(asked, sg_evictions, evictable_before(sglang)):
        assert step.evicted >= min(n, evictable)  # SGLang: whole leaves, at least what was asked
        overshoot += step.evicted - min(-(-n // page_size) * page_size, evictable)
    sg_hit, kv_hit = sum(s.hit for s in sglang), sum(s.hit for s in kvcore)
    assert sg_hit > 0
    print(f"page_size {page_size}: hit tokens SGLang {sg_hit}, kvcore {kv_hit}; evicted SGLang "
          f"{sum(s.evicted for s in sglang)}, kvcore {sum(s.evicted for s in kvcore)}; SGLang's "
          f"leaf granularity evicted {overshoot} tokens more than asked on explicit evictions")
    assert kv_hit >= sg_hit * 0.95
