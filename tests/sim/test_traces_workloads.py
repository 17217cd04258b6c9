"""Trace loading (Mooncake JSONL) and synthetic workloads."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from kvcore.errors import InvalidArgumentError
from kvcore.sim import workloads as W
from kvcore.sim.traces import HashIdTokens, TraceRequest, default_trace_path, load_mooncake
from tests.sim import small_workload

TRACE = default_trace_path()


def write_trace(tmp_path: Path, records: list[object]) -> Path:
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records))
    return p


def test_hash_id_tokens_deterministic_and_distinct() -> None:
    a, b = HashIdTokens(seed=1), HashIdTokens(seed=1)
    assert a.block(7).tolist() == b.block(7).tolist()
    assert a.block(7).tolist() != a.block(8).tolist()
    assert HashIdTokens(seed=2).block(7).tolist() != a.block(7).tolist()
    block = a.block(123)
    assert len(block) == 512 and block.min() >= 0 and block.max() < 32_000
    assert a.tokens([1, 2], 600) == a.block(1).tolist() + a.block(2).tolist()[:88]


def test_load_mooncake_and_shared_prefix_tokens(tmp_path: Path) -> None:
    p = write_trace(tmp_path, [
        {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 3]},
        {"timestamp": 10, "input_length": 700, "output_length": 2, "hash_ids": [1, 9]},
    ])
    r0, r1 = load_mooncake(p)
    assert (r0.num_prompt_tokens, r0.output_len, r0.arrival_ms) == (1100, 5, 0.0)
    t0, t1 = r0.prompt_token_ids(), r1.prompt_token_ids()
    assert len(t0) == 1100 and len(t1) == 700
    assert t0[:512] == t1[:512] and t0[512:700] != t1[512:700]
    # Keys at a block size dividing 512 follow the hash ids; at other sizes they hash tokens.
    k0, k1 = r0.block_keys(256), r1.block_keys(256)
    assert k0[:2] == k1[:2] and len(k0) == 4 and len(k1) == 2 and k0[2] == (2, 0)
    h0, h1 = r0.block_keys(100), r1.block_keys(100)
    assert h0[:5] == h1[:5] and h0[5] != h1[5]


@pytest.mark.parametrize("line, match", [
    ("{not json", ":1: malformed"),
    ('{"timestamp": 0, "input_length": 10}', "malformed"),
    ('{"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": [1]}', "needs 2"),
])
def test_malformed_traces(tmp_path: Path, line: str, match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        load_mooncake(write_trace(tmp_path, [line]))


def test_missing_trace_file(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="not found"):
        load_mooncake(tmp_path / "nope.jsonl")


@pytest.mark.skipif(TRACE is None, reason="shipped Mooncake trace not present")
def test_shipped_trace_loads() -> None:
    reqs = load_mooncake(TRACE)  # type: ignore[arg-type]
    assert len(reqs) == 3993
    assert all(a.arrival_ms <= b.arrival_ms for a, b in itertools.pairwise(reqs))
    assert load_mooncake(TRACE, limit=5)[4] == reqs[4]  # type: ignore[arg-type]


def test_workloads_are_deterministic_and_shaped() -> None:
    for name in W.WORKLOADS:
        a, b = small_workload(name, seed=3), small_workload(name, seed=3)
        assert a == b and len(a) > 0
        assert all(r.num_prompt_tokens == len(r.prompt_token_ids()) for r in a)
        assert [r.prompt_token_ids() for r in a] == [r.prompt_token_ids() for r in b]
    sp = W.shared_prefix(num_groups=2, prompts_per_group=3, system_len=40, question_len=5)
    groups: dict[str, list[TraceRequest]] = {}
    for r in sp:
        groups.setdefault(r.request_id.split("-")[0], []).append(r)
    for rs in groups.values():
        assert len({r.prompt[:40] for r in rs}) == 1  # type: ignore[index]
    mt = W.multi_turn(num_conversations=2, turns=3)
    conv = sorted((r for r in mt if r.request_id.startswith("mt0-")), key=lambda r: r.request_id)
    for prev, cur in itertools.pairwise(conv):
        assert cur.prompt[:prev.num_prompt_tokens] == prev.prompt  # type: ignore[index]
        assert cur.arrival_ms > prev.arrival_ms
    with pytest.raises(InvalidArgumentError, match="unknown workload"):
        W.make_workload("nope")


def test_agent_workload_sessions_extend_and_share_the_system_prompt() -> None:
    reqs = W.agent(num_agents=2, num_sessions=12, min_steps=3, max_steps=5, system_len=300,
                   seed=5)
    seg = W.AGENT_SEGMENT_TOKENS
    assert all(r.num_prompt_tokens % seg == 0 and r.output_len % seg == 0 for r in reqs)
    assert all(a.arrival_ms <= b.arrival_ms for a, b in itertools.pairwise(reqs))
    sessions: dict[str, list[TraceRequest]] = {}
    for r in reqs:
        assert r.session_id is not None
        sessions.setdefault(r.session_id, []).append(r)
    assert len(sessions) == 12 and all(3 <= len(s) <= 5 for s in sessions.values())
    system = -(-300 // seg)  # segments of the system prompt
    heads = set()
    for steps in sessions.values():
        heads.add(steps[0].hash_ids[:system])  # type: ignore[index]
        for prev, cur in itertools.pairwise(steps):  # each step carries the whole session so far
            assert cur.arrival_ms > prev.arrival_ms
            assert cur.prompt_token_ids()[:prev.num_prompt_tokens] == prev.prompt_token_ids()
            # ...plus the previous step's action (its output length) and a tool output.
            assert cur.num_prompt_tokens > prev.num_prompt_tokens + prev.output_len
    assert len(heads) == 2  # one system prompt per agent, shared by its sessions
    tasks = {s[0].hash_ids[system] for s in sessions.values()}  # type: ignore[index]
    assert len(tasks) == 12  # but every session's own task differs
    with pytest.raises(InvalidArgumentError, match="min_steps"):
        W.agent(min_steps=4, max_steps=3)


def test_api_workload_reuses_system_prompts_only() -> None:
    reqs = W.api(num_requests=300, num_system_prompts=5, system_len=(300, 900), seed=3)
    assert reqs == W.api(num_requests=300, num_system_prompts=5, system_len=(300, 900), seed=3)
    seg = W.AGENT_SEGMENT_TOKENS
    assert all(r.num_prompt_tokens % seg == 0 for r in reqs)
    assert all(a.arrival_ms < b.arrival_ms for a, b in itertools.pairwise(reqs))
    owners: dict[int, set[str]] = {}
    for r in reqs:
        assert r.hash_ids is not None and r.session_id is None  # nothing continues
        for h in r.hash_ids:
            owners.setdefault(h, set()).add(r.request_id)
    shared = {h for h, who in owners.items() if len(who) > 1}
    firsts = {r.hash_ids[0] for r in reqs}  # type: ignore[index]
    assert len(firsts) == 5  # every system prompt was drawn
    counts = sorted(sum(1 for r in reqs if r.hash_ids[0] == f) for f in firsts)  # type: ignore[index]
    assert counts[-1] > 2 * counts[0]  # Zipf: the popular prompt far more often
    for r in reqs:  # what is shared is a leading run: the system prompt, never the message
        k = sum(1 for h in r.hash_ids if h in shared)  # type: ignore[union-attr]
        assert set(r.hash_ids[:k]) <= shared and not set(r.hash_ids[k:]) & shared  # type: ignore[index]
    with pytest.raises(InvalidArgumentError, match="rate_per_s"):
        W.api(rate_per_s=0)


def test_rag_workload_shares_the_instruction_and_the_leading_documents() -> None:
    reqs = W.rag(num_requests=400, num_documents=50, instruction_len=128,
                 document_len=(128, 256), seed=4)
    seg = W.AGENT_SEGMENT_TOKENS
    instruction = 128 // seg
    assert all(r.num_prompt_tokens % seg == 0 for r in reqs)
    heads = {r.hash_ids[:instruction] for r in reqs}  # type: ignore[index]
    assert len(heads) == 1  # one instruction for all
    firsts = [r.hash_ids[instruction] for r in reqs]  # type: ignore[index]
    top = max(set(firsts), key=firsts.count)
    assert firsts.count(top) > len(reqs) / 10  # a popular first document
    # Two prompts with the same first document share its segments (a common prefix longer
    # than the instruction); prompts with different ones share only the instruction.
    by_first: dict[int, list[TraceRequest]] = {}
    for r in reqs:
        by_first.setdefault(r.hash_ids[instruction], []).append(r)  # type: ignore[index]
    a, b = by_first[top][:2]
    common = next(i for i, (x, y) in enumerate(zip(a.hash_ids, b.hash_ids)) if x != y)  # type: ignore[arg-type]
    assert common > instruction + 1
    with pytest.raises(InvalidArgumentError, match="documents per request"):
        W.rag(num_documents=2)


def test_the_mooncake_trace_ships_with_the_package(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """From any directory, with whichever kvcore is imported (this clone's, editable, or an
    installed build, the compiled one of ``scripts/test_compiled.sh``): the trace is the
    package's own copy, with its attribution and license note beside it, and the built-in name
    loads it.  (tests/test_package.py installs a wheel in a fresh venv and does the same.)"""
    import kvcore
    from kvcore.sim.traces import MOONCAKE_SYNTHETIC

    shipped = (Path(kvcore.__file__).resolve().parent / "data" / "mooncake"
               / "synthetic_trace.jsonl")
    monkeypatch.delenv("KVCORE_MOONCAKE_TRACE", raising=False)
    monkeypatch.chdir(tmp_path)
    assert default_trace_path() == shipped
    assert sum(1 for _ in shipped.open()) == 3993
    note = (shipped.parent / "README.md").read_text()
    assert "Apache License, Version 2.0" in note and "kvcache-ai/Mooncake" in note
    reqs = load_mooncake(MOONCAKE_SYNTHETIC, limit=3)
    assert reqs == load_mooncake(shipped, limit=3) and len(reqs) == 3


def test_the_built_in_name_when_the_trace_is_missing(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCORE_MOONCAKE_TRACE", str(tmp_path / "gone.jsonl"))
    with pytest.raises(InvalidArgumentError, match=r"mooncake-synthetic: .*gone\.jsonl"):
        load_mooncake("mooncake-synthetic")
