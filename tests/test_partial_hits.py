"""Partial-block hits (``KVCacheConfig.partial_block_hits``, vLLM's partial hash hits).

* the hit search ends on the longest cached hash unit, inside a block, and never on a unit
  whose tokens differ (odd units too: 3 of 12);
* an admission on such a hit copies the shared tail block on write (the request's table holds
  the copy, the copy is a pending block copy whose endpoints stay withheld), and its cached
  blocks stop before the copy;
* a Mamba "align" request that registered its prompt's last hash unit inside its running
  state block hands that entry to a copy (``move_block_hashes``) when it goes on;
* configurations vLLM would not serve partial hits for, and combinations kvcore does not
  implement, are refused by name.
"""

from __future__ import annotations

import pytest
import torch

from kvcore.errors import (
    InvalidArgumentError,
    InvalidHitError,
    InvariantError,
    UnsupportedFeatureError,
)
from kvcore.manager import KVCacheManager, lookup_boundary
from kvcore.request import Request
from kvcore.specs import KVCacheConfig, KVCacheGroup, KVCacheSpec, MambaSpec
from kvcore.testing.checked import checked
from tests.factories import full_spec, swa_spec


def _mamba(block_size: int, checkpoint: bool = False, spec: int = 0) -> MambaSpec:
    return MambaSpec(block_size=block_size, shapes=((2, 4),), dtypes=(torch.float32,),
                     mamba_cache_mode="align", num_prefill_checkpoint_blocks=int(checkpoint),
                     prefill_checkpoint_alignment=1 if checkpoint else None,
                     num_speculative_blocks=spec)


def _config(*specs: KVCacheSpec, unit: int, num_blocks: int = 32,
            partial: bool = True) -> KVCacheConfig:
    return KVCacheConfig(num_blocks, tuple(KVCacheGroup((f"l{i}",), s)
                                           for i, s in enumerate(specs)),
                         prefix_match_unit=unit, partial_block_hits=partial)


def _manager(bs: int = 8, unit: int = 2, **kw: object) -> KVCacheManager:
    return KVCacheManager(_config(full_spec(bs), _mamba(bs), unit=unit), 256, **kw)  # type: ignore[arg-type]  # only bools here


def _producer(m: KVCacheManager, tokens: list[int], upto: int) -> Request:
    """A request computing ``upto`` tokens of ``tokens`` in one chunk (its prompt's last hash
    unit there: the partial tail is registered), then a new step."""
    r = m.make_request("p", tokens)
    assert m.allocate_slots(r, upto) is not None
    r.num_computed_tokens = upto
    m.new_step()
    return r


def test_a_hit_ends_on_the_longest_cached_unit_inside_a_block_and_is_copied_on_write() -> None:
    m = _manager()
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]
    p = _producer(m, prompt, 12)  # the prompt's last unit before its end: 12 (inside block 1)
    shared_full, shared_state = (m.get_blocks("p")[0][1], m.get_blocks("p")[1][1])
    q = m.make_request("q", [*prompt[:12], 99, 98, 97])
    blocks, hit = m.get_computed_blocks(q)
    assert hit == 12  # inside the second block of 8
    assert [b.block_id for b in blocks[0]] == [b.block_id for b in m.get_blocks("p")[0]]
    assert blocks[1][0].is_null and blocks[1][1] is shared_state
    free = m.num_free_blocks
    new = m.allocate_slots(q, 3, hit, blocks)
    assert new is not None
    copies = [g[0] for g in new]  # each group's copy of its shared tail comes first
    table = m.get_blocks("q")
    assert table[0][1] is copies[0] and table[1][1] is copies[1]
    assert m.num_free_blocks == free - 2  # the two copies (the shared blocks were in use)
    # Endpoints withheld until the copies have run; the shared blocks keep the producer's ref.
    assert m.withheld_blocks() == {shared_full.block_id: 1, copies[0].block_id: 1,
                                   shared_state.block_id: 1, copies[1].block_id: 1}
    m.check_invariants()
    pairs, retained = m.take_block_copies()
    assert pairs == [(shared_full, copies[0]), (shared_state, copies[1])]
    m.free_withheld(retained)
    assert shared_full.ref_cnt == 1 and copies[0].ref_cnt == 1
    assert m.coordinator.managers[0].num_cached_block["q"] == 1  # the copy is not cached yet
    m.check_invariants()
    m.free(p)
    m.free(q)
    m.check_invariants()


