"""kvcore as a package outside its clone: an sdist, a wheel built from it, installed
(non-editable) into a fresh venv, runs ``kvcore replay mooncake-synthetic`` from an empty
directory: the shipped trace and its attribution and license note are package data.

Kept cheap: nothing is downloaded (the builds use this interpreter's setuptools, without build
isolation; the fresh venv gets the pip bundled with Python (offline) and reaches kvcore's
dependencies through a ``.pth`` file naming this interpreter's site directories), the wheel is
the pure-Python one (``KVCORE_COMPILE=0``: a py3-none-any wheel; tests/test_compiled_wheel.py
checks the compiled default) and the replay is 20 requests."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import tarfile
import venv
import zipfile
from pathlib import Path

from tests.conftest import copy_package_sources

TRACE = "kvcore/data/mooncake/synthetic_trace.jsonl"
NOTE = "kvcore/data/mooncake/README.md"


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None, **extra: str) -> str:
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300,
                         env={**(os.environ if env is None else env), **extra})
    assert out.returncode == 0, (f"{cmd}: exit {out.returncode}\n{out.stdout[-3000:]}\n"
                                 f"{out.stderr[-3000:]}")
    return out.stdout


def test_an_installed_wheel_replays_the_shipped_trace_from_anywhere(tmp_path: Path) -> None:
    # A copy of the tree (the build writes build/ and *.egg-info next to its sources).
    src = copy_package_sources(tmp_path / "src")
    dist = tmp_path / "dist"
    sdist = _run([sys.executable, "-c", "import sys, kvcore_build; "
                  "print(kvcore_build.build_sdist(sys.argv[1]))", str(dist)], src,
                 PYTHONPATH=str(src / "build_backend"), KVCORE_COMPILE="0").split()[-1]
    with tarfile.open(dist / sdist) as tar:
        names = tar.getnames()
    assert any(n.endswith(TRACE) for n in names) and any(n.endswith(NOTE) for n in names)

    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
          "--no-index", "-q", "-w", str(dist), str(dist / sdist)], tmp_path, KVCORE_COMPILE="0")
    (wheel,) = dist.glob("kvcore-*.whl")
    assert wheel.name.endswith("-py3-none-any.whl"), wheel.name  # KVCORE_COMPILE=0: pure Python
    with zipfile.ZipFile(wheel) as whl:
        assert {TRACE, NOTE} <= set(whl.namelist())
        assert not [n for n in whl.namelist() if n.endswith((".so", ".pyd"))]

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)  # its own pip: older pips' --python is unreliable
    py = env_dir / "bin" / "python"
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     tmp_path).strip())
    # The wheel first (before the .pth below, through which pip would find this interpreter's
    # kvcore already installed), then the dependencies (torch, numpy, ...) from this
    # interpreter's site directories, after the venv's own.
    # (without $PYTHONPATH: a source tree named there, with a kvcore.egg-info from an earlier
    # build in it, would pass for an installed kvcore, and pip would install nothing)
    env = {k: v for k, v in os.environ.items()
           if k not in ("KVCORE_MOONCAKE_TRACE", "PYTHONPATH", "KVCORE_EXPECT_BUILD")}
    _run([str(py), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)], tmp_path,
         env)
    deps = [p for p in sys.path if p.endswith("site-packages")] or [
        sysconfig.get_paths()["purelib"]]
    (site / "_kvcore_test_dependencies.pth").write_text("\n".join(deps) + "\n")

    empty = tmp_path / "empty"
    empty.mkdir()
    out = _run([str(env_dir / "bin" / "kvcore"), "replay", "mooncake-synthetic", "--limit", "20",
                "--block-size", "512"], empty, env)
    assert out.startswith("replayed mooncake-synthetic: 20 of 20 requests finished"), out[:500]
    where = _run([str(py), "-c", "import kvcore, kvcore.sim.traces as t; "
                  "print(kvcore.__file__); print(t.default_trace_path())"], empty, env)
    module, trace = where.split()
    assert Path(module).is_relative_to(site) and Path(trace).is_relative_to(site), where
