"""The conformance plugin (kvcore_pytest.vllm_conformance.plugin) in a pytest of its own, as the
conformance runner loads it into vLLM's tests: the scheduler classes a test module imports are
kvcore's with --kvcore-schedulers (subclasses of vLLM's originals, not of themselves), vLLM's
without; each test's schedulers are counted by their manager; outcomes land in the JSON, also
under pytest-xdist."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

TESTS = '''
from vllm.v1.core.sched import scheduler as vllm_scheduler_module
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from kvcore.integrations.vllm.replay import Engine, ReplaySetup, make_scheduler

STOCK = Engine.parse("vllm")


def build(cls):
    return make_scheduler(ReplaySetup(num_blocks=64), STOCK, scheduler_cls=cls)


def test_sync():
    build(Scheduler)


def test_async_twice():
    build(AsyncScheduler)
    build(AsyncScheduler)


def test_by_qualified_name():  # how vLLM's SchedulerConfig.get_scheduler_cls finds it
    build(getattr(vllm_scheduler_module, "Scheduler"))


def test_classes():
    sync = [c.__module__ + "." + c.__qualname__ for c in Scheduler.__mro__]
    async_ = [c.__module__ + "." + c.__qualname__ for c in AsyncScheduler.__mro__]
    assert sync.count("vllm.v1.core.sched.scheduler.Scheduler") == 1
    assert async_.count("vllm.v1.core.sched.async_scheduler.AsyncScheduler") == 1
    print("CLASSES", sync[0], async_[0])


def test_fails_after_building():
    build(Scheduler)
    assert False, "on purpose"


def test_builds_nothing():
    pass
'''


def run(tmp_path: Path, *args: str) -> dict[str, Any]:
    (tmp_path / "test_it.py").write_text(TESTS)
    out = tmp_path / "results.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "kvcore_pytest.vllm_conformance.plugin",
         "--kvcore-conformance-json", str(out), "-p", "no:cacheprovider", "-q", "-s",
         "--rootdir", str(tmp_path), *args, str(tmp_path / "test_it.py")],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # test_fails_after_building
    results: dict[str, Any] = json.loads(out.read_text())
    results["stdout"] = proc.stdout
    return results


@pytest.mark.parametrize("kvcore", [False, True], ids=["stock", "kvcore"])
@pytest.mark.parametrize("xdist", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_the_plugin_swaps_and_counts(tmp_path: Path, kvcore: bool, xdist: list[str]) -> None:
    results = run(tmp_path, *xdist, *(["--kvcore-schedulers"] if kvcore else []))
    manager = "KVCacheManagerAdapter" if kvcore else "KVCacheManager"
    tests = {nodeid.split("::")[1]: t for nodeid, t in results["tests"].items()}
    assert {name: (t["outcome"], t["managers"]) for name, t in tests.items()} == {
        "test_sync": ("passed", {manager: 1}),
        "test_async_twice": ("passed", {manager: 2}),
        "test_by_qualified_name": ("passed", {manager: 1}),
        "test_classes": ("passed", {}),
        "test_fails_after_building": ("failed", {manager: 1}),
        "test_builds_nothing": ("passed", {}),
    }
    assert "on purpose" in tests["test_fails_after_building"]["message"]
    assert results["collection_errors"] == {}
    if not xdist:  # xdist workers' output is not shown
        module = "kvcore.integrations.vllm.scheduler" if kvcore else "vllm.v1.core.sched"
        want = (f"CLASSES {module}.Scheduler {module}.AsyncScheduler" if kvcore else
                f"CLASSES {module}.scheduler.Scheduler {module}.async_scheduler.AsyncScheduler")
        assert want in results["stdout"]
