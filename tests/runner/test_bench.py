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
