"""Speculative Mamba state blocks (MTP/EAGLE on a hybrid model, issue 47) and EAGLE with an
"align" group, in kvcore's own manager.

The layouts asserted here are vLLM's (0.32 and 0.33 agree): in "none" mode the table reaches
``num_speculative_blocks`` blocks past the slots; in "align" mode the running state's slot is
followed by the speculative blocks, and a step that moves the running state past some of them
moves those to the table's end (their old slots null).  ``tests/differential`` and
``tests/integrations/vllm/test_differential_adapter.py`` compare the same against vLLM's own
manager on random traces; the hostile driver runs ``full+mamba spec2``,
``full+mamba-align spec3 eagle`` and the ``mixed-bs full4+mamba-align8 spec2`` family.  Every
manager here is ``checked``: the invariants hold after every call.
"""

from __future__ import annotations

import pytest
import torch

from kvcore.errors import InvalidArgumentError, UnsupportedFeatureError
from kvcore.manager import KVCacheManager
from kvcore.managers.mamba import checkpoint_position
from kvcore.request import Request
from kvcore.specs import KVCacheConfig, KVCacheGroup, KVCacheSpec, MambaSpec
from kvcore.testing.checked import assert_no_leak, checked
from kvcore.testing.setups import full, mamba, mamba_align


def _manager(*specs: KVCacheSpec, num_blocks: int = 32, use_eagle: bool = False,
             retention: int | None = None) -> KVCacheManager:
    groups = tuple(KVCacheGroup((f"layer{i}",), s) for i, s in enumerate(specs))
    return checked(KVCacheManager(KVCacheConfig(num_blocks, groups, retention), 64,
                                  use_eagle=use_eagle), track_contents=True)


def _layout(m: KVCacheManager, rid: str, group: int = 1) -> list[int | None]:
    """The group's table: block ids, ``None`` at null positions."""
    return [None if b.is_null else b.block_id for b in m.get_blocks(rid)[group]]


def _step(m: KVCacheManager, req: Request, n: int) -> None:
    """Run ``n`` more tokens of a running request (sampling the next token when the step
    reaches the end of what it holds), as a scheduler does."""
    assert m.allocate_slots(req, n) is not None
    req.num_computed_tokens += n
    if req.num_computed_tokens >= req.num_tokens:
        req.append_output_token_ids(1)


def test_the_spec_checks_the_number_of_speculative_blocks() -> None:
    for bad in (-1, True, 1.0):
        with pytest.raises(InvalidArgumentError, match="num_speculative_blocks"):
            MambaSpec(block_size=4, shapes=((2, 4),), dtypes=(torch.float32,),
                      num_speculative_blocks=bad)  # type: ignore[arg-type]  # (wrong on purpose)
    assert mamba_align(4, spec=2).max_blocks_per_request(64) == 4  # running, source, 2


def test_none_mode_reaches_the_speculative_blocks_further() -> None:
    m = _manager(full(4), mamba(4, spec=2))
    a = m.make_request("a", [t % 5 for t in range(10)])
    # Three blocks of full attention; Mamba: three for the tokens plus two speculative ones.
    assert m.coordinator.num_blocks_to_allocate("a", 10, ((), ()), 0, 0) == 3 + 5
    _step(m, a, 10)
    assert [len(t) for t in m.get_blocks("a")] == [3, 5]
    _step(m, a, 1)  # 11 tokens: still inside the third block
    assert [len(t) for t in m.get_blocks("a")] == [3, 5]
    _step(m, a, 2)  # 13 tokens: a fourth block in each group
    assert [len(t) for t in m.get_blocks("a")] == [4, 6]
    m.free(a)
    assert_no_leak(m)


def test_align_mode_moves_the_passed_speculative_blocks_to_the_end() -> None:
    m = _manager(full(4), mamba_align(4, spec=2))
    a = m.make_request("a", [t % 5 for t in range(40)])
    # A first allocation: the running state's block and both speculative ones.
    assert m.coordinator.num_blocks_to_allocate("a", 10, ((), ()), 0, 0) == 3 + 3
    _step(m, a, 10)
    first = _layout(m, "a")
    assert first[:2] == [None, None] and None not in first[2:] and len(first) == 5
    running, s1, s2 = first[2:]
    _step(m, a, 1)  # 11 tokens: the running state's slot stays: nothing moves, nothing new
    assert _layout(m, "a") == first
    _step(m, a, 2)  # 13 tokens: the running state moves into the first speculative block
    grown = _layout(m, "a")
    assert grown[:5] == [None, None, running, s1, s2] and len(grown) == 6
    new = grown[5]
    # 25 tokens: the running state's slot (6) passes both speculative blocks: they move to
    # the end, behind it; the state before the processed tokens' last one is released.
    assert m.coordinator.num_blocks_to_allocate("a", 25, ((), ()), 13, 0) == 3 + 1
    _step(m, a, 12)
    moved = _layout(m, "a")
    assert moved[:6] == [None, None, None, s1, None, None]
    assert moved[6:8] == [s2, new] and len(moved) == 9 and moved[8] not in first
    m.free(a)
    assert_no_leak(m)


