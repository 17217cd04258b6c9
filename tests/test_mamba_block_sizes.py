"""Mamba "align" groups beside groups of other block sizes (issue 45).

The hit alignment is the lcm of the groups' block sizes, so a Mamba group with smaller blocks
than another group keeps its prompt checkpoint at a position several of its blocks apart from
the running state: the checkpoint block must sit in the table slot of that position (and be
cached under that position's hash), with lookahead hashes too.  Every manager here is
``checked`` with contents tracked: the invariants hold after every call and every adopted hit
holds the request's own KV.
"""

from __future__ import annotations

import pytest
import torch

from kvcore.errors import InvalidArgumentError
from kvcore.eviction import REGISTRY
from kvcore.manager import KVCacheManager
from kvcore.specs import KVCacheConfig, KVCacheGroup, KVCacheSpec, MambaSpec
from kvcore.testing.checked import assert_no_leak, checked
from kvcore.testing.driver import HostileDriver
from kvcore.testing.setups import SETUPS, Setup, full, mamba_align, swa
from tests.factories import manager_snapshot


def _manager(*specs: KVCacheSpec, lookahead: int = 0, num_blocks: int = 32) -> KVCacheManager:
    groups = tuple(KVCacheGroup((f"layer{i}",), s) for i, s in enumerate(specs))
    return checked(KVCacheManager(KVCacheConfig(num_blocks, groups), 64,
                                  num_hash_lookahead_tokens=lookahead), track_contents=True)


LAYOUTS = {
    "full8+mamba4": (full(8), mamba_align(4, checkpoint=True)),
    "full12+mamba4": (full(12), mamba_align(4, checkpoint=True)),
    "full8+swa4+mamba4": (full(8), swa(6, 4), mamba_align(4, checkpoint=True)),
    "full4+mamba8": (full(4), mamba_align(8, checkpoint=True)),  # alignment = Mamba's blocks
}


