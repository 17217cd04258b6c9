"""The pytest plugin of the vLLM conformance runs (``-p kvcore_pytest.vllm_conformance.plugin``),
loaded into vLLM's own test suite, in both runs:

* ``--kvcore-schedulers``: before any conftest or test module is imported, rebind
  ``vllm.v1.core.sched.scheduler.Scheduler`` and ``vllm.v1.core.sched.async_scheduler.
  AsyncScheduler`` to :class:`kvcore.integrations.vllm.Scheduler` / ``AsyncScheduler``, so
  every ``from vllm.v1.core.sched.scheduler import Scheduler`` in vLLM's tests and helpers,
  and every lookup by qualified name (``SchedulerConfig.get_scheduler_cls``), gets kvcore's
  class.  kvcore's module is imported first, so its classes subclass vLLM's originals.
* ``--light-cleanup``: vLLM's conftest tears down distributed state and runs ``gc.collect()``
  after each test, 0.4 s over the heap of an imported vLLM: most of these unit tests' time.
  Instead, every test is marked ``skip_global_cleanup`` (vLLM's own opt-out), the heap is
  frozen once collection has imported everything (``gc.freeze()``), and the plugin does the
  same cleanup after each test, whose ``gc.collect()`` then only visits what the test left.
  Garbage is still collected between tests, not at random inside a later one: a finalizer
  that runs inside ``ast.parse`` makes CPython 3.11 raise "AST constructor recursion depth
  mismatch" (in pytest's own failure reports).  The outcomes are vLLM's cleanup's (0.32.0,
  all 1,913 tests compared).
* always: every vLLM scheduler built while a test runs (setup, call and teardown) is counted
  by the class of its ``kv_cache_manager`` (``KVCacheManagerAdapter`` for kvcore's; vLLM's
  base ``Scheduler.__init__`` is wrapped for the session), and
  ``--kvcore-conformance-json PATH`` writes each test's outcome, counts and time (and each
  collection error) to PATH, for :mod:`kvcore_pytest.vllm_conformance.run`.

Works under pytest-xdist: workers attach the counts to the teardown report, the controller
writes the file.
"""

from __future__ import annotations

import functools
import gc
import json
from collections import Counter
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import pytest

_PROPERTY = "kvcore_conformance_managers"
# Manager class names of the schedulers built during the current test (this process).
_built: list[str] = []
_restore: list[Callable[[], None]] = []


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvcore-conformance", "kvcore's vLLM conformance runs")
    group.addoption("--kvcore-schedulers", action="store_true",
                    help="vLLM's Scheduler and AsyncScheduler are kvcore's "
                    "(kvcore.integrations.vllm) for the whole run")
    group.addoption("--kvcore-conformance-json", metavar="PATH", default=None,
                    help="write every test's outcome and the KV-cache managers of the "
                    "schedulers it built to PATH (JSON)")
    group.addoption("--light-cleanup", action="store_true",
                    help="instead of vLLM's cleanup after each test (distributed state, "
                    "gc.collect() of the whole heap), collect only the tests' garbage")


def _use_kvcore_schedulers() -> None:
    from vllm.v1.core.sched import async_scheduler as vllm_async
    from vllm.v1.core.sched import scheduler as vllm_sync

    original_sync, original_async = vllm_sync.Scheduler, vllm_async.AsyncScheduler
    # Imported while vLLM's names are still vLLM's classes: kvcore's subclass those.
    import kvcore.integrations.vllm.scheduler as kv

    if (kv.Scheduler is original_sync or not issubclass(kv.Scheduler, original_sync)
            or not issubclass(kv.AsyncScheduler, original_async)):
        raise pytest.UsageError("vLLM's scheduler classes were rebound before kvcore's "
                                "integration was imported (load this plugin only once)")
    vllm_sync.Scheduler = kv.Scheduler
    vllm_async.AsyncScheduler = kv.AsyncScheduler

    def restore() -> None:
        vllm_sync.Scheduler = original_sync
        vllm_async.AsyncScheduler = original_async

    _restore.append(restore)


