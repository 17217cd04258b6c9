"""Block copies and their retained endpoints (vLLM's copy-on-write hand-off).

* ``withhold_new_blocks`` takes fresh blocks for a holder outside the requests, withheld until
  ``free_withheld``; asking for more than are free raises and changes nothing;
* ``take_block_copies`` drains every group's ``pending_copies`` and hands over the endpoints'
  withheld references as the copies' retention; a pair it cannot honour raises and changes
  nothing.
"""

from __future__ import annotations

import pytest

from kvcore.errors import BlockStateError, InvalidArgumentError, NoFreeBlocksError
from tests.factories import admit, full_spec, make_manager, manager_snapshot


def test_new_blocks_are_withheld_until_returned_and_evict_what_they_reuse() -> None:
    m = make_manager(num_blocks=8)
    r = m.make_request("r", list(range(9)))
    admit(m, r)
    m.free(r)  # two cached blocks and one uncached go back to the free side
    free = m.num_free_blocks
    taken = m.withhold_new_blocks(free)
    assert len({b.block_id for b in taken}) == free and m.num_free_blocks == 0
    assert all(b.ref_cnt == 1 and b.block_hash is None for b in taken)
    assert m.withheld_blocks() == {b.block_id: 1 for b in taken}
    assert m.pool.num_cached_blocks() == 0  # the cached ones were evicted to be reused
    m.check_invariants()
    m.free_withheld(reversed(taken))
    assert m.num_free_blocks == free and m.num_withheld_blocks == 0
    m.check_invariants()


@pytest.mark.parametrize("bad", [-1, 1.0, True, None])
def test_new_blocks_refuse_a_bad_count_or_too_many_changing_nothing(bad: object) -> None:
    m = make_manager(num_blocks=8)
    admit(m, m.make_request("r", list(range(9))))
    snap = manager_snapshot(m)
    with pytest.raises(NoFreeBlocksError, match="5 blocks asked for, only 4"):
        m.withhold_new_blocks(5)
    with pytest.raises(InvalidArgumentError):
        m.withhold_new_blocks(bad)  # type: ignore[arg-type]  # refused at run time
    assert manager_snapshot(m) == snap and m.num_withheld_blocks == 0
    m.check_invariants()


def test_pending_copies_leave_with_their_endpoints_retained_until_returned() -> None:
    m = make_manager(full_spec(4), full_spec(4), num_blocks=16)
    src, dst, other = m.withhold_new_blocks(3)
    m.coordinator.managers[1].pending_copies.append((src, dst))
    m.coordinator.managers[0].pending_copies.append((other, src))
    m.withhold([src])  # src is the endpoint of two copies: two references
    pairs, retained = m.take_block_copies()
    assert pairs == [(other, src), (src, dst)]  # group after group
    assert retained == [other, src, src, dst]
    assert all(not mgr.pending_copies for mgr in m.coordinator.managers)
    assert m.take_block_copies() == ([], [])
    m.free_withheld(retained)
    assert m.num_withheld_blocks == 0 and m.num_free_blocks == 15
    m.check_invariants()


def test_a_pending_copy_without_retained_endpoints_is_refused_changing_nothing() -> None:
    m = make_manager(num_blocks=16)
    r = m.make_request("r", list(range(9)))
    admit(m, r)
    held = m.withhold_new_blocks(1)[0]
    in_table = m.get_blocks("r")[0][0]  # referenced by the request only, not withheld
    pending = m.coordinator.managers[0].pending_copies
    pending.append((held, in_table))
    snap = manager_snapshot(m)
    with pytest.raises(BlockStateError, match="withheld 0 time"):
        m.take_block_copies()
    assert pending == [(held, in_table)] and manager_snapshot(m) == snap
    pending[:] = [(held, make_manager(num_blocks=16).pool.blocks[2])]
    with pytest.raises(BlockStateError, match="not a \\(source, destination\\) pair"):
        m.take_block_copies()
    pending[:] = [(held, held)]  # one withheld reference, two retentions
    with pytest.raises(BlockStateError, match="retained by 2 pending copies"):
        m.take_block_copies()
    pending.clear()
    m.free_withheld([held])
    m.check_invariants()


def test_the_invariants_see_a_pending_copy_whose_endpoint_is_not_withheld() -> None:
    from kvcore.errors import InvariantError

    m = make_manager(num_blocks=16)
    r = m.make_request("r", list(range(9)))
    admit(m, r)
    src, dst = m.withhold_new_blocks(2)
    m.coordinator.managers[0].pending_copies.append((src, dst))
    m.check_invariants()
    m.coordinator.managers[0].pending_copies.append((m.get_blocks("r")[0][0], dst))
    with pytest.raises(InvariantError, match="pending-copy"):
        m.check_invariants()
    m.coordinator.managers[0].pending_copies[1:] = [("src", dst)]  # type: ignore[list-item]
    with pytest.raises(InvariantError, match="not a \\(source, destination\\) pair"):
        m.check_invariants()
