"""scripts/gpu_check.sh, the bounded GPU check, cannot rot between GPU sessions: its dry run
(every step on tiny shapes on the CPU, Triton under the interpreter) runs here and must end
with every step ok; and its summary judges the issue's targets from a GPU run's files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runner.check_report import render_summary, summarize

REPO = Path(__file__).resolve().parents[2]
STEPS = ["env", "tests", "attention", "throughput-async", "throughput-sync", "prefix"]


def test_dry_run_runs_every_step(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("PYTEST_XDIST_WORKER", None)
    res = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--dry-run",
                          str(tmp_path)], capture_output=True, text=True, env=env,
                         timeout=600, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [s["step"] for s in summary["steps"]] == STEPS
    assert all(s["status"] == "ok" for s in summary["steps"]) and summary["all_steps_ok"]
    assert summary["tests"]["tests"] == 2 and summary["tests"]["failed"] == []
    assert all(t["met"] is None for t in summary["targets"])  # nothing measured on a CPU
    assert "all steps ok" in res.stdout and "PASSED" in (tmp_path / "tests.log").read_text()
    assert res.stdout.count("warm-up missed 0 shapes") == 2  # async and sync
    attention = json.loads((tmp_path / "attention.json").read_text())
    measured = {r["backend"] for r in attention["attention"] if r["ms"] is not None}
    assert {"triton", "peer:flex", "peer:sdpa"} <= measured
    flashinfer = [r for r in attention["attention"] if r["backend"] == "peer:flashinfer"]
    assert flashinfer and all(r["ms"] is not None or r["note"] for r in flashinfer)
    assert any(r["chosen"] for r in attention["split_sweep"])
    (e2e,) = json.loads((tmp_path / "throughput_async.json").read_text())["throughput"]
    assert len(e2e["runs"]) == 2 and e2e["shapes_not_warmed"] == []
    peer = json.loads((tmp_path / "throughput_async.json").read_text())["throughput_peers"][0]
    assert peer["num_seqs"] == e2e["subset"]["num_seqs"] == 2


def test_bad_usage_exits_2(tmp_path: Path) -> None:
    script = str(REPO / "scripts" / "gpu_check.sh")
    assert subprocess.run(["bash", script], capture_output=True).returncode == 2
    assert subprocess.run(["bash", script, "--nope", str(tmp_path)],
                          capture_output=True).returncode == 2


def _gpu_run(tmp_path: Path, device: str, tok_s: float, cold: float, tests_s: int,
             pct: dict[tuple[str, int, int], float]) -> Path:
    (tmp_path / "steps.tsv").write_text(
        f"env\tok\t0\t3\t15\tenv.log\ntests\tok\t0\t{tests_s}\t170\ttests.log\n"
        "attention\ttimeout\t124\t75\t75\tattention.log\n")
    copy = 3000.0
    rows = [{"backend": b, "batch": n, "context": c, "ms": 1.0, "gbps": p * copy / 100}
            for (b, n, c), p in pct.items()]
    rows.append({"backend": "peer:flashinfer", "batch": 8, "context": 8192, "ms": None,
                 "gbps": None, "note": "not installed"})
    (tmp_path / "attention.json").write_text(json.dumps({"copy_gbps": copy,
                                                         "attention": rows}))
    runs = [{"tokens_per_s": cold}, {"tokens_per_s": tok_s}]
    (tmp_path / "throughput_async.json").write_text(json.dumps(
        {"device": device, "throughput": [{"tokens_per_s": cold, "runs": runs}]}))
    (tmp_path / "tests.xml").write_text(
        '<testsuites><testsuite><testcase classname="tests.runner.test_a" name="test_ok"/>'
        '<testcase classname="tests.runner.test_b" name="test_bad"><failure/></testcase>'
        '<testcase classname="tests.runner.test_c" name="test_skip"><skipped/></testcase>'
        "</testsuite></testsuites>")
    return tmp_path


@pytest.mark.parametrize("device", ["NVIDIA H200", "NVIDIA H100 80GB HBM3"])
def test_summary_judges_the_targets(tmp_path: Path, device: str) -> None:
    pct = {("triton", 8, 8192): 91.0, ("triton", 8, 32768): 89.0, ("triton", 1, 32768): 80.0,
           ("triton", 1, 2048): 29.0, ("peer:flex", 8, 8192): 50.0,
           ("peer:flex", 1, 2048): 35.0}
    out = _gpu_run(tmp_path, device, tok_s=20_000.0, cold=19_500.0, tests_s=250, pct=pct)
    summary = summarize(out)
    met = {t["target"]: t["met"] for t in summary["targets"]}
    assert met["decode batch 8 x 8192: >= 90% of copy"] is True
    assert met["decode batch 8 x 32768: >= 90% of copy"] is False
    assert met["decode batch 1 x 32768: >= 80% of copy"] is True
    assert met["decode batch 1 x 2048: >= 30% of copy"] is False
    assert met["decode never below the FlexAttention column"] is False  # 29% < 35% at 1 x 2k
    e2e = next(k for k in met if k.startswith("end to end"))
    assert met[e2e] is ("H100" in device and "H200" not in device)  # 20k: H100 yes, H200 no
    assert met["first timed run within 5% of a warm one"] is True
    assert met["tests/runner green on the GPU in <= 4 minutes"] is False  # 250 s
    assert not summary["all_steps_ok"]  # the attention step timed out
    assert summary["tests"]["failed"] == ["tests.runner.test_b::test_bad"]
    text = render_summary(summary)
    assert "FAILED tests.runner.test_b::test_bad" in text and "NOT all steps ok" in text
