"""Shared test set-up.

Without a GPU, Triton kernels run in its interpreter: TRITON_INTERPRET must be set before any
``@triton.jit`` function is decorated, so it is set here, before test modules import kernels.
With CUDA the kernels are compiled and the runner tests run on the GPU (``tests/runner``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
settings.register_profile(
    "dev", max_examples=25, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
settings.register_profile(
    "thorough", max_examples=1000, stateful_step_count=100, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


PEER_BUILD = "bash scripts/peer_vllm.sh"
INSTALL_TESTS = "KVCORE_INSTALL_TESTS=1"
DYNAMO_INSTALL = ".venv/bin/pip install -e '.[dynamo]'"  # tests/test_dynamo_interop.py
ROUTER_BUILD = "bash scripts/vllm_router.sh"  # tests/test_vllm_router_interop.py
# tests/test_compiled_wheel.py
COMPILED_WHEEL_BUILD = ("KVCORE_COMPILED_WHEEL=$(bash scripts/compiled_wheel.sh | tail -n 1) "
                        ".venv/bin/python -m pytest tests/test_compiled_wheel.py")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Without the vLLM peer venv the differential tests skip (a failure only under CI); say so
    in one line, with the command that enables them, instead of only under ``-rs``."""
    skipped = [r for r in terminalreporter.stats.get("skipped", [])
               if isinstance(r.longrepr, tuple) and PEER_BUILD in str(r.longrepr[2])]
    if skipped:
        terminalreporter.write_line(
            f"vLLM differential suite skipped ({len(skipped)} tests: the vLLM peer venv is "
            f"missing); enable it with: {PEER_BUILD}", yellow=True, bold=True)
    skipped = [r for r in terminalreporter.stats.get("skipped", [])
               if isinstance(r.longrepr, tuple) and INSTALL_TESTS in str(r.longrepr[2])]
    if skipped:
        terminalreporter.write_line(
            f"vLLM install-resolution tests skipped ({len(skipped)} tests: they need the "
            f"package index); run them with: {INSTALL_TESTS} .venv/bin/python -m pytest "
            "tests/test_install_with_vllm.py", yellow=True, bold=True)
    skipped = [r for r in terminalreporter.stats.get("skipped", [])
               if isinstance(r.longrepr, tuple) and DYNAMO_INSTALL in str(r.longrepr[2])]
    if skipped:
        terminalreporter.write_line(
            f"Dynamo KV-indexer interop tests skipped ({len(skipped)} tests: ai-dynamo-runtime "
            f"is not installed); enable them with: {DYNAMO_INSTALL}", yellow=True, bold=True)
    skipped = [r for r in terminalreporter.stats.get("skipped", [])
               if isinstance(r.longrepr, tuple) and ROUTER_BUILD in str(r.longrepr[2])]
    if skipped:
        terminalreporter.write_line(
            f"vllm-router kv_aware interop test skipped ({len(skipped)} tests: its venv is "
            f"missing); enable it with: {ROUTER_BUILD}", yellow=True, bold=True)
    skipped = [r for r in terminalreporter.stats.get("skipped", [])
               if isinstance(r.longrepr, tuple) and COMPILED_WHEEL_BUILD in str(r.longrepr[2])]
    if skipped:
        terminalreporter.write_line(
            f"compiled-wheel install test skipped ({len(skipped)} test: no wheel built); run it "
            f"with: {COMPILED_WHEEL_BUILD}", yellow=True, bold=True)


# What a wheel or sdist is built from (the tracked tree's parts that packaging reads).
PACKAGE_SOURCES = ("kvcore", "kvcore_pytest", "runner", "build_backend", "pyproject.toml",
                   "setup.py", "MANIFEST.in", "README.md")


def copy_package_sources(dst: Path) -> Path:
    """A copy of :data:`PACKAGE_SOURCES` at ``dst`` (a build writes build/ and *.egg-info next
    to its sources), without caches or built extensions; returns ``dst``."""
    root = Path(__file__).resolve().parents[1]
    dst.mkdir()
    for name in PACKAGE_SOURCES:
        path = root / name
        if path.is_dir():
            shutil.copytree(path, dst / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc"))
        else:
            shutil.copy2(path, dst / name)
    return dst
