"""The routing index, the routers and the N-replica replay (``kvcore.cluster``,
``kvcore.sim.cluster``)."""

from __future__ import annotations

import json
from collections import Counter

import msgspec
import pytest
import zmq

from kvcore.cli import main as kvcore_main
from kvcore.cluster import (
    EventChannel,
    KVRoutingIndex,
    LeastLoadedRouter,
    PrefixRouter,
    ReplicaLoad,
    RoundRobinRouter,
    make_router,
    request_keys,
)
from kvcore.errors import InvalidArgumentError
from kvcore.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvcore.events.publisher import ZmqEventPublisher, encode_payload, external_hash
from kvcore.sim.cluster import ClusterConfig, replay_cluster
from kvcore.sim.replay import ReplayConfig, make_manager, make_request, make_scheduler, replay
from kvcore.sim.workloads import multi_turn, shared_prefix
from tests.factories import run_main
from tests.test_publisher import LOCAL, manager_batches, request_replay, wait_until_published


def stored(*keys: int, medium: str = "GPU") -> BlockStored:
    return BlockStored(block_hashes=keys, parent_block_hash=None, token_ids=(), block_size=4,
                       medium=medium)


def removed(*keys: int, medium: str = "GPU") -> BlockRemoved:
    return BlockRemoved(block_hashes=keys, medium=medium)


def test_index_counts_copies_and_tiers() -> None:
    index = KVRoutingIndex()
    index.apply_events(0, [stored(1, 2, 3), stored(2), stored(1, medium="CPU")])
    index.apply_events(1, [stored(1)])
    assert index.holders(1) == {0: {"GPU": 1, "CPU": 1}, 1: {"GPU": 1}}
    assert index.holders(2) == {0: {"GPU": 2}}
    index.apply_events(0, [removed(2)])
    assert index.holders(2) == {0: {"GPU": 1}}  # one copy left
    index.apply_events(0, [removed(2), removed(9), removed(3, medium="CPU")])  # unknown: ignored
    assert index.holders(2) == {} and index.holders(3) == {0: {"GPU": 1}}
    # A reset drops the replica's device entries only.
    index.apply_events(0, [AllBlocksCleared()])
    assert index.holders(1) == {0: {"CPU": 1}, 1: {"GPU": 1}}
    assert index.num_blocks(0) == 1 and index.num_blocks(0, "GPU") == 0 and len(index) == 1
    index.remove_replica(0)
    assert index.snapshot() == {1: {1: {"GPU": 1}}}


def test_match_scores_the_longest_leading_run_per_replica_by_tier() -> None:
    index = KVRoutingIndex()
    index.apply_events("a", [stored(1, 2, 3, 4)])
    index.apply_events("b", [stored(1, 2, medium="CPU"), stored(3, 4)])  # hole at 3? no: 3 held
    index.apply_events("c", [stored(1), stored(3, 4)])  # misses key 2
    m = index.match([1, 2, 3, 4, 5])
    assert m["a"] == (4, 4.0)
    assert m["b"] == (4, pytest.approx(0.8 + 0.8 + 1 + 1))
    assert m["c"] == (1, 1.0)
    assert index.match([7, 1]) == {}
    assert index.match([]) == {}
    with pytest.raises(InvalidArgumentError, match="medium weight"):
        KVRoutingIndex({"GPU": 1.5})


def test_a_bad_payload_changes_nothing_and_gaps_are_counted() -> None:
    index = KVRoutingIndex()
    index.apply_payload(0, encode_payload([stored(1)], 0.0), seq=0)
    before = index.snapshot()
    with pytest.raises(msgspec.DecodeError):
        index.apply_payload(0, b"\x93garbage", seq=1)
    assert index.snapshot() == before and index.num_gaps == 0
    index.apply_payload(0, encode_payload([stored(2)], 0.0), seq=1)
    index.apply_payload(0, encode_payload([stored(3)], 0.0), seq=5)  # 2..4 were lost
    assert index.num_gaps == 1 and index.num_batches == 3


