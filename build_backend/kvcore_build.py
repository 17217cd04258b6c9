"""kvcore's PEP 517 build backend: setuptools, plus the mypyc-compiled build of kvcore's hot modules.

A wheel (``pip install .``, ``pip wheel .``, ``python -m build``, a wheel built from the sdist) is
the compiled build whenever this machine can compile: CPython, and a C compiler that builds an
extension against this Python's headers (probed in a second by compiling a few lines).  The hot
modules (``setup.py`` lists them) are then compiled with mypyc from the same source; the build
needs ``mypy`` (and the packages whose types the compiled code uses), which this backend asks
for only then (``get_requires_for_build_wheel``: pip and ``build`` install them into the isolated
build environment).  Where it cannot compile (no compiler, no Python headers, another Python
implementation, mypyc missing from a build without isolation, or the mypyc build failing), the
wheel is the pure-Python package and the build prints one line on stderr saying so and why.
An isolated build that cannot download mypy fails at the front end's install of the build
requirements, before this backend can fall back: ``KVCORE_COMPILE=0`` there (or a build without
isolation, which falls back when mypyc is missing).

``KVCORE_COMPILE`` overrides the choice: ``0`` builds the pure-Python package (the reference)
without probing; ``1`` requires the compiled build, and a build that cannot compile fails
instead of falling back (CI's compiled wheel and the release wheels use it).

An editable install (``pip install -e .``) is always the pure-Python package: extension modules
next to the sources would shadow the pure-Python modules of every checkout user, so
``build_editable`` refuses ``KVCORE_COMPILE=1``.  The sdist holds the sources and this backend
(MANIFEST.in), so a wheel built from it compiles the same way.
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import setuptools  # noqa: F401  (first: it provides distutils on Python >= 3.12)
from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F403  (every hook not overridden below)

# The mypy (mypyc) that compiles the build; keep in step with the dev environment's.  With it,
# the runtime dependencies whose types the compiled modules use (msgspec's Struct events, the
# hash functions); torch and numpy are not needed (build_backend/mypyc.ini).
COMPILE_REQUIREMENTS = ["mypy>=2.4,<3", "msgspec", "xxhash>=3.0", "cbor2"]
COMPILE_ENV = "KVCORE_COMPILE"
# Set while build_wheel runs a compiled build: setup.py compiles only then (the metadata hooks
# run setup.py too, and need no extension modules).
BUILDING_ENV = "_KVCORE_MYPYC_BUILD"

AUTO, COMPILED, PURE = "auto", "compiled", "pure"


def build_mode() -> str:
    """``compiled`` (``KVCORE_COMPILE=1``: compile or fail), ``pure`` (``0``), or ``auto`` (unset
    or empty: compile where this machine can)."""
    value = os.environ.get(COMPILE_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{COMPILE_ENV} must be 1 (compiled build), 0 (pure Python) or unset "
                         f"(compiled where a C compiler is present), got {value!r}")
    return {"": AUTO, "0": PURE, "1": COMPILED}[value]


@contextmanager
def _silenced() -> Iterator[None]:
    """Send this process's stdout and stderr (file descriptors, so the compiler's too) nowhere."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        with open(os.devnull, "w") as sink:
            os.dup2(sink.fileno(), 1)
            os.dup2(sink.fileno(), 2)
            yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)


def compiler_problem() -> str | None:
    """Why this interpreter cannot build a C extension, or None when it can: the compiler
    distutils would use (``CC`` or Python's own) compiles a file that includes ``Python.h``."""
    if sys.implementation.name != "cpython":
        return f"mypyc compiles for CPython only, this is {sys.implementation.name}"
    from distutils.ccompiler import new_compiler  # setuptools' copy (imported above)
    from distutils.sysconfig import customize_compiler

    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "kvcore_probe.c"
        source.write_text("#include <Python.h>\nint kvcore_probe(void) { return 0; }\n")
        compiler = new_compiler()
        customize_compiler(compiler)
        try:
            with _silenced():
                compiler.compile([str(source)], output_dir=tmp,
                                 include_dirs=[sysconfig.get_paths()["include"]])
        except Exception as exc:  # CompileError, or a missing compiler (an OSError inside)
            return f"no working C compiler ({_shortened(str(exc))})"
    return None


def _shortened(text: str, limit: int = 160) -> str:
    """One line of at most about ``limit`` characters: a compiler's command line is long, its
    end (the exit status) the part worth reading."""
    text = " ".join(text.split())
    return text if len(text) <= limit else f"{text[:limit // 2]} ... {text[-limit // 2:]}"


def _say_pure(reason: str) -> None:
    print(f"kvcore: building the pure-Python package, not the compiled one: {reason} "
          f"({COMPILE_ENV}=1 makes this an error, {COMPILE_ENV}=0 skips the attempt)",
          file=sys.stderr, flush=True)


def get_requires_for_build_wheel(config_settings: dict[str, Any] | None = None) -> list[str]:
    requires = _setuptools.get_requires_for_build_wheel(config_settings)
    mode = build_mode()
    if mode == PURE or (mode == AUTO and compiler_problem() is not None):
        return requires  # build_wheel says why, if it was not asked for
    return [*requires, *COMPILE_REQUIREMENTS]


def _compiled_wheel(wheel_directory: str, config_settings: dict[str, Any] | None,
                    metadata_directory: str | None) -> str:
    os.environ[BUILDING_ENV] = "1"
    try:
        return _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)
    finally:
        del os.environ[BUILDING_ENV]


def build_wheel(wheel_directory: str, config_settings: dict[str, Any] | None = None,
                metadata_directory: str | None = None) -> str:
    mode = build_mode()
    if mode == COMPILED:
        return _compiled_wheel(wheel_directory, config_settings, metadata_directory)
    if mode == AUTO:
        problem = compiler_problem()
        if problem is None:
            try:
                import mypyc.build  # noqa: F401
            except ImportError:
                problem = "mypyc is not installed (a build without isolation needs mypy)"
        if problem is None:
            try:
                return _compiled_wheel(wheel_directory, config_settings, metadata_directory)
            except (Exception, SystemExit) as exc:  # mypyc and setup() exit on their errors
                problem = f"the mypyc build failed ({type(exc).__name__}: {_shortened(str(exc))})"
                # the wheel's staging directory may hold compiled modules: start it afresh
                for staging in Path("build").glob("bdist.*"):
                    shutil.rmtree(staging, ignore_errors=True)
        _say_pure(problem)
    return _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(wheel_directory: str, config_settings: dict[str, Any] | None = None,
                   metadata_directory: str | None = None) -> str:
    if build_mode() == COMPILED:
        raise RuntimeError(f"{COMPILE_ENV}=1 builds a wheel, not an editable install: use "
                           f"`{COMPILE_ENV}=1 pip install .` (without -e); an editable install "
                           "is always the pure-Python package")
    return _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)
