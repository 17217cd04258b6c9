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


def test_verify_hits_rejects_a_page_of_another_prefix() -> None:
    """With ``verify_hits``, a page whose stored tokens are not the looked-up ones (what a digest
    collision would look like) ends the match there and is counted; the pages before it hit."""
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    for verify in (False, True):
        driver = Driver(make_cache("kvcore:lru", 32, 4, verify_hits=verify))
        tokens = list(range(1, 17))
        driver.admit(0, tokens, (None, None))
        cache = driver.cache
        third = cache.pool.blocks[driver.running[0].block_ids[2]]
        record = cache._pages[third.block_id]
        record.tokens = (99, 99, 99, 99)  # the page now claims another prefix's tokens
        hit = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens)))).device_prefix_len
        assert (hit, cache.num_rejected_hits) == ((8, 1) if verify else (16, 0))
