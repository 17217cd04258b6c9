"""A plain wheel build is kvcore's compiled build wherever a C compiler is present, and the pure-
Python package, with one line saying why, where it is not (build_backend/kvcore_build.py).

The compiled wheel itself is built once per CI run (``scripts/compiled_wheel.sh``: ``pip wheel .``
with ``KVCORE_COMPILE`` unset, the default a user gets; 1.5-2 minutes on two cores) and named by
``$KVCORE_COMPILED_WHEEL``; here it must carry a platform tag and extension modules, and installed
alone into a fresh venv it must import as the compiled build.  Outside CI, without that variable,
that test is skipped and the summary says how to run it; under CI (``CI`` set) it fails.  The
fallback and the build's choice of requirements are checked without compiling anything."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import sysconfig
import types
import venv
import zipfile
from pathlib import Path

import pytest

from tests.conftest import COMPILED_WHEEL_BUILD, copy_package_sources

ROOT = Path(__file__).resolve().parents[1]
WHEEL_ENV = "KVCORE_COMPILED_WHEEL"
# A few of the modules setup.py compiles, and the shared library mypyc puts them in.
COMPILED = ("kvcore/manager", "kvcore/block_pool", "kvcore/hashing", "kvcore/managers/base",
            "kvcore/coordinator/unitary", "kvcore/integrations/vllm/manager", "kvcore__mypyc")
FALLBACK = "kvcore: building the pure-Python package, not the compiled one: "


def _run(cmd: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, (f"{cmd}: exit {out.returncode}\n{out.stdout[-3000:]}\n"
                                 f"{out.stderr[-3000:]}")
    return out


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "KVCORE_EXPECT_BUILD", "KVCORE_COMPILE", "CC")}
    return {**env, **extra}


def _compiled_wheel() -> Path:
    value = os.environ.get(WHEEL_ENV)
    if not value:
        msg = f"${WHEEL_ENV} is not set; build the wheel and run this with: {COMPILED_WHEEL_BUILD}"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    wheel = Path(value)
    assert wheel.is_file(), f"${WHEEL_ENV} names {wheel}, which is not a file"
    return wheel


def test_the_default_wheel_is_compiled_and_installs_as_the_compiled_build(tmp_path: Path) -> None:
    wheel = _compiled_wheel()
    # kvcore-VERSION-PYTHON-ABI-PLATFORM.whl: this CPython's tag and a platform, not py3-none-any
    _, _, python_tag, abi, platform = wheel.name[:-len(".whl")].split("-")
    assert python_tag == f"cp{sys.version_info.major}{sys.version_info.minor}", wheel.name
    assert abi == python_tag and platform != "any", wheel.name
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
    assert {name + suffix for name in COMPILED} <= names, sorted(n for n in names if "." in n)
    assert "kvcore/manager.py" in names  # the sources are installed too

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)  # its own pip: older pips' --python is unreliable
    py = env_dir / "bin" / "python"
    env = _clean_env()
    _run([str(py), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)], tmp_path,
         env)
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     tmp_path, env).stdout.strip())
    # kvcore's dependencies (torch, numpy, ...) from this interpreter's site directories, after
    # the venv's own (a directory named in a .pth file is not scanned for .pth files itself, so
    # this interpreter's editable kvcore stays out of sight).
    deps = [p for p in sys.path if p.endswith("site-packages")] or [
        sysconfig.get_paths()["purelib"]]
    (site / "_kvcore_test_dependencies.pth").write_text("\n".join(deps) + "\n")

    empty = tmp_path / "empty"
    empty.mkdir()
    out = _run([str(py), "-c", "import kvcore, kvcore.manager as m; "
                "print(kvcore.__compiled__, kvcore.__file__, m.__file__)"], empty, env).stdout
    compiled, package, module = out.split()
    assert compiled == "True", out
    assert Path(package).is_relative_to(site) and module.endswith(suffix), out
    version = _run([str(env_dir / "bin" / "kvcore"), "--version"], empty, env).stdout
    assert version.strip().endswith("(compiled with mypyc)"), version


def _backend() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(
        "kvcore_build_under_test", ROOT / "build_backend" / "kvcore_build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _has_mypy(requires: list[str]) -> bool:
    return any(r.startswith("mypy") for r in requires)


def test_a_wheel_build_asks_for_mypyc_only_where_it_will_compile(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    backend = _backend()
    monkeypatch.chdir(tmp_path)  # setuptools' hooks run a setup.py: not the repository's here
    monkeypatch.delenv("KVCORE_COMPILE", raising=False)
    monkeypatch.delenv("CC", raising=False)
    if backend.compiler_problem() is not None:
        pytest.skip(f"this machine has no working C compiler: {backend.compiler_problem()}")
    assert _has_mypy(backend.get_requires_for_build_wheel())  # the default: compiled
    assert not _has_mypy(backend.get_requires_for_build_editable())  # editable: always pure
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert "no working C compiler" in (backend.compiler_problem() or "")
    assert not _has_mypy(backend.get_requires_for_build_wheel())  # it will fall back
    monkeypatch.setenv("KVCORE_COMPILE", "1")  # required: asks, and fails later if it cannot
    assert _has_mypy(backend.get_requires_for_build_wheel())
    monkeypatch.delenv("CC")
    monkeypatch.setenv("KVCORE_COMPILE", "0")
    assert not _has_mypy(backend.get_requires_for_build_wheel())
    monkeypatch.setenv("KVCORE_COMPILE", "yes")
    with pytest.raises(ValueError, match="'yes'"):
        backend.get_requires_for_build_wheel()


def test_without_a_compiler_the_wheel_is_pure_python_and_one_line_says_so(tmp_path: Path) -> None:
    src = copy_package_sources(tmp_path / "src")
    dist = tmp_path / "dist"
    # the backend's own hook, as pip calls it in its build environment (this interpreter's
    # setuptools; no download), with a compiler that does not exist
    out = _run([sys.executable, "-c", "import sys, kvcore_build; "
                "print(kvcore_build.build_wheel(sys.argv[1]))", str(dist)], src,
               _clean_env(PYTHONPATH=str(src / "build_backend"), CC="/nonexistent/cc"))
    wheel = out.stdout.split()[-1]
    assert wheel.endswith("-py3-none-any.whl"), wheel
    with zipfile.ZipFile(dist / wheel) as whl:
        assert not [n for n in whl.namelist() if n.endswith((".so", ".pyd"))]
    said = [line for line in out.stderr.splitlines() if line.startswith("kvcore:")]
    assert len(said) == 1 and said[0].startswith(FALLBACK), out.stderr[-2000:]
    assert "no working C compiler" in said[0] and "/nonexistent/cc" in said[0], said
