"""vLLM 0.32 manager behaviours kvcore's core adopted for running inside vLLM's scheduler (the
integration in kvcore.integrations.vllm relies on each; its own tests run in the full vLLM venv).

* ``free`` leaves a block list a caller got from ``get_blocks`` in order;
* ``BlockStored`` carries the request's LoRA int id (``lora_id``);
* ``allocate_slots(reserved_blocks=...)`` keeps blocks free for requests in flight;
* blocks leave a window only up to the computed tokens not in flight (``num_in_flight_tokens``);
* ``report_prefix_hit`` records vLLM's ``kv_cache_report_mode="full"`` events;
* deferred frees: ``pop_blocks_for_free`` withholds a request's blocks, ``free_withheld``
  returns them.
"""

from __future__ import annotations

import pytest

from kvcore import KVCacheManager, Request
from kvcore.errors import BlockStateError, InvalidArgumentError
from kvcore.events import BlockStored
from kvcore.specs import FullAttentionSpec, KVCacheConfig, KVCacheGroup, SlidingWindowSpec
from tests.factories import admit, decode, full_spec, make_manager, manager_snapshot, swa_spec


def test_free_leaves_a_block_list_from_get_blocks_in_order() -> None:
    m = make_manager(num_blocks=16)
    r = m.make_request("r", list(range(10)))
    admit(m, r)
    held = m.get_blocks("r")[0]
    before = [b.block_id for b in held]
    assert before == [1, 2, 3]
    m.free(r)
    assert [b.block_id for b in held] == before  # not reversed in place
    # ... while the pool still frees tail first: the prefix is evicted last (the unhashed
    # partial block 3 is reused first).
    order = [b.block_id for b in m.pool.policy]
    assert order[0] == 3 and order[-2:] == [2, 1]
    m.check_invariants()


def test_block_stored_carries_the_lora_int_id() -> None:
    m = make_manager(num_blocks=16, enable_events=True)
    r = m.make_request("r", list(range(9)), lora_name="adapter-a", lora_id=7)
    admit(m, r)
    stored = [e for e in m.take_events() if isinstance(e, BlockStored)]
    assert stored and all((e.lora_id, e.lora_name) == (7, "adapter-a") for e in stored)
    plain = m.make_request("p", list(range(20, 29)))
    admit(m, plain)
    assert all(e.lora_id is None for e in m.take_events() if isinstance(e, BlockStored))


@pytest.mark.parametrize("bad", [0, -1, "7", 1.0, True])
def test_lora_id_must_be_a_positive_int(bad: object) -> None:
    with pytest.raises(InvalidArgumentError, match="lora_id"):
        Request("r", [1, 2, 3], lora_id=bad)


def test_reserved_blocks_stay_free_and_a_refusal_changes_nothing() -> None:
    m = make_manager(num_blocks=9)  # 8 usable blocks
    a = m.make_request("a", list(range(16)))
    assert m.allocate_slots(a, 16) is not None  # 4 blocks, 4 free
    b = m.make_request("b", list(range(100, 116)))
    snap = manager_snapshot(m)
    assert m.allocate_slots(b, 16, reserved_blocks=1) is None  # would leave 0 of 1 reserved
    assert manager_snapshot(m) == snap
    # full_sequence_must_fit counts the whole prompt against the free blocks, not the reserve
    # (vLLM's order): it passes, the reserve then refuses.
    assert m.allocate_slots(b, 8, full_sequence_must_fit=True, reserved_blocks=3) is None
    assert manager_snapshot(m) == snap
    assert m.allocate_slots(b, 8, reserved_blocks=2) is not None  # 2 blocks, 2 stay free
    assert m.num_free_blocks == 2
    with pytest.raises(InvalidArgumentError, match="reserved_blocks"):
        m.allocate_slots(b, 4, reserved_blocks=-1)
    m.check_invariants()


def _swa_step(num_in_flight_tokens: int) -> list[int]:
    """A sliding-window (4 tokens, blocks of 4) request of 24 computed tokens: step A (4 tokens)
    is scheduled, then step B while A's output is ``num_in_flight_tokens`` in flight; returns
    the block table after B's allocation."""
    from kvcore import KVCacheManager

    spec = SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=8, sliding_window=4)
    m = KVCacheManager(KVCacheConfig(32, (KVCacheGroup(("swa",), spec),)), 256)
    r = m.make_request("r", list(range(24)))
    assert m.allocate_slots(r, 24) is not None
    r.num_computed_tokens = 24
    assert m.allocate_slots(r, 4) is not None  # step A
    r.num_computed_tokens = 28
    r.num_in_flight_tokens = num_in_flight_tokens
    assert m.allocate_slots(r, 4) is not None  # step B
    m.check_invariants()
    return m.get_block_ids("r")[0]


def test_window_blocks_leave_only_up_to_the_tokens_not_in_flight() -> None:
    # Processed: 24 tokens, whose window (tokens 21..) still reads the block of 20..23.
    assert _swa_step(4)[:6] == [0] * 5 + [6]
    # Nothing in flight: 28 processed, tokens 25.. read; the block of 20..23 left too.
    assert _swa_step(0)[:6] == [0] * 6


