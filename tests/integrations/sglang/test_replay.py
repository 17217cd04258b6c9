"""The no-model replay through SGLang's scheduling pieces: its JSON (a ``results`` list, one
entry per engine with ``engine`` and ``hit_rate``), SGLang's and kvcore's engines side by side
on one workload, both schedule policies."""

from __future__ import annotations

import json

import pytest

from kvcore.integrations.sglang.replay import main


@pytest.mark.parametrize(("policy", "engines"), [
    ("fcfs", ["sglang:lru", "sglang:lfu", "kvcore:lru", "kvcore:recommended"]),
    ("lpm", ["sglang:lru", "kvcore:lru"]),
])
def test_replay_json(policy: str, engines: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["shared-prefix", "--block-size", "16", "--num-blocks", "160",
                 "--max-requests", "40", "--schedule-policy", policy,
                 "--engines", ",".join(engines), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    results = {r["engine"]: r for r in out["results"]}
    assert list(results) == engines
    for r in results.values():
        assert 0.0 < r["hit_rate"] < 1.0
        assert r["finished"] == 40 and r["evicted_tokens"] > 0  # under memory pressure
        assert r["hit_rate"] == pytest.approx(r["hit_tokens"] / r["prompt_tokens"])
    # Page-exact eviction keeps at least what SGLang's leaf eviction keeps, on this workload.
    assert results["kvcore:lru"]["hit_rate"] >= results["sglang:lru"]["hit_rate"] - 0.01


def test_replay_refuses_an_unknown_engine(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["shared-prefix", "--max-requests", "4", "--engines", "vllm"]) == 2
    assert "sglang:POLICY or kvcore:POLICY" in capsys.readouterr().err
