"""Queue hints on a layout with a state group (Mamba): a hit can end only where a state block is
cached, so the hints hold a request's attention blocks up to its furthest cached state and that
state, nothing past it (kvcore.coordinator.hybrid.HybridCoordinator.hint_hashes)."""

from __future__ import annotations

from kvcore.manager import KVCacheManager
from kvcore.request import Request
from kvcore.specs import KVCacheConfig, KVCacheGroup, KVCacheSpec
from kvcore.testing.setups import full, mamba_align, swa


def _manager(*specs: KVCacheSpec) -> KVCacheManager:
    return KVCacheManager(KVCacheConfig(num_blocks=64, groups=tuple(
        KVCacheGroup((f"l{i}",), s) for i, s in enumerate(specs))), 256)


def _run(m: KVCacheManager, rid: str, tokens: list[int]) -> Request:
    req = m.make_request(rid, tokens)
    blocks, hit = m.get_computed_blocks(req)
    assert m.allocate_slots(req, req.num_tokens - hit, hit, blocks) is not None
    req.num_computed_tokens = req.num_tokens
    return req


def test_hints_stop_at_the_furthest_cached_state() -> None:
    m = _manager(full(4), mamba_align(4))
    prompt = [t % 7 + 1 for t in range(16)]
    m.free(_run(m, "a", prompt))
    mamba_map = m.pool.cached_blocks_map(1)
    b = m.make_request("b", prompt + [9] * 12)  # a's prompt, then 12 tokens nobody computed
    hashes = b.block_hashes
    cached_states = [j for j, h in enumerate(hashes) if h in mamba_map]
    assert cached_states, "the finished request left no state block cached"
    last = max(cached_states)
    attention, states = m.coordinator.hint_hashes([hashes])
    assert attention == list(hashes[:last + 1])
    assert states == [hashes[last]]
    # The hit the hints serve is exactly that long.
    assert m.get_computed_blocks(b)[1] == 4 * (last + 1)


def test_no_cached_state_declares_nothing() -> None:
    m = _manager(full(4), mamba_align(4))
    c = m.make_request("c", [5] * 20)
    assert m.coordinator.hint_hashes([c.block_hashes]) == [[], []]


def test_without_a_state_group_every_hash_is_declared() -> None:
    m = _manager(full(4), swa(8, 4))
    c = m.make_request("c", [5] * 20)
    assert m.coordinator.hint_hashes([c.block_hashes]) == [list(c.block_hashes)] * 2
