"""NVIDIA Dynamo's KV indexer (``ai-dynamo-runtime``, ``python -m dynamo.indexer``) reads
kvcore's ZeroMQ publishers: its answers equal kvcore's index on every query of a seeded run,
kvcore's model of its rules predicts it, and ``--router dynamo`` routes a cluster replay.

Needs the package (``pip install -e '.[dynamo]'``; CI installs it): without it these tests are
skipped, with a summary line, except under CI (``CI`` set), where that is a failure.
"""

from __future__ import annotations

import json
import os
import random
import sys
from collections.abc import Iterator

import pytest

import kvcore.cluster.dynamo.indexer as indexer_module
from kvcore.cli import main as kvcore_main
from kvcore.cluster import EventChannel, KVRoutingIndex, request_keys
from kvcore.cluster.dynamo import (
    DynamoFeed,
    DynamoIndexer,
    DynamoIndexerError,
    DynamoSemantics,
    dynamo_available,
)
from kvcore.errors import InvalidArgumentError
from kvcore.events import AllBlocksCleared, BlockRemoved, KVCacheEvent
from kvcore.events.publisher import ZmqEventPublisher, to_external
from kvcore.sim.cluster import ClusterConfig, replay_cluster
from kvcore.sim.replay import ReplayConfig
from kvcore.sim.traces import TraceRequest
from kvcore.sim.workloads import multi_turn
from tests.conftest import DYNAMO_INSTALL
from tests.dynamo_scenarios import BLOCK_SIZE, KEYS, SCENARIOS, TOKENS
from tests.factories import admit, full_spec, make_manager, run_main
from tests.proc_tree import LINUX_ONLY, descendants, listening
from tests.test_publisher import LOCAL, wait_until_published


@pytest.fixture(autouse=True)
def _needs_dynamo() -> None:
    if not dynamo_available():
        msg = f"ai-dynamo-runtime is not installed: {DYNAMO_INSTALL}"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)


@pytest.fixture
def indexer() -> Iterator[DynamoIndexer]:
    with DynamoIndexer() as ix:
        yield ix
    assert not ix.running