def test_report_prefix_hit_records_stored_events_and_changes_no_block() -> None:
    m = make_manager(num_blocks=16, enable_events=True)
    a = m.make_request("a", list(range(13)), session_id="s1")
    admit(m, a)
    m.free(a)
    m.take_events()
    b = m.make_request("b", [*range(12), 99], session_id="s2")
    hit, n = m.get_computed_blocks(b)
    assert n == 12
    snap = manager_snapshot(m)
    m.report_prefix_hit(b, hit)
    (e,) = m.take_events()
    assert manager_snapshot(m) == snap  # an event, and nothing else
    assert isinstance(e, BlockStored)
    assert (e.block_hashes, e.parent_block_hash, e.token_ids) == (
        tuple(b.block_hashes[:3]), None, tuple(range(12)))
    assert (e.block_size, e.group_id, e.session_id) == (4, 0, "s2")
    with pytest.raises(InvalidArgumentError, match="one block list per group"):
        m.report_prefix_hit(b, ())
    with pytest.raises(BlockStateError, match="not a block of this pool"):
        make_manager(num_blocks=16, enable_events=True).report_prefix_hit(b, hit)  # m's blocks
    quiet = make_manager(num_blocks=16)
    a = quiet.make_request("a", list(range(13)), session_id="s1")
    admit(quiet, a)
    quiet.free(a)
    b = quiet.make_request("b", [*range(12), 99], session_id="s2")
    hit, n = quiet.get_computed_blocks(b)
    assert n == 12
    quiet.report_prefix_hit(b, hit)  # no events recorded without events
    assert quiet.take_events() == []


def test_partial_primary_tokens_names_what_a_partial_entry_covers() -> None:
    full = FullAttentionSpec(block_size=8, num_kv_heads=1, head_size=8)
    swa = SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=8, sliding_window=4)
    config = KVCacheConfig(16, (KVCacheGroup(("f",), full), KVCacheGroup(("s",), swa)))
    from kvcore import KVCacheManager

    # Under EAGLE a hybrid caches one block past its aligned boundary: the prompt's last hash
    # boundary (12) inside the full-attention block [8, 16) becomes that block's entry.
    m = KVCacheManager(config, 128, use_eagle=True)
    r = m.make_request("r", list(range(13)))
    assert m.allocate_slots(r, 13) is not None
    full_blocks = m.get_blocks("r")[0]
    assert [m.pool.partial_primary_tokens(b) for b in full_blocks] == [None, 12]
    assert all(b.block_hash is not None for b in full_blocks)


def _cached_positions(retention: int | None) -> list[int]:
    spec = SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=8, sliding_window=8)
    from kvcore import KVCacheManager

    m = KVCacheManager(KVCacheConfig(32, (KVCacheGroup(("swa",), spec),), retention), 256)
    r = m.make_request("r", list(range(40)))
    assert m.allocate_slots(r, 40) is not None
    m.check_invariants()
    return [i for i, b in enumerate(m.get_blocks("r")[0]) if b.block_hash is not None]


def test_sparse_retention_caches_only_window_tails_a_request_can_resume_at() -> None:
    """Window 8, blocks of 4: a hit needs the 2 blocks before its end.  Dense caching keeps every
    full block; retention 0 only the tail before the prompt's replay boundary (token 39 ->
    blocks 7, 8); an interval of 16 tokens also one tail per 16 (blocks 2-3, 6-7)."""
    assert _cached_positions(None) == list(range(10))
    assert _cached_positions(0) == [7, 8]
    assert _cached_positions(16) == [2, 3, 6, 7, 8]


@pytest.mark.parametrize(("retention", "match"), [(-1, "int >= 0"), (6, "multiple"),
                                                  (True, "int >= 0")])
def test_retention_interval_must_fit_the_alignment(retention: object, match: str) -> None:
    spec = SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=8, sliding_window=8)
    with pytest.raises(InvalidArgumentError, match=match):
        KVCacheConfig(8, (KVCacheGroup(("s",), spec),), retention)  # type: ignore[arg-type]


def test_retention_is_refused_for_mamba_groups() -> None:
    import torch

    from kvcore.specs import MambaSpec

    spec = MambaSpec(block_size=4, shapes=((2, 4),), dtypes=(torch.float32,))
    with pytest.raises(InvalidArgumentError, match="Mamba"):
        KVCacheConfig(8, (KVCacheGroup(("m",), spec),), 0)