def _count_schedulers() -> None:
    """Wrap vLLM's base ``Scheduler.__init__``: every scheduler class, vLLM's, kvcore's or a
    test's own subclass, runs it and has its ``kv_cache_manager`` when it returns."""
    from vllm.v1.core.sched.scheduler import Scheduler

    original = Scheduler.__init__

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        _built.append(type(self.kv_cache_manager).__name__)

    Scheduler.__init__ = __init__

    def restore() -> None:
        Scheduler.__init__ = original

    _restore.append(restore)


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    # Before vLLM's conftest.py files import anything of vLLM's scheduler.
    _count_schedulers()
    if early_config.known_args_namespace.kvcore_schedulers:
        _use_kvcore_schedulers()


def pytest_unconfigure(config: pytest.Config) -> None:
    while _restore:
        _restore.pop()()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--light-cleanup"):
        for item in items:
            item.add_marker("skip_global_cleanup")
        gc.collect()
        gc.freeze()  # what collection imported stays; each test's own garbage is collected


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[
        None, object, object]:
    _built.clear()
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[
        None, None, None]:
    try:
        yield
    finally:
        if item.config.getoption("--light-cleanup"):
            _light_cleanup()
        # Before the teardown report is made: it carries the counts to the controller.
        item.user_properties.append((_PROPERTY, dict(Counter(_built))))


def _light_cleanup() -> None:
    """vLLM's ``cleanup_dist_env_and_memory`` for a CPU, with the heap frozen."""
    import vllm.envs as envs
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
    )

    envs.disable_envs_cache()
    destroy_model_parallel()
    destroy_distributed_environment()
    gc.collect()
    gc.freeze()  # again: a test that ran vLLM's cleanup itself unfroze the heap


class _Recorder:
    """Each test's outcome from its three reports, and its scheduler counts."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tests: dict[str, dict[str, Any]] = {}
        self.collection_errors: dict[str, str] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        entry = self.tests.setdefault(report.nodeid, {"outcome": "passed", "managers": {},
                                                      "message": "", "seconds": 0.0})
        entry["seconds"] = round(entry["seconds"] + report.duration, 3)
        outcome = _phase_outcome(report)
        if _RANK[outcome] > _RANK[entry["outcome"]]:
            entry["outcome"] = outcome
            if outcome in ("failed", "error"):
                entry["message"] = _error_line(report)
        for name, value in report.user_properties:
            if name == _PROPERTY:
                entry["managers"] = value

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.collection_errors[report.nodeid] = _error_line(report)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps({"tests": self.tests,
                                         "collection_errors": self.collection_errors},
                                        indent=1, sort_keys=True))


# A test's outcome is its worst phase's: an error in setup or teardown outranks the call's.
_RANK = {"passed": 0, "skipped": 1, "xfailed": 1, "xpassed": 2, "failed": 3, "error": 4}


def _phase_outcome(report: pytest.TestReport) -> str:
    if hasattr(report, "wasxfail"):
        return "xfailed" if report.skipped else "xpassed"
    if report.passed:
        return "passed"
    if report.skipped:
        return "skipped"
    return "failed" if report.when == "call" else "error"


def _error_line(report: pytest.TestReport | pytest.CollectReport) -> str:
    """The exception line of a failure (pytest's ``E   ...`` lines), for the summary."""
    text = report.longreprtext
    lines = [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
    first = next((line for line in lines if line), "")
    if not first:
        first = next((line for line in reversed(text.splitlines()) if line.strip()), "")
    return first[:400]


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("--kvcore-conformance-json")
    if path and not hasattr(config, "workerinput"):  # the controller (or a plain run)
        config.pluginmanager.register(_Recorder(Path(path)), "kvcore-conformance-recorder")
