"""The decode step ``KVCacheManager.allocate_slots`` answers without the coordinator (one plain
full-attention group: ``KVCacheCoordinator.sole_full_attention``) is the coordinator's own
answer: a manager taking the shortcut and one made to take the full path (a subclass of the
full-attention manager is never given the shortcut) stay identical through random admissions,
decode steps (with and without lookahead slots), failures for want of blocks, and frees."""

from __future__ import annotations

import random

import pytest

from kvcore.manager import KVCacheManager
from kvcore.managers import FullAttentionManager
from kvcore.request import Request
from kvcore.specs import FullAttentionSpec
from kvcore.testing.snapshot import pool_snapshot
from tests.factories import full_spec, make_manager, make_request, swa_spec


class _FullPath(FullAttentionManager):
    """kvcore's full-attention manager under another class: allocate_slots calls the
    coordinator for every step."""


def _state(m: KVCacheManager, rids: list[str]) -> tuple[object, ...]:
    fa = m.coordinator.managers[0]
    return (pool_snapshot(m.pool),
            tuple((rid, tuple(b.block_id for b in fa.req_to_blocks.get(rid, ())),
                   fa.num_cached_block.get(rid)) for rid in rids),
            tuple(m.take_events()))


def test_only_the_plain_full_attention_layout_takes_the_shortcut() -> None:
    assert make_manager(full_spec()).coordinator.sole_full_attention is not None
    assert make_manager(full_spec(), enable_caching=False).coordinator.sole_full_attention \
        is not None
    assert make_manager(swa_spec(8)).coordinator.sole_full_attention is None
    assert make_manager(full_spec(), full_spec()).coordinator.sole_full_attention is None
    subclassed = make_manager(full_spec(), manager_classes={FullAttentionSpec: _FullPath})
    assert subclassed.coordinator.sole_full_attention is None


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("caching", [True, False])
def test_the_shortcut_gives_the_full_paths_every_answer_and_state(seed: int,
                                                                  caching: bool) -> None:
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 3, 4, 8])
    num_blocks = rng.choice([6, 12, 24])
    fast = make_manager(full_spec(block_size), num_blocks=num_blocks, max_model_len=256,
                        enable_caching=caching, enable_events=caching)
    slow = make_manager(full_spec(block_size), num_blocks=num_blocks, max_model_len=256,
                        enable_caching=caching, enable_events=caching,
                        manager_classes={FullAttentionSpec: _FullPath})
    assert fast.coordinator.sole_full_attention is not None
    assert slow.coordinator.sole_full_attention is None
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 12))] for _ in range(3)]
    running: dict[str, tuple[Request, Request]] = {}
    rids: list[str] = []
    decodes = 0
    for step in range(300):
        op = rng.random()
        if op < 0.25 or not running:  # admit a request sharing a prefix
            rid = f"r{step}"
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(8))]
            pair = (make_request(rid, tokens, block_size), make_request(rid, tokens, block_size))
            answers = []
            for m, req in zip((fast, slow), pair):
                hit_blocks, hit = m.get_computed_blocks(req)
                out = m.allocate_slots(req, req.num_tokens - hit, hit, hit_blocks)
                if out is not None:
                    req.num_computed_tokens = req.num_tokens
                answers.append(None if out is None else out.get_block_ids())
            assert answers[0] == answers[1]
            if answers[0] is not None:
                running[rid] = pair
                rids.append(rid)
        elif op < 0.9:  # a decode step, sometimes with lookahead slots
            rid = rng.choice(sorted(running))
            token = rng.randrange(50)
            lookahead = rng.choice([0, 0, 0, 1, 3])
            answers = []
            for m, req in zip((fast, slow), running[rid]):
                req.append_output_token_ids(token)
                out = m.allocate_slots(req, 1, num_lookahead_tokens=lookahead)
                if out is not None:
                    req.num_computed_tokens += 1
                answers.append(None if out is None else out.get_block_ids())
            assert answers[0] == answers[1]
            decodes += 1
            if answers[0] is None:  # no block for it: preempted, as a scheduler would
                for m, req in zip((fast, slow), running.pop(rid)):
                    m.free(req)
        else:  # finish one
            rid = rng.choice(sorted(running))
            for m, req in zip((fast, slow), running.pop(rid)):
                m.free(req)
        fast.check_invariants()
        slow.check_invariants()
        assert _state(fast, rids) == _state(slow, rids)
    assert decodes > 30