def test_the_in_process_channel_sends_the_publishers_bytes() -> None:
    """An index fed through ZeroMQ (replay socket, real bytes) equals one fed in process."""
    batches = manager_batches()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        with ZmqEventPublisher(LOCAL, LOCAL) as pub:
            assert pub.replay_endpoint is not None
            for batch in batches:
                pub.publish(batch, ts=2.0)
            wait_until_published(pub, len(batches))
            wire = request_replay(ctx, pub.replay_endpoint, 0)
    finally:
        ctx.destroy(linger=0)
    over_zmq, in_process = KVRoutingIndex(), KVRoutingIndex()
    for _, seq, payload in wire:
        over_zmq.apply_payload(7, payload, seq)
    channel = EventChannel(in_process, 7)
    payloads = []
    for batch in batches[:-1]:  # before the reset, so the comparison is not vacuous
        channel.publish(batch, ts=2.0)
        payloads.append(encode_payload(batch, 2.0))
    assert [p for _, _, p in wire[:-1]] == payloads
    mid = in_process.snapshot()
    assert mid and all(isinstance(k, int) for k in mid)
    channel.publish(batches[-1], ts=2.0)
    assert over_zmq.snapshot() == in_process.snapshot() and channel.seq == len(batches)
    assert over_zmq.num_gaps == in_process.num_gaps == 0


def test_the_index_mirrors_a_replicas_prefix_cache_after_every_step() -> None:
    """Every cached block of the real pool is in the index under its published key, with as
    many copies, and nothing else is (stores, evictions, duplicates)."""
    reqs = shared_prefix(num_groups=6, prompts_per_group=6, system_len=96)
    cfg = ReplayConfig(block_size=16, num_blocks=40, max_num_seqs=4)
    manager = make_manager(cfg, reqs, enable_events=True)
    sched = make_scheduler(manager, cfg)
    index = KVRoutingIndex()
    channel = EventChannel(index, "r0")
    for tr in reqs:
        sched.add_request(make_request(manager, tr))
    steps = evicted = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        sched.update_from_output(out, {s.request_id: 5 for s in out.scheduled if s.samples})
        channel.publish(manager.take_events())
        expected = Counter(external_hash(h, True) for h, _ in manager.pool.iter_cached(0))
        got = {k: v["r0"]["GPU"] for k, v in index.snapshot().items()}
        assert got == dict(expected), f"step {steps}"
        steps += 1
        evicted = manager.pool.num_evicted_blocks
    assert evicted > 0 and steps > 10


def test_routers() -> None:
    loads = [ReplicaLoad(3, 300), ReplicaLoad(1, 100), ReplicaLoad(2, 100)]
    rr = RoundRobinRouter()
    assert [rr.route([], 10, loads) for _ in range(4)] == [0, 1, 2, 0]
    assert LeastLoadedRouter().route([], 10, loads) == 1
    index = KVRoutingIndex()
    index.apply_events(2, [stored(1, 2, 3)])
    prefix = PrefixRouter(index, block_size=16)
    # Replica 2 holds 48 of the 64 prompt tokens: cost 100 + 16 vs 100 + 64 on replica 1.
    assert prefix.route([1, 2, 3, 4], 64, loads) == 2
    # Its queue grows: the hit no longer pays for the wait.
    assert prefix.route([1, 2, 3, 4], 64, [loads[0], loads[1], ReplicaLoad(9, 160)]) == 1
    # A host-tier copy is worth less than a device copy.
    index.apply_events(0, [stored(1, 2, 3, medium="CPU")])
    even = [ReplicaLoad(0, 0)] * 3
    assert prefix.route([1, 2, 3], 64, even) == 2
    assert PrefixRouter(index, 16, load_weight=0.0).route([1, 2, 3], 64,
                                                          [ReplicaLoad(0, 0), ReplicaLoad(0, 0),
                                                           ReplicaLoad(5, 10_000)]) == 2
    with pytest.raises(InvalidArgumentError, match="unknown router"):
        make_router("random")
    with pytest.raises(InvalidArgumentError, match="needs a KVRoutingIndex"):
        make_router("prefix")
    with pytest.raises(InvalidArgumentError, match="load_weight"):
        PrefixRouter(index, 16, load_weight=-1)


