"""The Triton kernels compile for an H100 (sm_90a) without spilling registers: Triton's real
NVIDIA pipeline and ptxas, driven by a stand-in driver (no GPU needed)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def test_kernels_compile_for_sm90_without_spills() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    res = subprocess.run([sys.executable, "-m", "runner.kernels.aot_check", "--quick"],
                         capture_output=True, text=True, env=env, timeout=600)
    if res.returncode == 3:
        pytest.skip(f"this Triton lacks the internals the check uses: {res.stderr.strip()}")
    assert res.returncode == 0, res.stdout + res.stderr
    lines = [line for line in res.stdout.splitlines() if line.startswith(("prefill", "decode"))]
    assert len(lines) >= 8 and all(" 0  " in line for line in lines)  # zero spill bytes
    assert any("wgmma" in line for line in lines if line.startswith("prefill bf16"))
    # A GQA ratio that is not a power of two (padded tiles) and logit soft-capping compile too.
    assert any(" gqa3 " in line for line in lines if line.startswith("prefill bf16"))
    assert any("softcap" in line for line in lines if line.startswith("prefill bf16"))
