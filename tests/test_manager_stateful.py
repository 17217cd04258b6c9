"""Hypothesis state machines over KVCacheManager: random admissions (with prefix hits), chunked
prefill, decode, preemption, re-admission, frees, resets and bad calls, for several group layouts.
After every step ``check_invariants()`` must pass; a ``None`` allocation must change nothing; every
non-null hit block must hold exactly the request's tokens (verify mode keeps them)."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcore import Request, UnknownRequestError
from kvcore.manager import KVCacheManager
from kvcore.specs import ChunkedLocalAttentionSpec, MambaSpec
from tests.factories import full_spec, make_manager, manager_snapshot, swa_spec

MAX_LEN = 64


class ManagerMachine(RuleBasedStateMachine):
    specs: tuple[object, ...] = ()
    num_blocks = 24
    enable_caching = True

    def __init__(self) -> None:
        super().__init__()
        self.m: KVCacheManager = make_manager(  # type: ignore[assignment]
            *self.specs, num_blocks=self.num_blocks, max_model_len=MAX_LEN, verify_hits=True,
            enable_caching=self.enable_caching)
        self.running: dict[str, Request] = {}
        self.preempted: list[Request] = []
        self.counter = 0

    def _check_hit(self, r: Request, blocks: object, hit: int) -> None:
        assert 0 <= hit <= r.num_tokens - 1
        for g, group_blocks in enumerate(blocks):  # type: ignore[attr-defined]
            bs = self.m.coordinator.managers[g].block_size
            for i, b in enumerate(group_blocks):
                if not b.is_null:
                    assert b.cached_token_ids == tuple(r.all_token_ids[i * bs:(i + 1) * bs])

    def _admit(self, r: Request, chunk: int) -> None:
        blocks, hit = self.m.get_computed_blocks(r)
        self._check_hit(r, blocks, hit)
        n = min(chunk, r.num_tokens - hit)
        before = manager_snapshot(self.m)
        out = self.m.allocate_slots(r, n, hit, blocks)
        if out is None:
            assert manager_snapshot(self.m) == before
            return
        r.num_computed_tokens = hit + n
        self.running[r.request_id] = r

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=40),
          chunk=st.integers(1, 40))
    def admit(self, tokens: list[int], chunk: int) -> None:
        self.counter += 1
        self._admit(self.m.make_request(f"r{self.counter}", tokens), chunk)

    @precondition(lambda self: bool(self.preempted))
    @rule(chunk=st.integers(1, 40))
    def readmit(self, chunk: int) -> None:
        self._admit(self.preempted.pop(0), chunk)

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        r = self.running[rid]
        if r.num_computed_tokens < r.num_tokens:  # prefill continues
            n = min(data.draw(st.integers(1, 16)), r.num_tokens - r.num_computed_tokens)
        else:  # decode: the sampled token becomes a new token to compute
            if r.num_tokens >= MAX_LEN:
                return
            r.append_output_token_ids(data.draw(st.integers(0, 2)))
            n = 1
        before = manager_snapshot(self.m)
        out = self.m.allocate_slots(r, n)
        if out is None:
            assert manager_snapshot(self.m) == before
            return
        r.num_computed_tokens += n

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data(), preempt=st.booleans())
    def free(self, data: st.DataObject, preempt: bool) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        r = self.running.pop(rid)
        self.m.free(r)
        if preempt:
            r.num_computed_tokens = 0
            r.num_preemptions += 1
            self.preempted.append(r)
        before = manager_snapshot(self.m)
        with pytest.raises(UnknownRequestError):
            self.m.free(r)
        assert manager_snapshot(self.m) == before

    @rule()
    def reset(self) -> None:
        assert self.m.reset_prefix_cache() == (not self.running)

    @rule()
    def new_step(self) -> None:
        self.m.new_step()

    @invariant()
    def invariants_hold(self) -> None:
        self.m.check_invariants()
        if not self.running:
            assert self.m.usage == 0.0
            assert self.m.num_free_blocks == self.num_blocks - 1


def _machine(name: str, specs: tuple[object, ...], **attrs: object) -> type:
    return type(name, (ManagerMachine,), {"specs": specs, **attrs})


def _mamba() -> MambaSpec:
    return MambaSpec(block_size=4, shapes=((2, 4),), dtypes=(torch.float32,))


def _chunked() -> ChunkedLocalAttentionSpec:
    return ChunkedLocalAttentionSpec(block_size=4, num_kv_heads=2, head_size=8,
                                     dtype=torch.float16, attention_chunk_size=12)


TestUnitaryFull = _machine("UnitaryFull", (full_spec(4),)).TestCase
TestSlidingWindow = _machine("SlidingWindow", (swa_spec(7, 4),)).TestCase
TestHybridFullSlidingDifferentBlockSizes = _machine(
    "HybridFullSliding", (full_spec(4), swa_spec(12, 8)), num_blocks=32).TestCase
TestHybridFullMamba = _machine("HybridFullMamba", (full_spec(4), _mamba()), num_blocks=32).TestCase
TestChunkedLocal = _machine("ChunkedLocal", (_chunked(),)).TestCase
TestNoPrefixCacheHybrid = _machine("NoCache", (full_spec(4), swa_spec(8, 4)), num_blocks=32,
                                   enable_caching=False).TestCase
