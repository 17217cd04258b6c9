"""Extension modules of the compiled build (build_backend/kvcore_build.py decides when).

When the backend builds the compiled wheel (the default of ``pip install .`` where a C compiler
is present, or ``KVCORE_COMPILE=1``), this compiles kvcore's hot modules with mypyc (the same
source; the ``.py`` files are installed too); otherwise it adds nothing and pyproject.toml
describes the package.  kvcore.testing, kvcore.sim, kvcore.bench and the CLI stay interpreted.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent

# The hot path: free queue, eviction policies and pool, hashing, the single-type managers, the coordinators, the
# manager, and the request and hit-verification types they read on every call.
COMPILED_MODULES = [
    "kvcore/types.py",
    "kvcore/validation.py",
    # every pool policy; the registry (read at construction only) and the simulator-only
    # policies stay interpreted
    *sorted(str(p.relative_to(HERE)) for p in (HERE / "kvcore" / "eviction").glob("*.py")
            if p.name not in ("offline.py", "registry.py")),
    "kvcore/block_pool.py",
    *sorted(str(p.relative_to(HERE)) for p in (HERE / "kvcore" / "pool").glob("*.py")),
    "kvcore/hashing.py",
    # the KV-event recorder the pool calls per block stored or removed (the msgspec event types
    # of kvcore.events.wire stay interpreted)
    "kvcore/events/recorder.py",
    "kvcore/request.py",
    "kvcore/verify.py",
    "kvcore/manager.py",
    *sorted(str(p.relative_to(HERE)) for p in (HERE / "kvcore" / "managers").glob("*.py")),
    *sorted(str(p.relative_to(HERE)) for p in (HERE / "kvcore" / "coordinator").glob("*.py")),
    # kvcore's manager inside vLLM: the adapter vLLM's scheduler calls and the request view it
    # reads (vLLM's types are opaque to the compiler: vLLM is imported when the adapter is).
    "kvcore/integrations/vllm/manager.py",
    "kvcore/integrations/vllm/events.py",
    "kvcore/integrations/vllm/request.py",
    "kvcore/integrations/vllm/retry.py",
]


# The compiled build's modules are collected in a directory of their own, emptied first, so that
# a wheel never carries an extension module left over from an earlier build.
COMPILED_BUILD_LIB = HERE / "build" / "lib.mypyc"


def compiled_build() -> dict[str, object]:
    if os.environ.get("_KVCORE_MYPYC_BUILD") != "1":  # set by the backend's build_wheel
        return {}
    from mypyc.build import mypycify

    shutil.rmtree(COMPILED_BUILD_LIB, ignore_errors=True)
    config = str(HERE / "build_backend" / "mypyc.ini")
    return {"ext_modules": mypycify(["--config-file", config, *COMPILED_MODULES], opt_level="3",
                                    group_name="kvcore"),  # the shared library: kvcore__mypyc
            "options": {"build": {"build_lib": str(COMPILED_BUILD_LIB)}}}


setup(**compiled_build())
