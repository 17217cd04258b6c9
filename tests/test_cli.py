"""The ``kvcore`` console script: replay output, JSON, plots, bench pass-through, and bad input
reported in one line with exit status 2."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvcore.cli import main
from kvcore.sim.traces import default_trace_path
from tests.factories import run_main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    return run_main(main, capsys, *argv)


def test_replay_default_workload(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(capsys, "replay")
    assert rc == 0, err
    assert "128 of 128 requests finished" in out and "token hit rate:  83.33%" in out


def test_replay_json_with_policies(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "replay", "--workload", "few-shot", "--json", "--policy", "lru,belady",
                     "--num-blocks", "200")
    assert rc == 0
    data = json.loads(out)
    assert data["num_blocks"] == 200 and data["replay"]["num_finished"] == 128
    assert set(data["policies"]) == {"lru", "belady"}
    assert data["policies"]["belady"] >= data["policies"]["lru"]
    assert 0 < data["replay"]["token_hit_rate"] <= data["ideal_hit_rate"] + 1e-9


def test_replay_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "curve.png"
    rc, out, _ = run(capsys, "replay", "--workload", "multi-turn", "--plot", str(png))
    assert rc == 0 and png.stat().st_size > 1000 and "plot written" in out


@pytest.mark.skipif(default_trace_path() is None, reason="shipped Mooncake trace not present")
def test_replay_trace_file(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "replay", str(default_trace_path()), "--limit", "200",
                     "--block-size", "512", "--json")
    assert rc == 0 and json.loads(out)["replay"]["num_requests"] == 200


@pytest.mark.parametrize("argv, message", [
    (("replay", "missing.jsonl"), "trace file not found"),
    (("replay", ""), "trace file path is empty"),
    (("replay", "."), "trace file is a directory"),
    (("replay", "--capacity-tokens", "-5"), "positive integer"),
    (("replay", "--num-blocks", "0"), "positive integer"),
    (("replay", "--policy", "mru"), "unknown policy"),
    (("replay", "--workload", "nope"), "unknown workload"),
    (("replay", "--num-blocks", "10", "--capacity-tokens", "100"), "not allowed with"),
    (("frobnicate",), "invalid choice"),
])
def test_bad_input_is_one_line_exit_2(capsys: pytest.CaptureFixture[str], argv: tuple[str, ...],
                                      message: str) -> None:
    rc, _, err = run(capsys, *argv)
    assert rc == 2
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_malformed_trace_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\nnope\n')
    rc, _, err = run(capsys, "replay", str(bad))
    assert rc == 2 and "bad.jsonl:2: malformed" in err


def test_bench_pass_through(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "bench", "--no-peer", "pool", "--pool-sizes", "1000",
                     "--batch-sizes", "16", "--repeats", "1")
    assert rc == 0 and "BlockPool: ns per block" in out and "alloc+free" in out


def test_console_script_help() -> None:
    exe = shutil.which("kvcore", path=str(Path(sys.executable).parent))
    assert exe is not None, "the kvcore console script is not installed"
    res = subprocess.run([exe, "--help"], capture_output=True, text=True, check=True)
    assert "replay" in res.stdout and "bench" in res.stdout and "examples:" in res.stdout