@pytest.mark.parametrize("use_eagle", [False, True])
def test_a_checkpoint_step_puts_a_speculative_block_at_the_checkpoint_slot(
        use_eagle: bool) -> None:
    m = _manager(full(4), mamba_align(4, checkpoint=True, spec=1), use_eagle=use_eagle)
    prompt = [t % 5 for t in range(22)]
    a = m.make_request("a", prompt)
    # Chunks end on block edges, as vLLM's scheduler cuts an "align" prefill.  The first
    # exports the state at 4 tokens into slot 0; the running state is at 1, the speculative
    # block at 2.
    _step(m, a, 8)
    chunk = _layout(m, "a")
    assert None not in chunk and len(chunk) == 3
    spec_block = chunk[2]
    # To 20 tokens: the checkpoint at 16 (slot 3), the running state at slot 4: the
    # speculative block moves to slot 3 and takes the checkpoint; two new blocks follow.
    assert m.coordinator.num_blocks_to_allocate("a", 20, ((), ()), 8, 0, None, 20, 22,
                                                False) == 3 + 2
    _step(m, a, 12)
    table = _layout(m, "a")
    assert table[2] is None and table[3] == spec_block and len(table) == 6
    checkpoint = m.get_blocks("a")[1][3]
    assert checkpoint.block_hash is not None  # cached at its position, 16 tokens
    _step(m, a, 2)
    m.free(a)
    m.new_step()
    # A sibling whose hit ends at 16 tokens: sharing 16 tokens, or under EAGLE 20 (whose last
    # block EAGLE drops).
    b = m.make_request("b", [*prompt[:20 if use_eagle else 18], 4, 4])
    hit, num_hit = m.get_computed_blocks(b)
    assert num_hit == 16 and hit[1][-1] is checkpoint
    assert_no_leak(m)


def test_eagle_moves_the_prompt_checkpoint_to_its_replay_boundary() -> None:
    """vLLM's prompt checkpoint: without EAGLE one token short of the end, aligned down; under
    EAGLE one unit below the last boundary at or before the end (where a hit lands once EAGLE
    drops its last block)."""
    assert [checkpoint_position(n, 4) for n in (3, 4, 5, 22, 24)] == [0, 0, 4, 20, 20]
    assert [checkpoint_position(n, 4, eagle=True) for n in (3, 4, 5, 22, 24)] == [0, 0, 0, 16,
                                                                                  20]


def test_an_unaligned_eagle_checkpoint_is_not_placed_with_speculative_blocks() -> None:
    """Under EAGLE a chunk ending inside a block has its checkpoint two slots before the
    running state's, where vLLM's layout has no room for it (its scheduler never cuts an
    "align" chunk there): the count is vLLM's, the checkpoint's block included (admission
    decides as vLLM's does), but no block is placed for it and nothing is cached at it."""
    m = _manager(full(4), mamba_align(4, checkpoint=True, spec=2), use_eagle=True)
    a = m.make_request("a", [t % 5 for t in range(22)])
    assert m.coordinator.num_blocks_to_allocate("a", 22, ((), ()), 0, 0) == 6 + 4
    free = m.pool.num_free_blocks
    _step(m, a, 22)
    assert m.pool.num_free_blocks == free - 6 - 3
    table = m.get_blocks("a")[1]
    assert [b.is_null for b in table] == [True] * 5 + [False] * 3
    assert all(b.block_hash is None for b in table)  # (the states at 22 are not full blocks)
    m.free(a)
    assert_no_leak(m)


def test_preemption_and_free_leak_nothing() -> None:
    m = _manager(full(4), mamba_align(4, checkpoint=True, spec=3), num_blocks=24)
    a = m.make_request("a", [t % 5 for t in range(13)])
    _step(m, a, 9)
    _step(m, a, 4)
    m.free(a)  # a preemption frees the same way
    a2 = m.make_request("a2", [t % 5 for t in range(13)])
    _step(m, a2, 13)
    assert len(_layout(m, "a2")) == 4 + 3
    m.free(a2)
    assert_no_leak(m)


def test_a_checkpoint_with_speculative_blocks_needs_the_hit_alignment_of_its_blocks() -> None:
    with pytest.raises(UnsupportedFeatureError, match="speculative Mamba state blocks"):
        _manager(full(8), mamba_align(4, checkpoint=True, spec=1))
    _manager(full(8), mamba_align(4, spec=1))  # without a checkpoint: fine
    _manager(full(4), mamba_align(8, checkpoint=True, spec=1))  # alignment 8 = its blocks
