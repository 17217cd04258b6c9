"""The differential suite's random operation traces (tests/differential) through kvcore behind
the vLLM adapter and through vLLM's own KVCacheManager, both driven with vLLM's requests in this
process: identical hits and hit block ids, new block ids, tables, free queue in eviction order,
KV events (vLLM's types, hashes converted as vLLM converts them) and prefix-cache stats after
every operation, on the installed vLLM (0.32 or 0.33; on 0.33 half the EAGLE traces use its
lookahead hashes instead of the block drop), plus the block ids recorded for zeroing (Mamba
"align" traces: hybrid models need it).  Trace kinds the adapter refuses or vLLM 0.33 does not
run (kvcore's own Mamba "none" traces, with caching) are left out; cross-attention traces
(caching off, as vLLM requires for them) are in.  Where vLLM's own manager crashes on a Mamba
admission with externally computed tokens (it undercounts them;
docs/vllm_mamba_external_undercount_bug.md) and kvcore refuses that admission, the trace is
compared up to there.

On 0.33 kvcore's own manager (its own hashing, lookahead included) is compared with vLLM's on
the lookahead traces too.

vLLM's scratch groups (never prefix cached) get traces of their own (``SCRATCH_KINDS``: full
attention with a sliding window rebuilt by bounded replay, with a circular buffer, and with
both), each op driven as vLLM's scheduler drives replay (tests/differential/replay.py), through
the adapter and through kvcore's own manager against vLLM's, on both versions."""

from __future__ import annotations

import os
from typing import Any

import pytest

from kvcore.integrations.vllm.version import installed
from tests.differential.replay import cut_at_vllm_undercount, replay_all
from tests.differential.traces import PARTIAL_KINDS, SCRATCH_KINDS, SPEC_KINDS, generate_trace

NUM_TRACES = int(os.environ.get("KVCORE_DIFF_TRACES", "400"))
NUM_SCRATCH_TRACES = int(os.environ.get("KVCORE_DIFF_SCRATCH_TRACES", "200"))
NUM_SPEC_TRACES = int(os.environ.get("KVCORE_DIFF_SPEC_TRACES", "120"))
REFUSED = {"mamba", "hybrid_mamba"}  # Mamba "none" with prefix caching
VERSION = installed()


@pytest.fixture(scope="module")
def traces() -> list[dict[str, Any]]:
    out = [generate_trace(seed, pending=[], lookahead_hashes=VERSION.lookahead_hashes,
                          vllm=f"{VERSION.major}.{VERSION.minor}")
           for seed in range(NUM_TRACES)]
    for t in out:
        t["config"]["vllm"] = f"{VERSION.major}.{VERSION.minor}"
        t["config"]["observe_zeroing"] = True  # vLLM's block zeroing (Mamba models)
    return [t for t in out if t["config"]["kind"] not in REFUSED]


def _differences(traces: list[dict[str, Any]], ours: list[Any], theirs: list[Any]) -> list[Any]:
    out = []
    for t, x, y in zip(traces, ours, theirs):
        x, y, _ = cut_at_vllm_undercount(t, x, y)
        if x != y:
            out.append((t["seed"], t["config"]["kind"], next(
                ((i, a, b) for i, (a, b) in enumerate(zip(x, y)) if a != b),
                ("length", len(x), len(y)))))
    return out


def test_adapter_matches_vllm_on_every_trace(traces: list[dict[str, Any]]) -> None:
    assert len(traces) > NUM_TRACES // 2
    theirs = replay_all("vllm", traces)
    ours = replay_all("adapter", traces)
    failures = _differences(traces, ours, theirs)
    errors = [o["error"] for t, x, y in zip(traces, ours, theirs)
              for o in cut_at_vllm_undercount(t, x, y)[1] if "error" in o]
    assert not errors, f"vLLM raised on {len(errors)} traces: {errors[:3]}"
    hits = sum(1 for obs in ours for o in obs if o.get("hit", 0) > 0)
    events = sum(1 for obs in ours for o in obs if o.get("events"))
    assert hits > 100 and events > 100
    assert not failures, f"{len(failures)} traces differ; first: {failures[0]}"
    if VERSION.lookahead_hashes:
        assert sum(1 for t in traces if t["config"].get("lookahead")) > 20


