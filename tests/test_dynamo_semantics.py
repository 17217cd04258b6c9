"""kvcore's model of Dynamo's indexer rules, the barrier's marker blocks, the router's
accounting and what happens without the package — none of it needs Dynamo installed
(``tests/test_dynamo_interop.py`` runs the real indexer)."""

from __future__ import annotations

import json

import pytest

from kvcore.cli import main as kvcore_main
from kvcore.cluster import KVRoutingIndex, make_router
from kvcore.cluster.dynamo import (
    INSTALL_HINT,
    PACKAGE,
    DynamoIndexer,
    DynamoSemantics,
    DynamoUnavailableError,
    require_dynamo,
)
from kvcore.cluster.dynamo import indexer as indexer_module
from kvcore.cluster.dynamo.feed import marker_hash, marker_tokens
from kvcore.errors import InvalidArgumentError
from kvcore.sim.cluster import ClusterConfig, ClusterResult, ReplicaResult, replay_cluster
from kvcore.sim.cluster_report import dynamo_lines, router_table
from kvcore.sim.replay import ReplayConfig
from kvcore.sim.workloads import multi_turn
from tests.dynamo_scenarios import KEYS, SCENARIOS, Scenario
from tests.factories import run_main


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_the_model_applies_dynamos_rules(scenario: Scenario) -> None:
    model, index = DynamoSemantics(), KVRoutingIndex()
    for batch in scenario.batches:
        model.apply_events("w", batch)
        index.apply_events("w", batch)
    assert model.match(KEYS).get("w", 0) == scenario.dynamo_blocks
    assert index.match(KEYS).get("w", (0, 0.0))[0] == scenario.kvcore_blocks
    if scenario.dynamo_blocks < scenario.kvcore_blocks:
        assert model.why_missing("w", KEYS[scenario.dynamo_blocks]) == scenario.why
    else:
        assert scenario.why is None


def test_why_missing_is_forgotten_when_the_pool_drops_the_block_too() -> None:
    model = DynamoSemantics()
    scenario = next(s for s in SCENARIOS if s.why == "copies")
    for batch in scenario.batches:
        model.apply_events(0, batch)
    assert model.why_missing(0, 1) == "copies"
    model.apply_events(0, [scenario.batches[-1][0]])  # the last copy goes as well
    assert model.why_missing(0, 1) is None and model.match(KEYS) == {}


def test_marker_blocks_are_unlike_any_prompt() -> None:
    tokens = marker_tokens(7, 4)
    assert len(tokens) == 4 and all(t >= 0xC000_0000 for t in tokens)
    assert marker_tokens(8, 4) != tokens and marker_tokens(7, 1) == tokens[:1]
    assert marker_hash(7) != marker_hash(8) and 0 <= marker_hash(7) < 1 << 64


def test_the_report_names_the_router_and_its_disagreements() -> None:
    dynamo = {"disagreements": {"queries": 10, "agreed": 7, "kvcore_more": 4, "dynamo_more": 0,
                                "by_cause": {"copies": 3, "orphan": 1}, "unpredicted": 0,
                                "decisions_changed": 2},
              "start_s": 0.3, "queries": 25, "barriers": 9, "barrier_polls": 14,
              "barrier_s": 0.5}
    lines = dynamo_lines(dynamo)
    assert "7 of 10 lookups agreed" in lines[1] and "3 copies, 1 orphan" in lines[1]
    assert "2 requests elsewhere" in lines[2]
    rows = []
    for name, rate, report in (("dynamo", 0.5, dynamo), ("round-robin", 0.25, None)):
        rows.append(ClusterResult(
            num_replicas=2, router=name, num_requests=4, num_finished=4, num_rejected=0,
            prompt_tokens=100, hit_tokens=int(rate * 100), token_hit_rate=rate,
            host_hit_tokens=0, host_hit_rate=0.0, imbalance=1.0, ttft_ms_median=5.0,
            ttft_ms_p99=9.0, sim_time_ms=1.0, event_batches=1, event_bytes=1, index_blocks=1,
            wall_s=1.5, replicas=[ReplicaResult(requests=3), ReplicaResult(requests=1)],
            dynamo=report))
    table = router_table(rows)
    assert "50.00%" in table[1] and "3/1" in table[1] and "3 of 10 lookups" in table[1]
    assert table[2].split()[:2] == ["round-robin", "25.00%"] and table[2].endswith("-")


def test_without_the_package_the_error_names_it(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(indexer_module, "dynamo_available", lambda: False)
    with pytest.raises(DynamoUnavailableError, match=f"{PACKAGE}.*kvcore\\[dynamo\\]"):
        require_dynamo()
    with pytest.raises(DynamoUnavailableError, match=PACKAGE):
        DynamoIndexer().start()
    reqs = multi_turn(num_conversations=2, turns=2)
    with pytest.raises(DynamoUnavailableError, match=PACKAGE):
        replay_cluster(reqs, ReplayConfig(), ClusterConfig(2, "dynamo"))
    # The command line says so before replaying anything, also with other routers listed.
    code, out, err = run_main(kvcore_main, capsys, "replay", "--workload", "multi-turn",
                              "--replicas", "2", "--router", "prefix,dynamo")
    assert code == 2 and PACKAGE in err and INSTALL_HINT in err and "replayed" not in out


def test_router_names_and_options_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(InvalidArgumentError, match="needs a running Dynamo indexer"):
        make_router("dynamo", KVRoutingIndex())
    with pytest.raises(InvalidArgumentError, match="host tier"):
        replay_cluster(multi_turn(num_conversations=2, turns=2), ReplayConfig(host_blocks=8),
                       ClusterConfig(2, "dynamo"))
    with pytest.raises(InvalidArgumentError, match="threads"):
        DynamoIndexer(threads=0)
    for bad, says in (("prefix,nearest", "unknown router 'nearest'"),
                      ("prefix,prefix", "named twice"), (",", "no router")):
        code, _, err = run_main(kvcore_main, capsys, "replay", "--replicas", "2",
                                "--router", bad)
        assert code == 2 and says in err, err


def test_several_routers_replay_the_same_trace(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_main(kvcore_main, capsys, "replay", "--workload", "multi-turn",
                            "--replicas", "3", "--router", "prefix,round-robin", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["router"] == "prefix" and list(data["routers"]) == ["prefix", "round-robin"]
    assert data["replay"] == data["routers"]["prefix"]
    rates = {name: r["token_hit_rate"] for name, r in data["routers"].items()}
    assert rates["prefix"] > rates["round-robin"] > 0
    assert all(r["dynamo"] is None for r in data["routers"].values())
    code, out, _ = run_main(kvcore_main, capsys, "replay", "--workload", "multi-turn",
                            "--replicas", "3", "--router", "prefix,round-robin")
    assert code == 0 and "routers on workload:multi-turn, 3 replicas" in out
    assert out.count("router prefix:") == 1 and out.count("router round-robin:") == 1