def test_a_deferred_free_withholds_the_blocks_until_they_are_returned() -> None:
    """vLLM's deferred frees (P/D decode instances, offloading with overlapped steps): the
    request is forgotten at once, its blocks stay referenced — not free, not reusable, still
    hittable — until the engine returns them; returned tail first they land in the free queue
    exactly where an immediate free puts them."""
    from kvcore.errors import UnknownRequestError

    def fresh() -> tuple[KVCacheManager, Request]:
        m = make_manager(num_blocks=16)
        r = m.make_request("r", list(range(14)))
        admit(m, r)
        return m, r

    m, r = fresh()
    free_before = m.num_free_blocks
    blocks = m.pop_blocks_for_free(r)
    assert [b.block_id for b in blocks] == [1, 2, 3, 4]
    assert m.num_free_blocks == free_before and all(b.ref_cnt == 1 for b in blocks)
    assert m.num_withheld_blocks == 4 and m.withheld_blocks() == {1: 1, 2: 1, 3: 1, 4: 1}
    with pytest.raises(UnknownRequestError):
        m.get_block_ids("r")
    m.check_invariants()
    again = m.make_request("again", list(range(14)))
    assert m.get_computed_blocks(again)[1] == 12  # withheld blocks still serve hits
    m.free_withheld(reversed(blocks))
    assert m.num_withheld_blocks == 0 and m.num_free_blocks == free_before + 4
    deferred_order = [b.block_id for b in m.pool.policy]
    m.check_invariants()

    m, r = fresh()
    m.free(r)
    assert [b.block_id for b in m.pool.policy] == deferred_order


def test_returning_withheld_blocks_twice_or_foreign_blocks_changes_nothing() -> None:
    from kvcore.errors import BlockStateError

    m = make_manager(num_blocks=16)
    a, b = m.make_request("a", list(range(9))), m.make_request("b", list(range(9)))
    admit(m, a)
    admit(m, b)  # shares a's two full blocks
    held_a, held_b = m.pop_blocks_for_free(a), m.pop_blocks_for_free(b)
    assert [x.ref_cnt for x in held_a[:2]] == [2, 2]
    m.free_withheld(reversed(held_a))
    snap = manager_snapshot(m)
    with pytest.raises(BlockStateError, match="withheld"):
        m.free_withheld([*held_b, held_a[2]])  # held_a's partial block: returned already
    with pytest.raises(BlockStateError, match="not a block of this pool"):
        m.free_withheld([make_manager(num_blocks=16).pool.blocks[3]])
    assert manager_snapshot(m) == snap
    m.free_withheld(reversed(held_b))
    assert m.num_free_blocks == 15
    m.check_invariants()


def test_a_deferred_free_leaves_out_null_blocks_and_keeps_group_order() -> None:
    """Group after group, each in allocation order; the null blocks a sliding window left
    behind are not handed out (vLLM returns them too, and its pool ignores them)."""
    from kvcore.errors import UnknownRequestError

    m = make_manager(full_spec(4), swa_spec(4), num_blocks=32)
    r = m.make_request("r", list(range(16)))
    admit(m, r)
    for t in range(8):
        decode(m, r, t)
    full, swa = m.get_blocks("r")
    assert any(b.is_null for b in swa)
    blocks = m.pop_blocks_for_free(r)
    assert blocks == [*full, *(b for b in swa if not b.is_null)]
    with pytest.raises(UnknownRequestError, match="holds no blocks"):
        m.pop_blocks_for_free(r)
    m.free_withheld(reversed(blocks))
    m.check_invariants()


@pytest.mark.parametrize("policy", ["lru", "slru", "s3fifo", "arc", "learned"])
def test_withheld_references_of_an_outside_holder_pin_blocks_without_an_access(
        policy: str) -> None:
    """``withhold`` (vLLM's ``block_pool.touch`` for a connector that copies blocks): free
    cached blocks leave the free side and blocks in use count one more reference, both
    withheld until ``free_withheld``; no access is recorded, so a policy's history and the
    free order after the return are those of a plain free."""
    from kvcore.errors import BlockStateError

    m = make_manager(num_blocks=16, eviction_policy=policy)
    a, b = m.make_request("a", list(range(9))), m.make_request("b", list(range(100, 113)))
    admit(m, a)
    admit(m, b)
    m.free(b)
    cached = [x for x in m.pool.policy if x.block_hash is not None]
    in_use = m.get_blocks("a")[0][0]
    marks = [getattr(m.pool.policy, "mark", lambda _: 0)(x) for x in m.pool.blocks]
    free_before = m.num_free_blocks
    m.withhold([*cached, in_use, cached[0], m.pool.null_block])
    assert m.withheld_blocks() == {**{x.block_id: 1 for x in cached}, in_use.block_id: 1,
                                   cached[0].block_id: 2}
    assert m.num_free_blocks == free_before - len(cached) and in_use.ref_cnt == 2
    assert [getattr(m.pool.policy, "mark", lambda _: 0)(x) for x in m.pool.blocks] == marks
    m.check_invariants()
    snap = manager_snapshot(m)
    unhashed = next(x for x in m.pool.policy if x.block_hash is None)
    with pytest.raises(BlockStateError, match="in use by nobody"):
        m.withhold([in_use, unhashed])
    with pytest.raises(BlockStateError, match="not a block of this pool"):
        m.pool.pin([in_use, make_manager(num_blocks=16).pool.blocks[1]])
    assert manager_snapshot(m) == snap
    m.free_withheld([*cached, in_use, cached[0]])
    assert m.num_withheld_blocks == 0 and m.num_free_blocks == free_before
    m.check_invariants()