def test_request_keys_cover_the_full_blocks_a_hit_can_serve() -> None:
    hashes = [bytes([i]) * 16 for i in range(4)]
    assert request_keys(hashes, 64, 16) == [external_hash(h, True) for h in hashes[:3]]
    assert request_keys(hashes, 65, 16) == [external_hash(h, True) for h in hashes]
    assert request_keys(hashes, 65, 16, int_block_hashes=False) == hashes
    assert request_keys(hashes, 0, 16) == []


def test_one_replica_replays_exactly_like_the_single_replay() -> None:
    reqs = multi_turn(num_conversations=8, turns=4)
    cfg = ReplayConfig(block_size=16, num_blocks=160, max_num_seqs=8)
    single = replay(reqs, cfg)
    for router in ("prefix", "round-robin", "least-loaded"):
        one = replay_cluster(reqs, cfg, ClusterConfig(1, router))
        assert (one.hit_tokens, one.prompt_tokens, one.num_finished) == (
            single.hit_tokens, single.prompt_tokens, single.num_finished)
        assert one.replicas[0].steps == single.steps
        assert one.replicas[0].evicted_blocks == single.evicted_blocks


def test_prefix_routing_keeps_conversations_together() -> None:
    # 15 conversations on 4 replicas: round-robin sends each turn of a conversation elsewhere.
    reqs = multi_turn(num_conversations=15, turns=6)
    cfg = ReplayConfig(block_size=16, num_blocks=400, max_num_seqs=16)
    results = {r: replay_cluster(reqs, cfg, ClusterConfig(4, r))
               for r in ("prefix", "round-robin", "least-loaded")}
    for r in results.values():
        assert r.num_finished == len(reqs) and r.num_rejected == 0
        assert sum(x.requests for x in r.replicas) == len(reqs)
        assert sum(x.hit_tokens for x in r.replicas) == r.hit_tokens
        assert r.event_batches > 0 and r.imbalance >= 1.0
    assert results["prefix"].token_hit_rate > results["round-robin"].token_hit_rate + 0.3
    assert results["prefix"].token_hit_rate >= results["least-loaded"].token_hit_rate
    # Round-robin spreads requests evenly.
    assert sorted(x.requests for x in results["round-robin"].replicas) == [22, 22, 23, 23]


def test_cluster_config_is_checked() -> None:
    reqs = multi_turn(num_conversations=2, turns=2)
    with pytest.raises(InvalidArgumentError, match="num_replicas"):
        ClusterConfig(0)
    with pytest.raises(InvalidArgumentError, match="unknown router"):
        ClusterConfig(2, "random")
    with pytest.raises(InvalidArgumentError, match="one replica"):
        replay_cluster(reqs, ReplayConfig(eviction_policy="belady"), ClusterConfig(2))
    with pytest.raises(InvalidArgumentError, match="no requests"):
        replay_cluster([], ReplayConfig(), ClusterConfig(2))


def test_cli_replicas_and_router(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_main(kvcore_main, capsys, "replay", "--workload", "multi-turn",
                                                  "--replicas", "3", "--router", "prefix",
                                                  "--json")
    assert code == 0
    data = json.loads(out)
    assert data["replicas"] == 3 and data["router"] == "prefix"
    rep = data["replay"]
    assert 0 < rep["token_hit_rate"] <= 1 and len(rep["replicas"]) == 3
    assert sum(r["requests"] for r in rep["replicas"]) == data["requests"]
    code, out, _ = run_main(kvcore_main, capsys, "replay", "--workload", "multi-turn",
                                                  "--replicas", "2", "--router", "round-robin")
    assert code == 0 and "round-robin" in out and "replica 1:" in out
    code, _, err = run_main(kvcore_main, capsys, "replay", "--replicas", "2", "--publish",
                                                  "tcp://127.0.0.1:*")
    assert code == 2 and "--publish" in err
    code, _, err = run_main(kvcore_main, capsys, "replay", "--router", "nearest")
    assert code == 2 and "--router" in err
