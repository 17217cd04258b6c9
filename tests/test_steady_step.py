"""A hybrid model's running step that ``KVCacheManager.allocate_slots`` answers without
``allocate_running`` (full-attention and Mamba "align" groups: ``KVCacheCoordinator.steady_step``)
is the coordinator's own answer: a manager taking the shortcut and one made to take the general
path (a subclass of the Mamba "align" manager is never given it) stay identical through random
admissions with prefix hits, prompt chunks, decode steps (with lookahead slots and steps in
flight), failures for want of blocks, step boundaries and frees, with and without vLLM 0.32's
re-mark of the prompt's boundary state."""

from __future__ import annotations

import random

import pytest

from kvcore.manager import KVCacheManager
from kvcore.managers import MambaAlignManager
from kvcore.request import Request
from kvcore.specs import KVCacheConfig, KVCacheGroup, KVCacheSpec, MambaSpec
from kvcore.testing.setups import full, mamba_align, swa
from kvcore.testing.snapshot import pool_snapshot
from tests.factories import make_request


class _GeneralPath(MambaAlignManager):
    """kvcore's Mamba "align" manager under another class: every running step of the
    manager goes through allocate_running."""


LAYOUTS: dict[str, tuple[KVCacheSpec, ...]] = {
    "full4+mamba4": (mamba_align(4, checkpoint=True), full(4)),
    "full4+mamba8": (full(4), mamba_align(8, checkpoint=True)),  # hit alignment 8
    "full4+mamba4+full4": (full(4), mamba_align(4), full(4)),
}


def _manager(specs: tuple[KVCacheSpec, ...], general: bool, num_blocks: int, caching: bool,
             recache: bool, lookahead: int) -> KVCacheManager:
    groups = tuple(KVCacheGroup((f"layer{i}",), s) for i, s in enumerate(specs))
    return KVCacheManager(KVCacheConfig(num_blocks, groups), 256, enable_caching=caching,
                          enable_events=caching, mamba_recache_prompt_boundary=recache,
                          num_hash_lookahead_tokens=lookahead,
                          manager_classes={MambaSpec: _GeneralPath} if general else None)


def _state(m: KVCacheManager, rids: list[str]) -> tuple[object, ...]:
    per_group = []
    for g in m.coordinator.managers:
        row: list[object] = [
            tuple((rid, tuple(b.block_id for b in g.req_to_blocks.get(rid, ())),
                   g.num_cached_block.get(rid)) for rid in rids),
            g.step_state()]
        if isinstance(g, MambaAlignManager):
            row += [sorted(g.checkpoints.items()), sorted(g.last_state_block_idx.items()),
                    sorted(g.num_retired_blocks.items()), sorted(g.allocated),
                    [(rid, gid, b.block_id, n) for rid, gid, b, n in g.pending_offloads],
                    g._staged, g.shortfall]
        per_group.append(tuple(map(str, row)))
    slots = tuple(m.num_slots(rid) for rid in rids if rid in m.requests())
    return (pool_snapshot(m.pool), tuple(per_group), slots, tuple(m.take_events()))


def test_only_full_attention_and_plain_mamba_align_layouts_take_the_shortcut() -> None:
    def steady(*specs: KVCacheSpec, **kw: object) -> bool:
        groups = tuple(KVCacheGroup((f"l{i}",), s) for i, s in enumerate(specs))
        return KVCacheManager(KVCacheConfig(32, groups), 64, **kw).coordinator.steady_steps

    assert steady(full(4), mamba_align(4, checkpoint=True))
    assert steady(full(4), mamba_align(4), enable_caching=False)
    assert not steady(full(4))  # (the single group's own shortcut: sole_full_attention)
    assert not steady(full(4), swa(8, 4), mamba_align(4))
    assert not steady(full(4), mamba_align(4, spec=1))
    # (full attention registering partial prompt tails: blocks larger than the hash block)
    assert not steady(full(8), mamba_align(4, checkpoint=True))
    assert not steady(full(4), mamba_align(4), use_eagle=True)
    assert not steady(full(4), mamba_align(4), manager_classes={MambaSpec: _GeneralPath})


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("caching", "recache", "lookahead"),
                         [(True, False, 0), (True, True, 0), (True, False, 2),
                          (False, False, 0)])
def test_the_shortcut_gives_the_general_paths_every_answer_and_state(
        seed: int, layout: str, caching: bool, recache: bool, lookahead: int) -> None:
    rng = random.Random(seed)
    specs = LAYOUTS[layout]
    num_blocks = rng.choice([14, 24, 40])
    fast, slow = (_manager(specs, general, num_blocks, caching, recache, lookahead)
                  for general in (False, True))
    assert fast.coordinator.steady_steps and not slow.coordinator.steady_steps
    hbs = fast.hash_block_size
    prefixes = [[rng.randrange(6) for _ in range(rng.randrange(4, 30))] for _ in range(3)]
    running: dict[str, tuple[Request, Request]] = {}
    rids: list[str] = []
    steady = 0
    for step in range(260):
        op = rng.random()
        if op < 0.2 or not running:  # admit a request sharing a prefix, maybe in chunks
            rid = f"r{step}"
            tokens = rng.choice(prefixes) + [rng.randrange(6) for _ in range(rng.randrange(9))]
            pair = (make_request(rid, tokens, hbs), make_request(rid, tokens, hbs))
            chunk = rng.choice([3, 8, 100])
            answers = []
            for m, req in zip((fast, slow), pair):
                hit_blocks, hit = m.get_computed_blocks(req)
                n = min(req.num_tokens - hit, chunk)
                out = m.allocate_slots(req, n, hit, hit_blocks)
                if out is not None:
                    req.num_computed_tokens = hit + n
                answers.append(None if out is None else (hit, out.get_block_ids()))
            assert answers[0] == answers[1]
            if answers[0] is not None:
                running[rid] = pair
                rids.append(rid)
        elif op < 0.8:  # a running step: the prompt's next chunk, or one decoded token
            rid = rng.choice(sorted(running))
            token = rng.randrange(6)
            lookahead_slots = rng.choice([0, 0, 0, 1, 3])
            in_flight = rng.choice([0, 0, 1, 2])
            pick = rng.choice([3, 8, 100])
            answers = []
            for m, req in zip((fast, slow), running[rid]):
                left = req.num_tokens - req.num_computed_tokens
                if left > 0:
                    n = min(left, pick)
                else:
                    req.append_output_token_ids(token)
                    n = 1
                req.num_in_flight_tokens = min(in_flight, req.num_computed_tokens)
                out = m.allocate_slots(req, n, num_lookahead_tokens=lookahead_slots)
                req.num_in_flight_tokens = 0
                if out is not None:
                    req.num_computed_tokens += n
                answers.append(None if out is None else out.get_block_ids())
            assert answers[0] == answers[1]
            if answers[0] is not None and not any(answers[0]):
                steady += 1
            if answers[0] is None:  # no block for it: preempted, as a scheduler would
                for m, req in zip((fast, slow), running.pop(rid)):
                    m.free(req)
        elif op < 0.94:  # a step boundary (this step's Mamba states become hittable)
            fast.new_step()
            slow.new_step()
        else:  # finish one
            rid = rng.choice(sorted(running))
            for m, req in zip((fast, slow), running.pop(rid)):
                m.free(req)
        fast.check_invariants()
        slow.check_invariants()
        assert _state(fast, rids) == _state(slow, rids), f"step {step}"
    assert steady > 20  # (running steps that took no block: the shortcut's candidates)