@pytest.mark.parametrize("lookahead", [0, 3])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_prompt_checkpoint_sits_in_the_slot_of_its_position(layout: str,
                                                                lookahead: int) -> None:
    specs = LAYOUTS[layout]
    m = _manager(*specs, lookahead=lookahead)
    g = len(specs) - 1  # the Mamba group
    bs = specs[g].block_size
    align = m.config.alignment_tokens
    n = align + 6  # the checkpoint: at `align` tokens, hashed even with 3 lookahead tokens
    a = m.make_request("a", [t % 5 for t in range(n)])
    assert m.allocate_slots(a, n) is not None
    a.num_computed_tokens = n
    table = m.get_blocks("a")[g]
    real = [i for i, b in enumerate(table) if not b.is_null]
    assert real == [align // bs - 1, len(table) - 1]  # the checkpoint, the running state
    checkpoint = table[align // bs - 1]
    assert checkpoint.block_hash is not None  # cached under its own position's hash
    m.free(a)
    m.new_step()
    b = m.make_request("b", [t % 5 for t in range(n)])
    blocks, hit = m.get_computed_blocks(b)
    assert hit == align
    assert [x.block_id for x in blocks[g]] == [0] * (align // bs - 1) + [checkpoint.block_id]
    assert m.allocate_slots(b, n - hit, hit, blocks) is not None  # the oracle proves the hit
    m.free(b)
    assert_no_leak(m)


def test_the_reported_lookahead_call_keeps_its_blocks_and_its_request() -> None:
    """Issue 45: full attention on 8-token blocks, Mamba on 4, lookahead hashes of 3 tokens:
    ``allocate_slots(r, 14)`` raised IndexError after taking 4 blocks, which leaked, and the
    request was no longer tracked."""
    m = _manager(full(8), mamba_align(4, checkpoint=True), lookahead=3)
    free = m.pool.num_free_blocks
    r = m.make_request("r", range(14))
    out = m.allocate_slots(r, 14)
    assert out is not None
    assert r.request_id in m.requests()
    held = [b for t in m.get_blocks("r") for b in t if not b.is_null]
    assert len(held) == 4 and free - m.pool.num_free_blocks == 4
    r.num_computed_tokens = 14
    m.free(r)
    assert m.pool.num_free_blocks == free
    assert_no_leak(m)


def test_a_mamba_table_longer_than_the_tokens_hides_no_other_groups_need() -> None:
    """A Mamba "align" table can be longer than the tokens of the next call (draft tokens it
    was grown for were rejected): its count is then 0, not negative, so the other groups'
    need still decides, and the call returns None on a full pool instead of failing inside
    the allocation."""
    # (Not content-checked: the oracle writes a request's own tokens only, never draft slots.)
    m = KVCacheManager(KVCacheConfig(12, (KVCacheGroup(("full",), full(4)),
                                          KVCacheGroup(("mamba",), mamba_align(4)))), 64)
    a = m.make_request("a", range(8))
    assert m.allocate_slots(a, 8) is not None
    a.num_computed_tokens = 8
    a.append_output_token_ids(1)
    assert m.allocate_slots(a, 9) is not None  # the sampled token and 8 draft tokens
    a.num_computed_tokens = 9  # every draft token rejected
    m.remove_skipped_blocks("a", 9)
    assert len(m.get_blocks("a")[1]) == 5
    b = m.make_request("b", range(100, 100 + 4 * (m.pool.num_free_blocks - 1)))
    assert m.allocate_slots(b, b.num_tokens) is not None
    assert m.pool.num_free_blocks == 0
    # 10 main-model tokens (3 Mamba slots, 5 held) and 12 lookahead slots: full attention
    # needs a sixth block.
    before = manager_snapshot(m)
    assert m.allocate_slots(a, 1, num_lookahead_tokens=12) is None
    assert manager_snapshot(m) == before
    m.free(b)
    assert m.allocate_slots(a, 1, num_lookahead_tokens=12) is not None
    assert [len(t) for t in m.get_blocks("a")] == [6, 5]
    m.check_invariants()
    m.free(a)
    assert_no_leak(m)


def test_a_checkpoint_block_needs_an_export_alignment() -> None:
    with pytest.raises(InvalidArgumentError, match="prefill_checkpoint_alignment"):
        MambaSpec(block_size=4, shapes=((2, 4),), dtypes=(torch.float32,),
                  mamba_cache_mode="align", num_prefill_checkpoint_blocks=1)


def test_the_hostile_overrun_counts_slots_past_a_mamba_align_table() -> None:
    """A Mamba "align" table has no lookahead slots: the driver's overrun must claim past the
    slots of the other tables, or it reports its own call as a violation."""
    setup = next(s for s in SETUPS if s.name == "full+mamba-align")
    d = HostileDriver(setup)
    d.add(0, 0, [1, 2, 0, 1, 2, 0], 0, 0, False)
    d.admit(0, 4, lookahead=2)  # 4 tokens (one Mamba block) with 6 slots (two full blocks)
    [req] = d.running.values()
    assert d.m.num_slots(req.request_id) == 6
    assert [len(t) for t in d.m.get_blocks(req.request_id)] == [2, 1]
    for extra in range(4):
        d.overrun(0, extra)
    d.check()


def test_every_layout_of_mixed_block_sizes_runs_each_policy_lookahead_and_retention() -> None:
    mixed = [s for s in SETUPS if s.name.startswith("mixed-bs ")]
    assert {s.eviction_policy for s in mixed} == set(REGISTRY.names(offline=False))
    assert {"lru", "slru", "s3fifo", "arc", "learned"} <= set(REGISTRY.names(offline=False))
    assert {s.hash_lookahead for s in mixed} == {0, 3}
    assert {s.retention for s in mixed} == {None, 0, 16}
    layouts = {s.specs for s in mixed}
    assert len(layouts) == 6
    assert any(getattr(x, "num_speculative_blocks", 0) for specs in layouts for x in specs)
    assert all(len({x.block_size for x in specs}) > 1 for specs in layouts)
    built = Setup("x", mixed[-1].specs, hash_lookahead=3, eviction_policy="arc").build()
    assert built.num_hash_lookahead_tokens == 3 and built.pool.eviction_policy == "arc"
