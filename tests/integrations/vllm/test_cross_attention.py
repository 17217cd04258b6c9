"""Encoder-decoder models (cross attention) through the adapter, call for call against vLLM's
own ``KVCacheManager`` on the installed vLLM (0.32 or 0.33).

vLLM runs them with prefix caching off (its default for encoder-decoder models; its
``CrossAttentionManager`` raises on a lookup or ``cache_blocks``), and so does kvcore, which
refuses the combination at start.  A request's cross-attention table holds
``cdiv(num_encoder_tokens, block_size)`` blocks, taken when ``num_encoder_tokens`` is passed
(vLLM's scheduler: at admission) and released with the request.  Random traces with a
cross-attention group are also in test_differential_adapter.py; the end-to-end Whisper run is in
test_engine_whisper.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from vllm.v1.core.single_type_kv_cache_manager import CrossAttentionManager
from vllm.v1.kv_cache_interface import CrossAttentionSpec
from vllm.v1.request import Request

from kvcore.errors import UnsupportedFeatureError
from kvcore.integrations.vllm.manager import KVCacheManagerAdapter
from kvcore.integrations.vllm.settings import KvcoreSettings
from tests.differential.replay import replay_all
from tests.differential.traces import generate_trace
from tests.integrations.vllm.helpers import event_bytes, full, kv_config, managers, request


def cross(block_size: int = 16) -> CrossAttentionSpec:
    return CrossAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=32,
                              dtype=torch.float16)


def _pair(num_blocks: int, full_bs: int = 16, cross_bs: int = 16) -> tuple[Any, Any]:
    config = kv_config(full(full_bs), cross(cross_bs), num_blocks=num_blocks)
    sched = max(full_bs, cross_bs)  # both are powers of two here: the lcm
    return managers(config, block_size=sched, enable_caching=False)


def _state(m: Any, rids: list[str], tokens: int) -> Any:
    """Everything a caller can read of the manager's state."""
    return ([m.get_block_ids(r) for r in rids],
            [m.get_block_ids_for_computed_tokens(r, tokens) for r in rids],
            [m.get_num_common_prefix_blocks(r) for r in rids],
            [[len(g.req_to_blocks.get(r, [])) for g in m.coordinator.single_type_managers]
             for r in rids],
            m.block_pool.get_num_free_blocks(), m.usage,
            [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()],
            event_bytes(m))


