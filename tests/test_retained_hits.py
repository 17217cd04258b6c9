"""``KVCacheManager.retain_longer_hits``: a retained full-attention group's lookup keeps its own
longer hit, and an admission adopts as much of it as the local and external tokens cover, its
invariants checked (vLLM's ``retains_longer_hit`` / ``retained_hit_group_ids``; compared with
vLLM's own manager in tests/integrations/vllm/test_contract.py)."""

from __future__ import annotations

import pytest

from kvcore.errors import InvalidHitError
from kvcore.manager import KVCacheManager
from tests.factories import full_spec, ids, make_manager, make_request, swa_spec


def _world(retain: bool) -> tuple[KVCacheManager, list[int]]:
    """Request 'a' (16 tokens, 4 blocks of 4) cached and freed, then the sliding window's block
    at tokens 12..15 evicted: full attention hits 16 tokens, the window only 12."""
    m = make_manager(full_spec(), swa_spec(8), num_blocks=32)
    if retain:
        m.retain_longer_hits([0])
    a = make_request("a", range(16))
    m.allocate_slots(a, 16)
    a.num_computed_tokens = 16
    m.cache_blocks(a, 16)
    fa, window = (ids(g) for g in m.coordinator.get_blocks("a"))
    m.free(a)
    m.evict_blocks([window[3]])
    return m, fa


@pytest.mark.parametrize("retain", [False, True])
def test_a_retained_group_keeps_its_longer_hit_in_the_lookup(retain: bool) -> None:
    m, fa = _world(retain)
    b = make_request("b", [*range(16), 90, 91, 92, 93, 94])
    hit, n = m.get_computed_blocks(b)
    assert n == 12
    assert ids(hit[0]) == fa[:4 if retain else 3]
    assert m.retained_hit_groups == (frozenset({0}) if retain else frozenset())


@pytest.mark.parametrize(("external", "reused"), [(0, False), (4, True)])
def test_an_admission_adopts_the_retained_blocks_its_tokens_cover(external: int,
                                                                  reused: bool) -> None:
    m, fa = _world(True)
    b = make_request("b", [*range(16), 90, 91, 92, 93, 94])
    hit, n = m.get_computed_blocks(b)
    assert m.allocate_slots(b, b.num_tokens - n - external, n, hit,
                            num_external_computed_tokens=external) is not None
    table = ids(m.coordinator.get_blocks("b")[0])
    assert (table[3] == fa[3]) is reused  # the resident block stands for the external tokens
    assert table[:3] == fa[:3]
    m.check_invariants()


def test_an_unretained_group_still_refuses_a_longer_hit() -> None:
    m, _ = _world(True)
    b = make_request("b", [*range(16), 90, 91, 92, 93, 94])
    hit, n = m.get_computed_blocks(b)
    m.retain_longer_hits([])  # the hit was looked up retained; the allocation is not
    with pytest.raises(InvalidHitError, match="group 0 has 4 hit blocks"):
        m.allocate_slots(b, b.num_tokens - n - 4, n, tuple(list(g) for g in hit),
                         num_external_computed_tokens=4)
    m.check_invariants()
