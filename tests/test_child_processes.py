"""No process kvcore starts outlives it, and none is left listening, however kvcore ends.

A kvcore process starts its children: a benchmark worker (``kvcore.bench``: the kvcore, vLLM
peer and compiled columns are all such workers), the vLLM conformance run's pytest, and the
Dynamo indexer with its feed's publishers (their PUB and replay sockets are the parent's own);
it is then ended by SIGTERM or SIGKILL, and no child may remain, nor any socket that it or they
listened on.  The tensor-parallel ranks have their own test (``tests/runner/test_tp_lifeline.py``);
the lifeline itself is tested in ``tests/test_lifeline.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvcore.cluster.dynamo import dynamo_available
from tests.conftest import DYNAMO_INSTALL
from tests.proc_tree import (
    LINUX_ONLY,
    cmdline,
    descendants,
    kill_parent,
    lines_until,
    reap_tree,
    wait_gone,
)

pytestmark = LINUX_ONLY
REPO = Path(__file__).resolve().parents[1]

KVCORE_PARENT = """
import sys
from pathlib import Path

from kvcore.bench.workers import Worker, WorkerSpec
from kvcore_pytest.vllm_conformance import run as conformance

tmp = Path(sys.argv[1])
worker = Worker(WorkerSpec("peer", "vllm", str(tmp / "fake-worker")))  # a benchmark worker
if sys.argv[2] == "dynamo":
    from kvcore.cluster.dynamo import DynamoFeed, DynamoIndexer

    indexer = DynamoIndexer().start()
    feed = DynamoFeed.open(indexer, 2, 4)  # publishers: PUB and replay sockets, in this process
print("started", flush=True)
# vLLM's own tests, run by the conformance runner: blocks while they run (for ever, here)
conformance._pytest(tmp / "fake-pytest", tmp, [], {}, tmp / "pytest.log", tmp / "out.json")
"""


def _script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


def test_no_child_of_kvcore_outlives_it(tmp_path: Path) -> None:
    """Two kvcore processes with the same children, ended by SIGTERM and by SIGKILL (side by
    side: each takes seconds to import kvcore).  Without ``ai-dynamo-runtime`` the indexer is
    left out, except under CI (``CI`` set), where that is a failure."""
    with_dynamo = dynamo_available()
    if not with_dynamo and os.environ.get("CI"):
        pytest.fail(f"ai-dynamo-runtime is not installed: {DYNAMO_INSTALL}")
    _script(tmp_path / "fake-worker",
            "echo '{\"ok\": true, \"hello\": {\"impl\": \"vllm\"}}'\nexec sleep 600\n")
    _script(tmp_path / "fake-pytest", "exec sleep 600\n")
    parents = {signum: subprocess.Popen(
        [sys.executable, "-c", KVCORE_PARENT, str(tmp_path), "dynamo" if with_dynamo else "-"],
        cwd=REPO, stdout=subprocess.PIPE, text=True)
        for signum in (signal.SIGTERM, signal.SIGKILL)}
    try:
        for signum, parent in parents.items():
            lines_until(parent, "started")
            deadline = time.monotonic() + 30
            while sum("sleep 600" in cmdline(p) for p in descendants(parent.pid)) < 2:
                assert time.monotonic() < deadline, "the fake pytest never started"
                time.sleep(0.05)
            tree, addresses = kill_parent(parent, signum)
            names = list(tree.values())
            assert sum("sleep 600" in n for n in names) == 2  # the worker and pytest
            if with_dynamo:
                assert any("dynamo.indexer" in n for n in names)
                assert len(addresses) >= 5  # the indexer's, 2 PUB and 2 replay sockets
            wait_gone(tree, addresses)
    finally:
        for parent in parents.values():
            reap_tree(parent)