def test_adapter_matches_vllm_with_a_prefix_match_unit() -> None:
    """vLLM's prefix_match_unit finer than every block (hashes every 2 tokens) on hybrid
    attention models without Mamba "align" groups: hits stay on block boundaries and partial
    prompt tails are registered at the unit, in kvcore as in vLLM."""
    traces = [generate_trace(seed, pending=[], lookahead_hashes=VERSION.lookahead_hashes,
                             vllm=f"{VERSION.major}.{VERSION.minor}",
                             kinds=["hybrid", "hybrid_bs", "hybrid_partial"],
                             extra={"prefix_match_unit": 2})
              for seed in range(NUM_TRACES // 8)]
    theirs = replay_all("vllm", traces)
    ours = replay_all("adapter", traces)
    assert sum(1 for obs in ours for o in obs if o.get("hit", 0) > 0) > 20
    failures = _differences(traces, ours, theirs)
    assert not failures, f"{len(failures)} traces differ; first: {failures[0]}"


def test_adapter_matches_vllm_with_partial_block_hits() -> None:
    """vLLM's partial hash hits (a Mamba "align" group, half with Mamba2's prefill checkpoint,
    and full attention of 8 or 12 tokens, hashed every 2, 3, 4 or 6; EAGLE on some): hits
    ending inside a block, the copy-on-write of the shared tail (the block copies recorded per
    op), a producer's partial prompt tail moved to its copy, checkpoints keyed at any unit, in
    kvcore behind the adapter and in kvcore's own manager as in vLLM."""
    traces = [generate_trace(seed, pending=[], lookahead_hashes=VERSION.lookahead_hashes,
                             vllm=f"{VERSION.major}.{VERSION.minor}", kinds=PARTIAL_KINDS)
              for seed in range(NUM_TRACES // 8)]
    for t in traces:
        t["config"]["observe_zeroing"] = True
    theirs = replay_all("vllm", traces)
    ours = replay_all("adapter", traces)
    assert sum(1 for obs in theirs for o in obs if o.get("copies")) > 20
    assert sum(1 for obs in ours for o in obs if o.get("hit", 0) % 2) > 0 or any(
        o.get("hit", 0) % 4 for obs in ours for o in obs)
    failures = _differences(traces, ours, theirs)
    assert not failures, f"{len(failures)} traces differ; first: {failures[0]}"
    # kvcore's own manager (it records no blocks for zeroing: compared without them).
    own = replay_all("kvcore", traces)
    unzeroed = [[{k: v for k, v in o.items() if k != "zeroed"} for o in obs] for obs in theirs]
    failures = _differences(traces, own, unzeroed)
    assert not failures, f"kvcore's own manager: {len(failures)} traces differ: {failures[0]}"


@pytest.mark.skipif(not VERSION.lookahead_hashes,
                    reason="lookahead hashes exist from vLLM 0.33 (0.32 refuses them: "
                           "test_adapter.py)")
def test_kvcores_own_lookahead_hashing_matches_vllm(traces: list[dict[str, Any]]) -> None:
    """kvcore's own manager and requests (kvcore's hash function, its lookahead hashing, its
    events' window extra keys and lookahead tokens) against vLLM 0.33's."""
    ahead = [t for t in traces if t["config"].get("lookahead")]
    assert len(ahead) > 20
    theirs = replay_all("vllm", ahead)
    ours = replay_all("kvcore", ahead)
    stored = sum(1 for obs in ours for o in obs for e in o.get("events", ())
                 if e[0] == "stored" and e[-1])
    assert stored > 50  # events with lookahead tokens were compared
    failures = _differences(ahead, ours, theirs)
    assert not failures, f"{len(failures)} traces differ; first: {failures[0]}"


def _replay_kinds(kinds: Any, count: int, impl: str) -> tuple[list[Any], list[Any], list[Any]]:
    """``count`` traces of ``kinds`` for the installed vLLM, replayed by vLLM's manager and by
    ``impl``: (traces, ours, theirs), after asserting that vLLM raised on none."""
    version = f"{VERSION.major}.{VERSION.minor}"
    traces = [generate_trace(seed, pending=[], vllm=version, kinds=kinds)
              for seed in range(count)]
    for t in traces:
        t["config"]["vllm"] = version
    theirs = replay_all("vllm", traces)
    ours = replay_all(impl, traces)
    errors = [o["error"] for obs in theirs for o in obs if "error" in o]
    assert not errors, f"vLLM raised on {len(errors)} traces: {errors[:3]}"
    return traces, ours, theirs


@pytest.mark.parametrize("impl", ["adapter", "kvcore"])
def test_scratch_groups_match_vllm_on_every_trace(impl: str) -> None:
    """Bounded replay and circular buffers: identical observations after every op, with hits
    replayed, hits no longer than the window dropped and external tokens cut to whole blocks
    as vLLM's scheduler does."""
    traces, ours, theirs = _replay_kinds(SCRATCH_KINDS, NUM_SCRATCH_TRACES, impl)
    kinds = {t["config"]["kind"] for t in traces}
    assert kinds == set(SCRATCH_KINDS)
    replays = sum(1 for obs in ours for o in obs if o.get("replay"))
    hits = sum(1 for obs in ours for o in obs if o.get("hit", 0) > 0)
    assert replays > 50 and hits > 100
    failures = _differences(traces, ours, theirs)
    assert not failures, f"{len(failures)} traces differ; first: {failures[0]}"


@pytest.mark.parametrize("impl", ["adapter", "kvcore"])
def test_partial_eagle_and_retained_windows_match_vllm_on_every_trace(impl: str) -> None:
    """An EAGLE block drop in some groups only (vLLM's ``is_eagle_group``; kvcore's
    ``CacheSettings.eagle_groups``) and sliding windows that retain extra tokens (vLLM's
    ``extra_retained_tokens``), as vLLM's offloading connector tests set them: identical
    observations after every op."""
    traces, ours, theirs = _replay_kinds(SPEC_KINDS, NUM_SPEC_TRACES, impl)
    configs = [t["config"] for t in traces]
    # Both kinds, and among the EAGLE ones each group dropping alone.
    assert {c["kind"] for c in configs} == set(SPEC_KINDS)
    assert {tuple(c["eagle_groups"]) for c in configs if "eagle_groups" in c} >= {(0,), (1,)}
    hits = sum(1 for obs in ours for o in obs if o.get("hit", 0) > 0)
    assert hits > 100
    failures = _differences(traces, ours, theirs)
    assert not failures, f"{len(failures)} traces differ; first: {failures[0]}"