def test_the_real_indexer_follows_the_modelled_rules(indexer: DynamoIndexer) -> None:
    """Each scenario of tests/dynamo_scenarios.py on its own worker, map and array encodings."""
    encodings = ["map" if i % 2 else "array" for i in range(len(SCENARIOS))]
    with DynamoFeed.open(indexer, len(SCENARIOS), BLOCK_SIZE, encoding=encodings) as feed:
        feed.barrier()
        model = DynamoSemantics()
        for worker, scenario in enumerate(SCENARIOS):
            for batch in scenario.batches:
                feed.publish(worker, batch)
                model.apply_events(worker, batch)
        feed.barrier()
        got = {w: tokens // BLOCK_SIZE for w, tokens in indexer.query(TOKENS).items()}
    expected = {w: s.dynamo_blocks for w, s in enumerate(SCENARIOS) if s.dynamo_blocks}
    assert got == expected == model.match(KEYS), [
        (s.name, got.get(w, 0), s.dynamo_blocks) for w, s in enumerate(SCENARIOS)
        if got.get(w, 0) != s.dynamo_blocks]


def as_published(batch: list[KVCacheEvent]) -> list[KVCacheEvent]:
    """The batch with 64-bit int hashes, as the publisher sends it (the model's input)."""
    return [to_external(e, True) for e in batch]


def seeded_run(seed: int, num_steps: int) -> list[tuple[int, list[KVCacheEvent], list[int]]]:
    """(replica, events, prompt) per step: three managers serve prompts that share prefixes
    one at a time (no duplicate copies), with evictions, and replica 1 resets half way."""
    rng = random.Random(seed)
    managers = [make_manager(full_spec(BLOCK_SIZE), num_blocks=24, enable_events=True)
                for _ in range(3)]
    prefixes = [[rng.randrange(5000) for _ in range(12)] for _ in range(6)]
    steps = []
    for step in range(num_steps):
        replica = rng.randrange(3)
        manager = managers[replica]
        prompt = rng.choice(prefixes)[:rng.choice((4, 8, 12))] + [
            rng.randrange(5000) for _ in range(rng.randrange(1, 14))]
        request = manager.make_request(f"s{step}", prompt)
        assert admit(manager, request) is not None
        manager.free(request)
        steps.append((replica, manager.take_events(), prompt))
        if step == num_steps // 2:
            assert managers[1].reset_prefix_cache()
            steps.append((1, managers[1].take_events(), prompt))
    return steps


def test_dynamo_equals_kvcores_index_on_every_query_of_a_seeded_run() -> None:
    """Three publishers (map, array, map); the indexer joins after the first 40 batches and
    recovers them through the replay sockets; after every batch both indexes answer three
    prompts (the one just served and two earlier ones) identically."""
    steps = seeded_run(seed=35, num_steps=320)
    events = [e for _, batch, _ in steps for e in batch]
    assert any(isinstance(e, BlockRemoved) for e in events)
    assert any(isinstance(e, AllBlocksCleared) for e in events)
    hasher = make_manager(full_spec(BLOCK_SIZE), enable_events=True)  # hashes as the replicas
    index, model = KVRoutingIndex(), DynamoSemantics()
    channels = [EventChannel(index, r) for r in range(3)]
    publishers = [ZmqEventPublisher(LOCAL, LOCAL, encoding=enc)
                  for enc in ("map", "array", "map")]
    late = 40
    for replica, batch, _ in steps[:late]:  # before the indexer exists: only replay has them
        publishers[replica].publish(batch)
        channels[replica].publish(batch)
        model.apply_events(replica, as_published(batch))
    for replica, pub in enumerate(publishers):
        wait_until_published(pub, channels[replica].seq)
    queries = agreed_nonempty = recovered = 0
    with DynamoIndexer() as indexer, DynamoFeed(indexer, publishers, BLOCK_SIZE) as feed:
        for i in range(late, len(steps) + 1):
            feed.barrier()
            asked = [steps[j][2] for j in (i - 1, i // 2, i // 3)]
            for prompt in asked:
                keys = request_keys(hasher.make_request(f"q{queries}", prompt).block_hashes,
                                    len(prompt), BLOCK_SIZE)
                if not keys:
                    continue
                theirs = {r: t // BLOCK_SIZE for r, t in
                          indexer.query(prompt[:len(keys) * BLOCK_SIZE]).items()}
                ours = {r: n for r, (n, _) in index.match(keys).items()}
                assert theirs == ours == model.match(keys), (i, prompt)
                queries += 1
                agreed_nonempty += bool(ours)
                recovered += i == late and bool(ours)  # only the replay sockets had them
            if i < len(steps):
                replica, batch, _ = steps[i]
                feed.publish(replica, batch)
                channels[replica].publish(batch)
                model.apply_events(replica, as_published(batch))
    assert queries == 3 * (len(steps) - late + 1) and recovered > 0
    assert agreed_nonempty >= queries // 2, (queries, agreed_nonempty)
    assert len(events) >= 800


def test_dynamo_routes_the_replay_exactly_as_kvcores_index() -> None:
    """Same decisions, same hits, as --router prefix where the two indexes agree."""
    reqs = multi_turn(num_conversations=15, turns=6)
    cfg = ReplayConfig(block_size=16, num_blocks=400, max_num_seqs=16)
    prefix = replay_cluster(reqs, cfg, ClusterConfig(4, "prefix"))
    dynamo = replay_cluster(reqs, cfg, ClusterConfig(4, "dynamo"))
    assert dynamo.router == "dynamo" and dynamo.dynamo is not None
    assert [r.requests for r in dynamo.replicas] == [r.requests for r in prefix.replicas]
    assert (dynamo.hit_tokens, dynamo.num_finished) == (prefix.hit_tokens, len(reqs))
    d = dynamo.dynamo["disagreements"]
    assert d["queries"] == d["agreed"] > 0 and d["decisions_changed"] == d["unpredicted"] == 0
    assert dynamo.dynamo["barriers"] >= d["queries"] and dynamo.dynamo["queries"] > d["queries"]


def repeated_prompts(seed: int = 0, groups: int = 6, rounds: int = 6) -> list[TraceRequest]:
    """Prompts of exactly four 16-token blocks, each served again later: the repeat cannot hit
    its last block (the last prompt token is always computed), so it caches a second copy."""
    rng = random.Random(seed)
    prompts = [tuple(rng.randrange(32000) for _ in range(64)) for _ in range(groups)]
    out = []
    for k in range(rounds):
        for g in range(groups):
            for c in range(2):
                p = prompts[g] + (tuple(rng.randrange(32000) for _ in range(rng.randrange(1, 30)))
                                  if c else ())
                out.append(TraceRequest(f"r{k}-{g}-{c}", k * 500.0 + g * 50 + c * 20, len(p),
                                        4, prompt=p))
    return out


def test_disagreements_are_counted_and_named() -> None:
    """Duplicate copies: kvcore's index still holds a block whose other copy was evicted,
    Dynamo does not; the replay counts each such lookup and names the cause."""
    cfg = ReplayConfig(block_size=16, num_blocks=30, max_num_seqs=8)
    result = replay_cluster(repeated_prompts(), cfg, ClusterConfig(2, "dynamo"))
    d = result.dynamo["disagreements"] if result.dynamo else {}
    assert d["kvcore_more"] > 0 and d["by_cause"] == {"copies": d["kvcore_more"]}
    assert d["dynamo_more"] == d["unpredicted"] == 0
    assert d["agreed"] < d["queries"]


def test_cli_router_dynamo_next_to_the_others(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_main(kvcore_main, capsys, "replay", "--workload", "multi-turn",
                            "--replicas", "3", "--router", "dynamo,prefix,round-robin",
                            "--json")
    assert code == 0
    data = json.loads(out)
    assert list(data["routers"]) == ["dynamo", "prefix", "round-robin"]
    runs = data["routers"]
    assert runs["dynamo"]["dynamo"]["disagreements"]["queries"] > 0
    assert runs["dynamo"]["token_hit_rate"] == runs["prefix"]["token_hit_rate"]
    assert runs["prefix"]["token_hit_rate"] > runs["round-robin"]["token_hit_rate"]
    code, out, _ = run_main(kvcore_main, capsys, "replay", "--workload", "multi-turn",
                            "--replicas", "2", "--router", "dynamo")
    assert code == 0 and "router dynamo" in out and "Dynamo indexer:  started" in out
    assert "lookups agreed on every replica" in out


def test_the_indexer_process_is_stopped_on_errors_and_interrupts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[DynamoIndexer] = []
    real_start = DynamoIndexer.start

    def start(self: DynamoIndexer) -> DynamoIndexer:
        started.append(self)
        return real_start(self)

    monkeypatch.setattr(DynamoIndexer, "start", start)
    reqs = multi_turn(num_conversations=6, turns=4)
    asked = 0

    def second_ctrl_c() -> bool:  # the replay does not end cleanly: KeyboardInterrupt
        nonlocal asked
        asked += 1
        if asked == 50:
            raise KeyboardInterrupt
        return False

    with pytest.raises(KeyboardInterrupt):
        replay_cluster(reqs, ReplayConfig(), ClusterConfig(2, "dynamo"),
                       should_stop=second_ctrl_c)
    assert len(started) == 1 and not started[0].running
    asked = 0

    def first_ctrl_c() -> bool:  # the replay stops at its next event, partial results
        nonlocal asked
        asked += 1
        return asked > 50

    result = replay_cluster(reqs, ReplayConfig(), ClusterConfig(2, "dynamo"),
                            should_stop=first_ctrl_c)
    assert result.interrupted and result.num_finished < len(reqs)
    assert len(started) == 2 and not started[1].running and result.dynamo is not None


def test_an_indexer_that_cannot_start_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    ix = DynamoIndexer()
    monkeypatch.setattr(sys, "executable", "/bin/false")  # exits at once
    with pytest.raises(DynamoIndexerError, match="did not start"):
        ix.start()
    assert not ix.running


@LINUX_ONLY
def test_the_indexer_listens_on_loopback_unless_asked_otherwise(indexer: DynamoIndexer) -> None:
    assert indexer._proc is not None
    processes = {indexer._proc.pid} | descendants(indexer._proc.pid)
    assert listening(processes) == {("127.0.0.1", indexer.port)}
    with DynamoIndexer(host="0.0.0.0") as everywhere:  # asked for: every interface
        assert everywhere._proc is not None and everywhere.workers() == []
        processes = {everywhere._proc.pid} | descendants(everywhere._proc.pid)
        assert listening(processes) == {("0.0.0.0", everywhere.port)}
    with pytest.raises(InvalidArgumentError, match="host must be an IPv4 address"):
        DynamoIndexer(host="localhost")


def test_an_indexer_that_cannot_be_kept_on_loopback_is_not_started(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(indexer_module, "NATIVE_MODULE", "math")  # no bind() to redirect
    ix = DynamoIndexer()
    with pytest.raises(DynamoIndexerError, match=r"was not started: .*no reference to bind\(\).*"
                                                 r"DynamoIndexer\(host='0.0.0.0'\)"):
        ix.start()
    assert not ix.running
