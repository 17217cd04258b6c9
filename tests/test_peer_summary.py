"""Without the vLLM peer venv the differential suite skips; the summary says so in one line with
the command that enables it (``tests/conftest.py``), not only under ``-rs``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_summary_says_the_differential_suite_was_skipped(tmp_path: Path) -> None:
    # A plugin loaded before the test modules: no peer venv, wherever .peer-venv is.
    (tmp_path / "no_peer.py").write_text(
        "import kvcore.bench.peer\nkvcore.bench.peer.peer_python = lambda: None\n")
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "KVCORE_PEER_PYTHON")}
    env["PYTHONPATH"] = str(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/differential/test_event_wire.py", "-p", "no_peer",
         "-p", "no:cacheprovider", "-n", "2", "-q"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if "differential suite" in line]
    assert lines == ["vLLM differential suite skipped (2 tests: the vLLM peer venv is missing); "
                     "enable it with: bash scripts/peer_vllm.sh"], proc.stdout[-3000:]
