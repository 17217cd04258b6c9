"""vLLM 0.33 manager behaviours in kvcore's core (the integration runs them inside vLLM 0.33;
``tests/integrations/vllm/test_differential_adapter.py`` compares them with vLLM 0.33's own
manager on random traces):

* lookahead block hashes (``num_hash_lookahead_tokens``): a block's hash also covers the tokens
  after it, so it is hashed, cached and hit only once they exist and only when they match;
  events carry those tokens; ``verify_hits`` proves them too;
* a caller's bound on the hit (``get_computed_blocks(request, max_cache_hit_length)``);
* sparse retention under EAGLE keeps the window tail one block below a shared-prefix junction
  (``eagle_junction_tail``; ``False`` is vLLM 0.32's).
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvcore import CacheSettings, KVCacheManager
from kvcore.errors import InvalidArgumentError
from kvcore.events import BlockStored
from kvcore.hashing import BlockHasher, ExtraKeys, hash_extra_keys
from kvcore.manager import lookup_boundary
from kvcore.request import Request, RequestBlockHasher
from kvcore.specs import KVCacheConfig, KVCacheGroup
from kvcore.types import BlockHash, MultiModalItem
from tests.factories import admit, decode, full_spec, make_manager, swa_spec


def _hashes(tokens: Sequence[int], lookahead: int, block_size: int = 4) -> list[BlockHash]:
    return Request("r", list(tokens),
                   block_hasher=RequestBlockHasher(block_size, lookahead=lookahead)).block_hashes


def test_a_block_is_hashed_once_its_lookahead_tokens_exist() -> None:
    assert len(_hashes(range(8), 0)) == 2
    assert len(_hashes(range(8), 1)) == 1  # block 1 needs token 8
    assert len(_hashes(range(9), 1)) == 2
    assert len(_hashes(range(9), 2)) == 1
    assert _hashes(range(3), 1) == []
    r = Request("r", list(range(8)), block_hasher=RequestBlockHasher(4, lookahead=2))
    r.append_output_token_ids(8)
    assert len(r.block_hashes) == 1
    r.append_output_token_ids(9)  # tokens 8 and 9 exist: block 1 is hashed
    assert len(r.block_hashes) == 2


def test_a_lookahead_hash_covers_the_next_tokens_and_only_them() -> None:
    a = _hashes([*range(8), 50, 51], 1)
    b = _hashes([*range(8), 60, 51], 1)  # block 1's next token differs
    c = _hashes([*range(8), 50, 70], 1)  # only a token beyond the lookahead differs
    assert a[0] == b[0] == c[0]  # block 0's next token (4) is the same everywhere
    assert a[1] != b[1] and a[1] == c[1]
    assert _hashes([*range(8), 50], 1)[0] != _hashes([*range(8), 50], 0)[0]


def test_lookahead_extra_keys_cover_the_window_and_end_with_the_next_tokens() -> None:
    r = Request("r", list(range(12)), mm_items=(MultiModalItem("img", 5, 2),),
                cache_salt="s")
    assert hash_extra_keys(r, 0, 4, 0) == (("salt", "s"),)  # the image starts at 5
    assert hash_extra_keys(r, 0, 4, 2) == (("mm", "img", 5), ("salt", "s"), ("next", 4, 5))
    assert hash_extra_keys(r, 8, 12, 0) is None


@pytest.mark.parametrize("bad", [-1, 1.0, True, "1"])
def test_bad_lookahead_is_refused(bad: object) -> None:
    with pytest.raises(InvalidArgumentError, match="lookahead"):
        RequestBlockHasher(4, lookahead=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="num_hash_lookahead_tokens"):
        CacheSettings(num_hash_lookahead_tokens=bad)  # type: ignore[arg-type]


def test_the_manager_caches_a_block_only_once_it_is_hashed() -> None:
    m = make_manager(num_blocks=16, num_hash_lookahead_tokens=1, enable_events=True)
    r = m.make_request("r", list(range(8)))  # a 2-block prompt with lookahead 1: one hash
    assert len(r.block_hashes) == 1
    assert admit(m, r) is not None
    assert [b.block_hash is not None for b in m.get_blocks("r")[0]] == [True, False]
    stored = [e for e in m.take_events() if isinstance(e, BlockStored)]
    assert [e.lookahead_token_ids for e in stored] == [((4,),)]
    decode(m, r, 8)  # token 8 exists: block 1 is hashed and cached with it
    assert [b.block_hash is not None for b in m.get_blocks("r")[0]] == [True, True, False]
    stored = [e for e in m.take_events() if isinstance(e, BlockStored)]
    assert [(e.token_ids, e.lookahead_token_ids) for e in stored] == [((4, 5, 6, 7), ((8,),))]
    m.check_invariants()


def test_a_hit_needs_the_same_lookahead_tokens() -> None:
    m = make_manager(num_blocks=32, num_hash_lookahead_tokens=1)
    a = m.make_request("a", list(range(13)))
    assert admit(m, a) is not None
    m.free(a)
    same = m.make_request("same", [*range(13), 99])
    assert m.get_computed_blocks(same)[1] == 12  # blocks 0-2, token 12 proves block 2
    other = m.make_request("other", [*range(12), 77, 99])
    assert m.get_computed_blocks(other)[1] == 8  # block 2 was cached before token 12, not 77
    m.check_invariants()


class _IgnoresExtraKeys(BlockHasher):
    """Hashes tokens and parent only: equal blocks collide whatever their lookahead tokens."""

    __slots__ = ()

    def hash_block(self, parent: BlockHash | None, token_ids: Sequence[int],
                   extra_keys: ExtraKeys | None = None) -> BlockHash:
        return super().hash_block(parent, token_ids, None)


@pytest.mark.parametrize("verify", [False, True])
def test_verify_hits_proves_the_lookahead_tokens(verify: bool) -> None:
    """A collision that hides different lookahead tokens: served without verification (the
    drafter's KV at the block's end was computed for another next token), refused with it."""
    m = make_manager(num_blocks=32, num_hash_lookahead_tokens=1, verify_hits=verify,
                     block_hasher=_IgnoresExtraKeys())
    a = m.make_request("a", list(range(9)))
    assert admit(m, a) is not None
    m.free(a)
    b = m.make_request("b", [*range(8), 77, 5])
    assert m.get_computed_blocks(b)[1] == (4 if verify else 8)
    m.check_invariants()


def test_a_caller_bounds_the_hit() -> None:
    m = make_manager(num_blocks=32)
    a = m.make_request("a", list(range(20)))
    assert admit(m, a) is not None
    m.free(a)
    b = m.make_request("b", list(range(20)))
    assert m.get_computed_blocks(b)[1] == 16
    assert m.get_computed_blocks(b, 9)[1] == 8
    assert m.get_computed_blocks(b, 100)[1] == 16  # never the last token
    with pytest.raises(InvalidArgumentError, match="max_cache_hit_length"):
        m.get_computed_blocks(b, -1)


def _swa_tail_positions(junction_tail: bool) -> list[int]:
    """Full attention + a window of 8 (blocks of 4), retention 0, EAGLE: ``a`` caches only the
    tails near its own replay boundaries; ``b`` shares a's first 24 tokens, so its lookup finds
    full attention holding more than the window group (the junction at 20); ``b``'s window
    blocks cached after its admission."""
    config = KVCacheConfig(64, (KVCacheGroup(("f",), full_spec(4)),
                                KVCacheGroup(("s",), swa_spec(8))), 0)
    m = KVCacheManager(config, 256, use_eagle=True, eagle_junction_tail=junction_tail)
    a = m.make_request("a", list(range(40)))
    assert m.allocate_slots(a, 40) is not None
    m.free(a)
    b = m.make_request("b", [*range(24), *[99] * 20])
    hit, n = m.get_computed_blocks(b)
    assert (n, lookup_boundary(hit, b)) == (0, 20)
    assert m.allocate_slots(b, b.num_tokens - n, n, hit) is not None
    m.check_invariants()
    return [i for i, blk in enumerate(m.get_blocks("b")[1]) if blk.block_hash is not None]


def test_eagle_retention_keeps_the_tail_below_a_shared_prefix_junction() -> None:
    """vLLM 0.33 also keeps the window tail one block below the junction (block 2, before the
    EAGLE-shifted end at 16), where a sibling that diverges right after the junction hits;
    vLLM 0.32 (``eagle_junction_tail=False``) does not."""
    with_tail = _swa_tail_positions(True)
    without = _swa_tail_positions(False)
    assert set(with_tail) - set(without) == {2}
    assert set(without) <= set(with_tail)


def test_the_shared_prefix_boundary_travels_with_the_hit_and_lookups_change_nothing() -> None:
    """A lookup writes no state: its boundary travels with the hit it returns (an empty hit is
    stamped for a non-zero boundary; the common miss is the shared empty hit), so a later
    lookup of another request (an admission policy's estimate) cannot change what the request
    keeps at admission.  A caller that does not hand the hit back as returned passes the
    boundary itself; the deprecated ``shared_prefix_boundary`` does a lookup of its own."""
    config = KVCacheConfig(64, (KVCacheGroup(("f",), full_spec(4)),
                                KVCacheGroup(("s",), swa_spec(8))), 0)
    m = KVCacheManager(config, 256, use_eagle=True)
    a = m.make_request("a", list(range(40)))
    assert m.allocate_slots(a, 40) is not None
    m.free(a)
    b = m.make_request("b", [*range(24), *[99] * 20])
    hit, n = m.get_computed_blocks(b)
    assert (n, lookup_boundary(hit, b), any(hit)) == (0, 20, False)
    c = m.make_request("c", [7] * 10)
    miss, _ = m.get_computed_blocks(c)  # another request's lookup in between
    assert miss is m.get_computed_blocks(c)[0] and lookup_boundary(miss, c) == 0
    assert lookup_boundary(hit, c) == 0  # (another request's hit carries nothing for c)
    with pytest.warns(DeprecationWarning):
        assert m.shared_prefix_boundary(b) == 20
    assert m.allocate_slots(b, b.num_tokens - n, n, hit) is not None
    assert m.coordinator.shared_prefix_boundaries == {"b": 20}
    d = m.make_request("d", [*range(24), *[98] * 20])
    with pytest.raises(InvalidArgumentError):
        m.allocate_slots(d, d.num_tokens, shared_prefix_boundary=-1)
    assert m.allocate_slots(d, d.num_tokens, shared_prefix_boundary=20) is not None
    assert m.coordinator.shared_prefix_boundaries == {"b": 20, "d": 20}
    m.free(b)
    assert m.coordinator.shared_prefix_boundaries == {"d": 20}
    m.check_invariants()


def test_with_engine_hashes_the_manager_caches_only_what_the_engine_hashed() -> None:
    """``EngineHashes`` (vLLM's engine hashes its requests): the manager never hashes a request,
    and caches the full blocks the request has hashes for — fewer than its full blocks when the
    engine hashed with a longer lookahead than the manager's, as vLLM's own manager does."""
    from kvcore.hashing import EngineHashes

    m = make_manager(num_blocks=16, block_hasher=EngineHashes())
    hashed = Request("r", list(range(12)),
                     block_hasher=RequestBlockHasher(4, lookahead=1))  # blocks 0 and 1
    assert len(hashed.block_hashes) == 2
    r = m.make_request("r", list(range(12)))
    assert r.block_hashes == []  # the manager hashed nothing
    r.block_hashes.extend(hashed.block_hashes)
    assert admit(m, r) is not None
    assert [b.block_hash for b in m.get_blocks("r")[0]] == [*hashed.block_hashes, None]
    assert len(r.block_hashes) == 2
    probe = m.make_request("p", list(range(12)))
    probe.block_hashes.extend(hashed.block_hashes)
    assert m.get_computed_blocks(probe)[1] == 8
    m.check_invariants()
    with pytest.raises(InvalidArgumentError, match="hashes nothing"):
        EngineHashes().hash_block(None, [1, 2, 3, 4])
