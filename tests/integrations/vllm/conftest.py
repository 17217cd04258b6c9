"""The vLLM integration's tests need vLLM *with* its dependencies (engine, scheduler, server):
the full vLLM venv of ``scripts/vllm_full.sh``.  Where vLLM is not importable (kvcore's own dev
venv) they are not collected and the summary says how to run them; CI runs them in that venv."""

from __future__ import annotations

import importlib.util

import pytest

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
RUN = "bash scripts/vllm_full.sh && .vllm-venv/bin/python -m pytest tests/integrations/vllm"

collect_ignore_glob = [] if HAVE_VLLM else ["test_*.py"]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not HAVE_VLLM:
        terminalreporter.write_line(
            f"vLLM integration suite not run (vLLM is not installed here); run it with: {RUN}")