@pytest.mark.parametrize(("bs", "unit", "shared", "hit"), [
    (8, 2, 11, 10),   # a different 12th token: the unit ending at 12 is not the request's
    (12, 3, 7, 6),    # odd unit: 7 shared tokens hit 6
    (12, 3, 5, 3),
    (12, 4, 9, 8),
])
def test_a_hit_never_covers_a_unit_with_other_tokens(bs: int, unit: int, shared: int,
                                                      hit: int) -> None:
    m = _manager(bs, unit)
    prompt = list(range(1, 2 * bs))
    boundary = (len(prompt) - 1) // unit * unit
    _producer(m, prompt, boundary)
    # Register every unit of the producer's blocks that a hit may land on: a consumer of each
    # length (each registers its own last unit, its state cached at it).
    for n in range(unit, boundary, unit):
        c = m.make_request(f"c{n}", [*prompt[:n], 0])
        blocks, h = m.get_computed_blocks(c)
        assert h <= n
        if h == n:
            continue
        assert m.allocate_slots(c, n - h, h, blocks) is not None  # its chunk ends at n
        c.num_computed_tokens = n
        m.free_withheld(m.take_block_copies()[1])
        m.free(c)
        m.new_step()
    q = m.make_request("q", [*prompt[:shared], 500, 501, 502, 503])
    blocks, got = m.get_computed_blocks(q)
    # The longest unit q shares, never one past its shared tokens.
    assert got == hit
    assert -(-got // bs) == len(blocks[0])


def test_a_running_producer_hands_its_partial_tail_to_a_copy() -> None:
    m = _manager()
    prompt = list(range(1, 14))
    p = _producer(m, prompt, 12)
    pool = m.pool
    state = m.get_blocks("p")[1][1]
    key = p.block_hashes[5]
    assert state.block_hash == key and pool.partial_primary_tokens(state) == 12
    assert m.allocate_slots(p, 1) is not None
    pairs, retained = m.take_block_copies()
    (src, dst), = [pair for pair in pairs if pair[0] is state]
    assert src is state and m.get_blocks("p")[1][1] is state  # the producer keeps writing it
    assert state.block_hash is None and dst.block_hash == key  # the entry moved to the copy
    assert pool.partial_primary_tokens(dst) == 12
    m.free_withheld(retained)
    m.check_invariants()


@pytest.mark.parametrize("fast_path", [True, False])
def test_a_lookup_taken_before_the_producer_moved_its_tail_is_checked_again(
        fast_path: bool) -> None:
    """A hit that get_computed_blocks returned, handed back after its producer's state block
    lost its entry to a copy (and kept being written), is checked again and refused as stale:
    nothing was evicted, but the block no longer holds the looked-up state (found in review:
    the returned hit skipped its check while only evictions and resets were counted)."""
    from kvcore.errors import StaleHitError
    from kvcore.testing.snapshot import manager_snapshot

    m = _manager(fast_path=fast_path)
    prompt = list(range(1, 14))
    p = _producer(m, prompt, 12)
    state = m.get_blocks("p")[1][1]
    q = m.make_request("q", [*prompt[:12], 99, 98, 97])
    blocks, hit = m.get_computed_blocks(q)
    assert hit == 12 and blocks[1][-1] is state
    evicted = m.pool.num_evicted_blocks
    assert m.allocate_slots(p, 1) is not None  # the entry moves to a copy; p writes on in state
    _, ends = m.take_block_copies()
    p.num_computed_tokens = 13
    m.free_withheld(ends)
    m.new_step()
    assert m.pool.num_evicted_blocks == evicted and state.block_hash is None
    before = manager_snapshot(m)
    with pytest.raises(StaleHitError):
        m.allocate_slots(q, 3, hit, blocks)
    assert manager_snapshot(m) == before
    m.check_invariants()
    # Looked up again, q finds the copy that holds the state at 12 tokens.
    blocks, hit = m.get_computed_blocks(q)
    assert hit == 12 and blocks[1][-1] is not state
    assert m.allocate_slots(q, 3, hit, blocks) is not None
    m.check_invariants()


def test_a_forged_partial_state_hit_on_a_full_state_block_is_refused() -> None:
    m = _manager()
    prompt = list(range(1, 20))
    p = m.make_request("p", prompt)
    assert m.allocate_slots(p, 16) is not None  # two full blocks: states at 8 and 16
    p.num_computed_tokens = 16
    m.new_step()
    q = m.make_request("q", [*prompt[:14], 0, 0])
    table = m.get_blocks("p")
    # 10 tokens claimed from the state block of 16: that block holds the state after 16.
    forged = ([table[0][0], table[0][1]], [m.pool.null_block, table[1][1]])
    with pytest.raises(InvalidHitError, match="hit ends inside block"):
        m.allocate_slots(q, 2, 10, forged)
    m.check_invariants()


def test_configurations_without_partial_hits_are_refused_by_name() -> None:
    with pytest.raises(InvalidArgumentError, match="Mamba 'align' group whose blocks are larger"):
        _config(full_spec(8), _mamba(8), unit=8)
    with pytest.raises(InvalidArgumentError, match="only full attention and Mamba"):
        _config(full_spec(8), swa_spec(8, 8), _mamba(8), unit=4)
    with pytest.raises(InvalidArgumentError, match="must be a bool"):
        KVCacheConfig(8, (KVCacheGroup(("a",), full_spec(8)),), partial_block_hits=1)  # type: ignore[arg-type]  # refused at run time
    with pytest.raises(UnsupportedFeatureError, match="verified hits"):
        _manager(verify_hits=True)


def test_off_by_default_hits_stay_on_block_boundaries() -> None:
    m = KVCacheManager(_config(full_spec(8), _mamba(8), unit=2, partial=False), 256)
    prompt = list(range(1, 14))
    _producer(m, prompt, 12)
    _, hit = m.get_computed_blocks(m.make_request("q", [*prompt[:12], 0]))
    assert hit % 8 == 0


def test_the_checked_manager_runs_copies_on_write_in_its_content_oracle() -> None:
    """kvcore.testing.checked with contents tracked: a partial hit's shared tail is copied
    before the step writes, so the copy holds the hit's KV and no wrong KV is reported."""
    m = checked(_manager(), track_contents=True)
    prompt = list(range(1, 14))
    p = m.make_request("p", prompt)
    assert m.allocate_slots(p, 12) is not None
    p.num_computed_tokens = 12
    m.new_step()
    q = m.make_request("q", [*prompt[:12], 7, 7, 7])
    blocks, hit = m.get_computed_blocks(q)
    assert hit == 12
    assert m.allocate_slots(q, 3, hit, blocks) is not None  # checked: no WrongKVError
    q.num_computed_tokens = 15
    assert m.allocate_slots(q, 1) is not None
    m.free_withheld(m.take_block_copies()[1])
    m.free(p)
    m.free(q)


@pytest.mark.parametrize("shared", [True, False])
def test_shared_prefix_checkpoint_keys_the_state_at_the_junction(shared: bool) -> None:
    """A request whose lookup found full attention holding a longer prefix (12 tokens, inside
    a block) than the Mamba state (none) keys its own state there when its chunk ends at that
    junction (mamba_shared_prefix_checkpoint): a sibling then resumes at 12.  Off, it does not."""
    m = _manager(mamba_shared_prefix_checkpoint=shared)
    base = list(range(1, 21))
    c = m.make_request("c", base[:13])
    assert m.allocate_slots(c, 12) is not None  # its prompt's last unit: 12, in both groups
    m.new_step()
    state = m.pool.get_cached_block(c.block_hashes[5], [1])
    assert state is not None
    m.evict_blocks([state[0].block_id])  # the Mamba state at 12 is gone, full attention's stays
    b = m.make_request("b", base)
    blocks, hit = m.get_computed_blocks(b)
    assert hit == 0 and lookup_boundary(blocks, b) == 12
    assert m.allocate_slots(b, 12, hit, blocks) is not None  # a chunk ending at the junction
    b.num_computed_tokens = 12
    m.new_step()
    d = m.make_request("d", [*base[:13], 0, 0])
    _, hit = m.get_computed_blocks(d)
    assert hit == (12 if shared else 0)
    m.check_invariants()


def test_the_invariants_catch_a_copy_on_write_that_left_its_table() -> None:
    m = _manager()
    p = _producer(m, list(range(1, 14)), 12)  # a producer: its copy-on-write is still to make
    mamba = m.coordinator.managers[1]
    assert "p" in mamba.partial_hit_reqs
    m.check_invariants()
    index, source = mamba.partial_hit_reqs["p"]
    mamba.partial_hit_reqs["p"] = (index, m.get_blocks("p")[0][0])  # not the table's block
    with pytest.raises(InvariantError, match=r"\[partial-hit\]"):
        m.check_invariants()
    mamba.partial_hit_reqs["p"] = (index, source)
    m.free(p)
    assert not mamba.partial_hit_reqs
    m.check_invariants()
