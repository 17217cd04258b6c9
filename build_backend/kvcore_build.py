"""kvcore's PEP 517 build backend: setuptools, plus an optional mypyc-compiled build.

``KVCORE_COMPILE=1 pip install .`` builds a wheel whose hot modules (``setup.py`` lists them) are
compiled with mypyc from the same source; the build then needs ``mypy`` (and the packages whose
types the compiled code uses), which this backend adds to the build requirements only then.
Without the variable every hook is setuptools' own: the pure-Python package, the default and the
reference, needs nothing new.

The compiled build is a wheel only: an editable install would put extension modules next to the
sources, where they would shadow the pure-Python modules of every checkout user, so
``build_editable`` refuses ``KVCORE_COMPILE=1``.
"""

from __future__ import annotations

import os
from typing import Any

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


def compile_requested() -> bool:
    value = os.environ.get(COMPILE_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{COMPILE_ENV} must be 1 (compiled build) or 0/unset, got {value!r}")
    return value == "1"


def get_requires_for_build_wheel(config_settings: dict[str, Any] | None = None) -> list[str]:
    requires = _setuptools.get_requires_for_build_wheel(config_settings)
    return [*requires, *COMPILE_REQUIREMENTS] if compile_requested() else requires


def build_wheel(wheel_directory: str, config_settings: dict[str, Any] | None = None,
                metadata_directory: str | None = None) -> str:
    if not compile_requested():
        return _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)
    os.environ[BUILDING_ENV] = "1"
    try:
        return _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)
    finally:
        del os.environ[BUILDING_ENV]


def build_editable(wheel_directory: str, config_settings: dict[str, Any] | None = None,
                   metadata_directory: str | None = None) -> str:
    if compile_requested():
        raise RuntimeError(f"{COMPILE_ENV}=1 builds a wheel, not an editable install: use "
                           f"`{COMPILE_ENV}=1 pip install .` (without -e)")
    return _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)
