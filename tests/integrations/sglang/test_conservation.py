"""Under memory pressure, for every kvcore pool policy: SGLang's leak check holds after every
operation (its allocator's free tokens + evictable + protected = total), no page is free twice
in SGLang's allocator, no page is both free there and cached, and kvcore's pool invariants and
the backend's accounting hold (``sanity_check`` after every cache call)."""

from __future__ import annotations

import pytest
from sglang.srt.mem_cache.base_prefix_cache import EvictParams

from kvcore.eviction import REGISTRY
from tests.integrations.sglang.helpers import Driver, make_cache, random_ops, run

POLICIES = REGISTRY.names(offline=False)


def test_every_pool_policy_is_covered() -> None:
    assert {"lru", "slru", "s3fifo", "arc", "learned"} <= set(POLICIES)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("policy", POLICIES)
def test_conservation_under_pressure(policy: str, page_size: int) -> None:
    driver = Driver(make_cache(f"kvcore:{policy}", 24, page_size, check_every=1,
                               verify_hits=True))
    steps = run(driver, random_ops(7, page_size, 160))  # checks after every step
    assert sum(s.evicted for s in steps) > 0  # the pool was under pressure
    assert sum(s.hit for s in steps) > 0
    assert driver.cache.num_evicted_pages * page_size >= sum(s.evicted for s in steps)
    for rid in list(driver.running):
        driver.finish(rid)
    cache = driver.cache
    assert cache.protected_size() == 0
    cache.evict(EvictParams(num_tokens=10**9))
    assert cache.evictable_size() == 0 and cache.total_size() == 0
    assert driver.allocator.available_size() == driver.total  # every slot came back, once
