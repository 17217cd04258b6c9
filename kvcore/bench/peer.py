"""Where the other interpreters are: the vLLM peer's and an optional compiled kvcore's."""

from __future__ import annotations

import os
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parents[2]
COMPILED_ENV = "KVCORE_COMPILED_PYTHON"


def peer_python() -> Path | None:
    """The vLLM peer's interpreter: ``$KVCORE_PEER_PYTHON``, else ``.peer-venv`` in the current
    directory or the repository root (built by ``scripts/peer_vllm.sh``)."""
    env = os.environ.get("KVCORE_PEER_PYTHON")
    candidates = [Path(env)] if env else []
    candidates += [Path.cwd() / ".peer-venv/bin/python", _REPO_ROOT / ".peer-venv/bin/python"]
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    return None


def compiled_python(arg: str | None) -> str | None:
    """The interpreter whose installed kvcore is the compiled build: ``--compiled-python``, else
    ``$KVCORE_COMPILED_PYTHON``, else None (no compiled column)."""
    return arg or os.environ.get(COMPILED_ENV) or None
