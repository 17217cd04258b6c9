"""The SGLang integration's tests need SGLang 0.5.23's prefix-cache pieces: the venv of
``scripts/sglang_venv.sh``.  Where SGLang is not importable (kvcore's own dev venv) they are not
collected and the summary says how to run them; CI runs them in that venv, where a missing SGLang
leaves pytest with no test collected, which CI fails."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest

HAVE_SGLANG = importlib.util.find_spec("sglang") is not None
RUN = "bash scripts/sglang_venv.sh && .sglang-venv/bin/python -m pytest tests/integrations/sglang"

collect_ignore_glob = [] if HAVE_SGLANG else ["test_*.py"]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not HAVE_SGLANG:
        terminalreporter.write_line(
            f"SGLang integration suite not run (SGLang is not installed here); run it with: {RUN}")


@pytest.fixture
def sglang_context() -> Iterator[None]:
    """SGLang's request code reads its published server arguments (the modules that build
    SGLang ``Req`` objects use this fixture; imported here lazily: this file also loads where
    SGLang is missing)."""
    from sglang.srt.runtime_context import publish, reset_context
    from sglang.srt.server_args import ServerArgs

    reset_context()
    publish(ServerArgs(model_path="dummy", device="cpu"), role="tokenizer")
    yield
    reset_context()
