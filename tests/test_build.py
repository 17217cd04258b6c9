"""Which build is running: ``kvcore.__compiled__`` and ``kvcore --version`` agree with the modules
actually imported (the pure-Python package of an editable install, or the compiled build of
``pip install .``; tests/test_compiled_wheel.py checks which build a wheel is).

``scripts/test_compiled.sh`` runs the suite with ``KVCORE_EXPECT_BUILD=compiled``; set it to
``pure`` (or leave it unset) for the reference build."""

from __future__ import annotations

import os
import types
from importlib.machinery import EXTENSION_SUFFIXES

import pytest

import kvcore
from kvcore import block_pool, hashing, manager
from kvcore.cli import main, version
from kvcore.manager import KVCacheManager
from kvcore.testing import checked, is_checked, refuse_allocation, unchecked
from kvcore.testing.faults import RefusingAllocation
from tests.factories import full_spec, make_manager


def _is_extension(module: types.ModuleType) -> bool:
    return (module.__file__ or "").endswith(tuple(EXTENSION_SUFFIXES))


def test_compiled_flag_matches_the_imported_modules() -> None:
    assert kvcore.__compiled__ is True or kvcore.__compiled__ is False
    assert all(_is_extension(m) is kvcore.__compiled__ for m in (manager, block_pool, hashing))
    # Compiled methods are not Python functions.
    assert isinstance(KVCacheManager.allocate_slots, types.FunctionType) is not kvcore.__compiled__
    expected = os.environ.get("KVCORE_EXPECT_BUILD")
    if expected is not None:
        assert expected in ("compiled", "pure")
        assert kvcore.__compiled__ is (expected == "compiled")


def test_version_names_the_build(capsys: pytest.CaptureFixture[str]) -> None:
    build = "compiled with mypyc" if kvcore.__compiled__ else "pure Python"
    assert version().startswith("kvcore ") and version().endswith(f"({build})")
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == version()


def test_managers_of_either_build_keep_their_identity_under_the_test_layers() -> None:
    m = make_manager(full_spec(4), num_blocks=16)
    checked(refuse_allocation(m, {1}))
    a = m.make_request("a", [1, 2, 3])
    assert m.allocate_slots(a, 3) is None and is_checked(m)  # refused, then checked
    assert m.allocate_slots(a, 3) is not None
    assert type(unchecked(m)).__bases__ == (RefusingAllocation, KVCacheManager)  # still refusing
    assert not is_checked(m)
    m.free(a)
    m.check_invariants()
