"""The admission watermark, KV-cache residency metrics and prompt-embedding digests in KV
events, through kvcore's adapter and through vLLM's own KVCacheManager, call for call.

The differential suite's random traces (tests/differential), generated with a watermark (5-25%
of the pool; vLLM's request states and ``has_scheduled_reqs`` set as its scheduler sets them),
a residency-metrics collector (vLLM's ``KVCacheMetricsCollector`` at sample rate 1, recording
every call the pool makes on it) and, on half of them, vLLM requests with prompt embeddings
instead of prompt tokens: identical hits, block ids, tables, free queue, events (the digests in
their extra keys included), collector calls and eviction records after every operation, on the
installed vLLM (0.32 or 0.33).  vLLM's real scheduler with all three:
test_scheduler_replay.py."""

from __future__ import annotations

import os
import random
from typing import Any

import pytest

from kvcore.errors import InvalidArgumentError
from kvcore.integrations.vllm.manager import KVCacheManagerAdapter
from kvcore.integrations.vllm.version import installed
from tests.differential.replay import cut_at_vllm_undercount, replay_all
from tests.differential.traces import generate_trace
from tests.integrations.vllm.helpers import full, kv_config

NUM_TRACES = int(os.environ.get("KVCORE_DIFF_TRACES_FEATURES", "160"))
REFUSED = {"mamba", "hybrid_mamba"}
VERSION = installed()


@pytest.fixture(scope="module")
def traces() -> list[dict[str, Any]]:
    out = []
    for seed in range(NUM_TRACES):
        rng = random.Random(10_000 + seed)
        extra = {"watermark": rng.choice([0.05, 0.1, 0.25]), "metrics": True,
                 "embeds": seed % 2 == 1}
        t = generate_trace(10_000 + seed, pending=[], lookahead_hashes=VERSION.lookahead_hashes,
                           vllm=f"{VERSION.major}.{VERSION.minor}", extra=extra)
        t["config"]["observe_zeroing"] = True
        out.append(t)
    return [t for t in out if t["config"]["kind"] not in REFUSED]


def test_adapter_matches_vllm_call_for_call(traces: list[dict[str, Any]]) -> None:
    theirs = replay_all("vllm", traces)
    ours = replay_all("adapter", traces)
    failures = []
    for t, x, y in zip(traces, ours, theirs):
        x, y, _ = cut_at_vllm_undercount(t, x, y)
        assert not [o for o in y if "error" in o], (t["seed"], y[-1])
        if x != y:
            failures.append((t["seed"], t["config"]["kind"], next(
                ((i, a, b) for i, (a, b) in enumerate(zip(x, y)) if a != b),
                ("length", len(x), len(y)))))
    assert not failures, f"{len(failures)} traces differ; first: {failures[0]}"
    # What was compared: admissions the watermark refused, every kind of collector call and
    # eviction records, and events carrying prompt-embedding digests.
    calls = {c[0] for obs in ours for o in obs for c in o.get("metrics", ())}
    assert {"allocated", "accessed", "evicted", "evictions"} <= calls
    digests = sum(1 for t, obs in zip(traces, ours) if t["config"]["embeds"] for o in obs
                  for e in o.get("events", ()) if e[0] == "stored" and e[6]
                  and any(k and isinstance(k[-1], bytes) for k in e[6]))
    assert digests > 50
    refused = sum(1 for obs in ours for o in obs if o["op"] == "admit" and o["new"] is None)
    assert refused > 50


def test_the_watermark_is_kept_only_for_admissions_while_others_run() -> None:
    """Pool of 10 (9 usable), watermark 0.3 (3 blocks): a waiting request needing 7 blocks is
    refused while another is scheduled, admitted when none is; a running one grows into the
    watermark; a negative watermark is refused naming it."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request, RequestStatus

    m = KVCacheManagerAdapter(kv_config(full(4), num_blocks=10), 256, scheduler_block_size=4,
                              hash_block_size=4, watermark=0.3)
    assert m.watermark_blocks == 3
    params = SamplingParams(max_tokens=8)
    a = Request("a", list(range(28)), params, None)
    assert m.allocate_slots(a, 28, has_scheduled_reqs=True) is None  # 7 + 3 > 9
    assert m.allocate_slots(a, 28, has_scheduled_reqs=False) is not None
    a.status = RequestStatus.RUNNING
    a.num_computed_tokens = 28
    a.append_output_token_ids(1)
    assert m.allocate_slots(a, 1) is not None  # running: 1 + 0 <= 2
    b = Request("b", list(range(4)), params, None)
    b.status = RequestStatus.PREEMPTED
    assert m.allocate_slots(b, 4) is None  # 1 + 3 > 1
    with pytest.raises(InvalidArgumentError, match=r"-0\.1"):
        KVCacheManagerAdapter(kv_config(full(4), num_blocks=10), 256, scheduler_block_size=4,
                              hash_block_size=4, watermark=-0.1)
    with pytest.raises(InvalidArgumentError, match="on_block_allocated"):  # not a collector
        KVCacheManagerAdapter(kv_config(full(4), num_blocks=10), 256, scheduler_block_size=4,
                              hash_block_size=4, metrics_collector=object())


def test_kvcores_own_manager_matches_vllm(traces: list[dict[str, Any]]) -> None:
    """kvcore's own manager and requests (its own hashing; the watermark passed as
    ``allocate_slots(watermark_blocks=...)``, its pool observer given the collector's calls)
    against vLLM's, on the traces without prompt embeddings (kvcore's requests have none)."""
    plain = [t for t in traces if not t["config"]["embeds"]]
    theirs = replay_all("vllm", plain)
    ours = replay_all("kvcore", plain)
    failures = []
    for t, x, y in zip(plain, ours, theirs):
        x, y, _ = cut_at_vllm_undercount(t, x, y)
        # kvcore's own recorder has no eviction records (vLLM's collector makes them).
        y = [{**o, "metrics": [c for c in o["metrics"] if c[0] != "evictions"]}
             if "metrics" in o else o for o in y]
        y = [{k: v for k, v in o.items() if not (k == "metrics" and not v)} for o in y]
        x = [{k: v for k, v in o.items() if k != "zeroed"} for o in x]
        y = [{k: v for k, v in o.items() if k != "zeroed"} for o in y]
        if x != y:
            failures.append((t["seed"], t["config"]["kind"], next(
                ((i, a, b) for i, (a, b) in enumerate(zip(x, y)) if a != b),
                ("length", len(x), len(y)))))
    assert not failures, f"{len(failures)} traces differ; first: {failures[0]}"
