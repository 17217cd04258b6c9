"""Running a workload script under kvcore's interpreter and under the vLLM peer's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

WORKLOADS = Path(__file__).resolve().parent / "workloads"
_REPO_ROOT = Path(__file__).resolve().parents[2]


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


class WorkloadError(RuntimeError):
    """A workload script failed; the message carries its stderr."""


def run_workload(script: str, impl: str, args: list[str], python: Path | str | None = None,
                 timeout: float = 1800) -> object:
    """Run ``workloads/<script>`` with ``--impl impl`` and return its JSON output."""
    exe = str(python) if python is not None else sys.executable
    env = dict(os.environ)
    env.setdefault("PYTHONHASHSEED", "0")
    env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if impl == "kvcore":
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_REPO_ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([exe, str(WORKLOADS / script), "--impl", impl, *args],
                          capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise WorkloadError(f"{script} --impl {impl} failed (exit {proc.returncode}):\n"
                            f"{proc.stderr[-4000:]}")
    return json.loads(proc.stdout)
