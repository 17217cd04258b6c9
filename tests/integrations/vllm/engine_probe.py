"""What the engine tests' worker scripts share (standard library only: a worker imports vLLM
after setting its environment): counting a scheduler's preemptions, and running a worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]


def count_preemptions(scheduler: Any) -> list[str]:
    """The ids of the requests ``scheduler`` preempts from now on (a live list: wraps its
    ``_preempt_request``)."""
    preempted: list[str] = []
    original = scheduler._preempt_request

    def preempt(request: Any, *args: Any, **kwargs: Any) -> Any:
        preempted.append(request.request_id)
        return original(request, *args, **kwargs)

    scheduler._preempt_request = preempt
    return preempted


def run_worker(worker: Path, args: list[str], out: Path, timeout: int) -> Any:
    """Run ``worker ARGS... OUT`` with this repository importable and vLLM quiet; the JSON it
    wrote to ``out`` (fails the test, with the worker's stderr, if it did not finish)."""
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(worker), *args, str(out)], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, f"{worker.name} failed:\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text())
