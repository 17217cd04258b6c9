"""The pytest plugin and the example, run as a user runs them: pytest in a separate directory
(no kvcore conftest), in a subprocess."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "test_my_scheduler.py"

USER_TESTS = '''
import pytest
import torch
from kvcore import FullAttentionSpec, KVCacheConfig, KVCacheGroup, KVCacheManager
from kvcore.testing.checked import is_checked


def manager():
    spec = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=4, dtype=torch.float16)
    return KVCacheManager(KVCacheConfig(16, (KVCacheGroup(("l",), spec),)), 64)


def test_managers_are_checked():
    assert is_checked(manager())


@pytest.mark.kvcore_unchecked
def test_opted_out():
    assert not is_checked(manager())


def test_a_corruption_names_the_call():
    m = manager()
    r = m.make_request("a", [1, 2, 3, 4, 5])
    m.allocate_slots(r, 5)
    m.get_blocks("a")[0][0].ref_cnt += 1
    m.free(r)


def test_forgotten_free(kv_manager):
    m = kv_manager("swa", num_blocks=16, block_size=4)
    m.allocate_slots(m.make_request("leaky", [1, 2, 3]), 3)
'''


def pytest_in(directory: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "no:randomly", *args], cwd=directory, capture_output=True,
                          text=True, timeout=600)


def test_the_example_passes_with_kvcore_check(tmp_path: Path) -> None:
    shutil.copy(EXAMPLE, tmp_path / EXAMPLE.name)
    res = pytest_in(tmp_path, "--kvcore-check", EXAMPLE.name)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert "6 passed" in res.stdout, res.stdout[-2000:]


def test_the_plugin_checks_user_tests(tmp_path: Path) -> None:
    (tmp_path / "test_user.py").write_text(USER_TESTS)
    res = pytest_in(tmp_path, "--kvcore-check", "-rfE", "test_user.py")
    out = res.stdout
    assert "1 failed, 3 passed, 1 error" in out, out[-3000:]
    assert "[ref-count]" in out and "after free(<request 'a'>)" in out, out[-3000:]
    assert "still hold KV-cache blocks: ['leaky'] (a forgotten free()?)" in out, out[-3000:]
    plain = pytest_in(tmp_path, "test_user.py", "-k", "checked")  # no --kvcore-check
    assert plain.returncode == 1 and "1 failed" in plain.stdout  # not checked without the flag


def test_the_plugin_imports_nothing_until_used() -> None:
    code = ("import sys, kvcore_pytest.plugin; "
            "print(sorted(m for m in ('kvcore', 'torch', 'hypothesis') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"
