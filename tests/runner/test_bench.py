"""The GPU benchmark script: refuses cleanly without CUDA, and its code paths run on the CPU
with tiny shapes (--allow-cpu)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from runner.bench import main


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA refusal")
def test_refuses_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["attention"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device" in err and len(err.strip().splitlines()) == 1


def test_cpu_smoke_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json = tmp_path / "r.json"
    assert main(["all", "--allow-cpu", "--json", str(out_json)]) == 0
    data = json.loads(out_json.read_text())
    assert data["attention"] and all(r["gbps"] > 0 for r in data["attention"])
    assert data["prefill_attention"] and all(r["q_len"] == r["context"] and r["tflops"] > 0
                                             for r in data["prefill_attention"])
    assert data["throughput"][0]["output_tokens"] > 0
    assert data["prefix"][0]["cached_s"] > 0
    assert "decode attention" in capsys.readouterr().out


def test_throughput_overrides_engine_settings(tmp_path: Path) -> None:
    out_json = tmp_path / "t.json"
    assert main(["throughput", "--allow-cpu", "--max-num-seqs", "2", "--num-seqs", "3",
                 "--json", str(out_json)]) == 0
    (row,) = json.loads(out_json.read_text())["throughput"]
    assert row["max_num_seqs"] == 2 and row["num_seqs"] == 3 and row["output_tokens"] > 0
    assert row["max_num_batched_tokens"] == 8192 and row["steps"] > 0  # the engine's default


def test_throughput_peer_runs_the_same_workload(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    out_json = tmp_path / "p.json"
    assert main(["throughput", "--allow-cpu", "--num-seqs", "3", "--peer", "transformers",
                 "--no-async-scheduling", "--json", str(out_json)]) == 0
    data = json.loads(out_json.read_text())
    (ours,), (peer,) = data["throughput"], data["throughput_peers"]
    assert not ours["async_scheduling"]
    # Same prompts and output lengths (ignore_eos): the same number of generated tokens.
    assert peer["output_tokens"] == ours["output_tokens"] > 0 and peer["tokens_per_s"] > 0
    assert "continuous batching" in peer["peer"] and "torch / peer" in capsys.readouterr().out


def test_attention_peer_rows_are_checked_against_ours(capsys: pytest.CaptureFixture[str]) -> None:
    from runner.bench import bench_attention

    rows = bench_attention(torch.device("cpu"), [2], [40], ["torch"], num_kv_heads=2,
                           head_dim=16, dtype=torch.float32, reps=1, peers=["flex"])
    ours, peer = rows
    assert ours["backend"] == "torch" and peer["backend"] == "peer:flex"
    assert peer["max_err"] < 1e-4 and peer["gbps"] > 0 and peer["timing"] == "eager"
    (_, peer_prefill) = bench_attention(torch.device("cpu"), [2], [24], ["torch"],
                                        num_kv_heads=2, head_dim=16, dtype=torch.float32,
                                        reps=1, peers=["flex"], prefill=True)
    assert peer_prefill["q_len"] == 24 and peer_prefill["max_err"] < 1e-4
    assert main(["attention", "--allow-cpu", "--peers", "nope"]) == 2
    assert "unknown peer 'nope'" in capsys.readouterr().err


def test_warmup_covers_every_shape_the_timed_run_uses() -> None:
    """The throughput warm-up runs every kernel variant the timed runs need: the engine
    records each step's shape key (decode or prefill, block-table widths as Triton specializes
    them), and none of the timed runs' is missing from the warm-up's, at page sizes that put
    the widths in different classes."""
    from runner.bench import bench_throughput

    seen = set()
    for block_size in (1, 16):
        r = bench_throughput("torch", 4, 4, 12, True, "cpu", runs=2, block_size=block_size)
        assert r["shapes_not_warmed"] == []
        assert len(r["runs"]) == 2 and all(x["output_tokens"] == r["output_tokens"]
                                           for x in r["runs"])
        seen |= set(r["warmup_shapes"])
    # Both phases and all three width classes occurred, so the check had something to miss.
    assert {"('eager', 'decode', ('16k',))", "('eager', 'decode', ('1',))",
            "('eager', 'prefill', ('n',))", "('eager', 'prefill', ('1',))"} <= seen


def test_step_shape_keys_follow_triton_integer_specialization() -> None:
    from runner.attention import AttentionMetadata, GroupMetadata
    from runner.model_runner import eager_step_shape

    def meta(widths: list[int], q_len: int) -> AttentionMetadata:
        groups = [GroupMetadata(torch.zeros(2, dtype=torch.long),
                                torch.zeros(2, w, dtype=torch.int32)) for w in widths]
        return AttentionMetadata(torch.tensor([0, q_len, 2 * q_len]), torch.tensor([5, 5]),
                                 q_len, 5, groups, [5, 5], [q_len, q_len])

    assert eager_step_shape(meta([1, 32, 7], 1)) == ("eager", "decode", ("1", "16k", "n"))
    assert eager_step_shape(meta([48], 3)) == ("eager", "prefill", ("16k",))


def test_attention_table_says_why_a_cell_is_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """A missing peer, a failing peer and the time limit leave notes, not a crash: the other
    columns are still measured, and the % table footnotes each reason."""
    import runner.bench as bench
    from runner.peer_kernels import build_peer

    def flaky(name: str, *args: object, **kwargs: object) -> object:
        if name == "flex":
            raise RuntimeError("inductor said no")
        if name == "flashinfer":
            raise ImportError("No module named 'flashinfer'")
        return build_peer(name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(bench, "build_peer", flaky)
    rows = bench.bench_attention(torch.device("cpu"), [2], [40], ["torch"], num_kv_heads=2,
                                 head_dim=16, dtype=torch.float32, reps=1,
                                 peers=["flex", "sdpa", "flashinfer"])
    by = {r["backend"]: r for r in rows}
    assert by["torch"]["ms"] > 0 and by["peer:sdpa"]["max_err"] < 1e-5
    flex = by["peer:flex"]
    assert flex["ms"] is None and "RuntimeError: inductor said no" in flex["note"]
    assert by["peer:flashinfer"]["note"].startswith("not installed")
    header, lines, notes = bench.percent_table(rows, copy_gbps=1.0)
    assert header == ["batch", "context", "torch", "peer:flex", "peer:sdpa", "peer:flashinfer"]
    assert lines[0][3] == "n/a [1]" and lines[0][4].endswith("%") and lines[0][5] == "n/a [2]"
    assert "inductor said no" in notes[0] and "flashinfer" in notes[1]
    late = bench.bench_attention(torch.device("cpu"), [1, 2], [16], ["torch"], num_kv_heads=2,
                                 head_dim=16, dtype=torch.float32, reps=1, peers=["sdpa"],
                                 deadline=0.0)
    assert len(late) == 4 and all(r["ms"] is None and r["note"] == "time limit" for r in late)


def test_transformers_peer_is_bounded(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--peer-num-seqs: the peer runs the first N requests and ours is timed on the same N (the
    ratio's numerator); --peer-time-limit: a capped peer says so."""
    out_json = tmp_path / "b.json"
    assert main(["throughput", "--allow-cpu", "--num-seqs", "4", "--peer", "transformers",
                 "--peer-num-seqs", "2", "--json", str(out_json)]) == 0
    data = json.loads(out_json.read_text())
    (ours,), (peer,) = data["throughput"], data["throughput_peers"]
    assert ours["num_seqs"] == 4 and ours["subset"]["num_seqs"] == peer["num_seqs"] == 2
    assert peer["output_tokens"] == ours["subset"]["output_tokens"] > 0 and not peer["capped"]
    assert "first 2 requests" in capsys.readouterr().out
    assert main(["throughput", "--allow-cpu", "--num-seqs", "2", "--peer", "transformers",
                 "--peer-time-limit", "0", "--json", str(out_json)]) == 0
    (peer,) = json.loads(out_json.read_text())["throughput_peers"]
    assert peer["capped"] and peer["finished"] < peer["num_seqs"]
    assert "(time limit)" in capsys.readouterr().out