def _script(m: Any) -> list[Any]:
    """A Whisper-shaped run: admissions with encoder tokens, decode steps (no encoder tokens),
    a request without encoder input, a running request asked for more encoder slots, failed
    allocations, preemption and re-admission, a deferred free, a KV-connector load."""
    out: list[Any] = []
    reqs: dict[str, Request] = {}

    def add(rid: str, n: int) -> Request:
        reqs[rid] = request(rid, range(n))
        return reqs[rid]

    def admit(req: Request, enc: int, **kw: Any) -> None:
        blocks, hit, boundary = m.get_computed_blocks(req)
        new = m.allocate_slots(req, req.num_tokens - hit, hit, blocks, num_encoder_tokens=enc,
                               **kw)
        out.append(("admit", req.request_id, hit, boundary,
                    None if new is None else new.get_block_ids()))
        if new is not None:
            m.record_prefix_cache_stats(req, hit)
            req.num_computed_tokens = req.num_tokens
            out.append(m.estimate_cached_tokens(req))

    def step(req: Request, **kw: Any) -> None:
        req.append_output_token_ids(7)
        new = m.allocate_slots(req, 1, **kw)
        out.append(("step", req.request_id, None if new is None else new.get_block_ids()))
        if new is not None:
            req.num_computed_tokens += 1

    a = add("a", 20)
    out.append(m.coordinator.get_num_blocks_to_allocate("a", 20, m.empty_kv_cache_blocks.blocks,
                                                        150, 0, 0, 20))
    admit(a, 150)  # Whisper-like: many more encoder tokens than decoder tokens
    for _ in range(14):
        step(a)
    b = add("b", 5)
    admit(b, 0, full_sequence_must_fit=True)  # no encoder input: no cross-attention blocks
    c = add("c", 10)
    admit(c, 1000)  # does not fit: None, nothing changed
    admit(c, 33, full_sequence_must_fit=True)
    out.append(_state(m, ["a", "b", "c"], 16))
    step(b, num_encoder_tokens=40)  # a running request asked for encoder slots: they grow
    step(b, num_encoder_tokens=17)  # and never shrink
    step(c, num_lookahead_tokens=3)
    out.append(_state(m, ["a", "b", "c"], 21))
    m.free(c)  # preempted: everything back, re-admitted with its encoder input again
    c.num_computed_tokens = 0
    c.num_preemptions += 1
    admit(c, 33)
    held = m.pop_blocks_for_free(b)  # a deferred free: withheld until the step is done
    out.append(([blk.block_id for blk in held], _state(m, ["a", "c"], 8)))
    m.block_pool.free_blocks(reversed(held))
    d = add("d", 12)
    blocks, hit, _ = m.get_computed_blocks(d)
    new = m.allocate_slots(d, 0, hit, blocks, num_external_computed_tokens=12,
                           delay_cache_blocks=True, num_encoder_tokens=20)  # an async KV load
    out.append(("load", None if new is None else new.get_block_ids()))
    m.cache_blocks(d, 12)
    out.append(_state(m, ["a", "c", "d"], 12))
    for r in ("a", "c", "d"):
        m.free(reqs[r])
    m.free(add("never", 3))  # freed before its first allocation: nothing
    out.append(_state(m, ["a"], 1))
    stats = m.make_prefix_cache_stats()
    out.append((stats.requests, stats.queries, stats.hits))
    return out


@pytest.mark.parametrize(("full_bs", "cross_bs", "num_blocks"),
                         [(16, 16, 40), (16, 32, 24), (32, 16, 40)])
def test_whisper_shaped_run_matches_vllm(full_bs: int, cross_bs: int, num_blocks: int) -> None:
    theirs, ours = _pair(num_blocks, full_bs, cross_bs)
    expected = _script(theirs)
    assert _script(ours) == expected
    assert any(step[0] == "admit" and step[-1] is None for step in expected
               if isinstance(step, tuple) and step and step[0] == "admit")  # a failed one
    ours.check_invariants()


def test_cross_attention_traces_match_vllm() -> None:
    """The differential suite's random traces with a cross-attention group (caching off,
    external loads, preemption, lookahead slots), through both managers."""
    traces = []
    seed = 0
    while len(traces) < 40:
        t = generate_trace(seed, pending=[])
        seed += 1
        if t["config"]["kind"] == "cross":
            traces.append(t)
    theirs = replay_all("vllm", traces)
    ours = replay_all("adapter", traces)
    assert not [o for obs in theirs for o in obs if "error" in o]
    assert sum(1 for obs in ours for o in obs if o.get("new")) > 200
    for t, x, y in zip(traces, ours, theirs):
        assert x == y, (t["seed"], next(i for i, (p, q) in enumerate(zip(x, y)) if p != q))


def test_views_find_the_cross_attention_group_as_vllm_does() -> None:
    """vLLM's scheduler tests find the encoder group by isinstance on vLLM's class."""
    _, ours = _pair(16)
    found = [g for g in ours.coordinator.single_type_managers
             if isinstance(g, CrossAttentionManager)]
    assert [g.kv_cache_group_id for g in found] == [1]
    assert isinstance(found[0].kv_cache_spec, CrossAttentionSpec)


def test_prefix_caching_with_cross_attention_is_refused() -> None:
    with pytest.raises(UnsupportedFeatureError, match="prefix caching with cross attention") \
            as info:
        KVCacheManagerAdapter(kv_config(full(), cross()), 4096, scheduler_block_size=16,
                              hash_block_size=16, enable_caching=True,
                              settings=KvcoreSettings())
    assert "groups [1]" in str(info.value) and "enable_prefix_caching=False" in str(info.value)
