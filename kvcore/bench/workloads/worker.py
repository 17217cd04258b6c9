"""A benchmark worker: one long-lived process measuring one implementation (kvcore or vLLM).

Started by :mod:`kvcore.bench.workers` as ``PYTHON .../workloads/worker.py --impl kvcore|vllm``
under the interpreter of the implementation under test (kvcore's own, a compiled kvcore's, or the
vLLM peer's).  It imports nothing from kvcore's source tree by itself: the workload modules next
to this file are loaded as a package under an alias, so a worker only sees the kvcore that its
interpreter and ``PYTHONPATH`` provide.

Protocol: one JSON object per line.  The worker first writes its greeting
``{"ok": true, "hello": {...}}`` (or ``{"ok": false, "error": ...}`` and exits 2 when its start-up
check fails), then answers each request line with one reply line:

* ``{"op": "cases", "workload": W, "params": P}`` -> ``{"ok": true, "result": [case, ...]}``
* ``{"op": "measure", "workload": W, "case": NAME, "params": P, "repeat": R, "warmup": B}``
  -> ``{"ok": true, "result": sample}`` (see ``timing.Sample``)
* ``{"op": "exit"}`` -> ``{"ok": true, "result": null}``, then the worker exits.

A request that raises is answered ``{"ok": false, "error": ..., "traceback": ...}`` and the worker
keeps serving.  Anything else written to stdout (library logging, warnings) is sent to stderr, so
the protocol stream stays clean.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import json
import os
import platform
import sys
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any, TextIO

WORKLOADS = {"manager": "manager_cycle", "pool": "pool_ops", "hash": "hash_ops"}
_ALIAS = "kvcore_bench_workloads"


class StartupError(RuntimeError):
    """The interpreter does not provide the implementation the driver asked for."""


def _package() -> str:
    """The package name to import workload modules from: ours when imported normally (tests),
    else this directory loaded under an alias (a script's directory is otherwise only a path
    entry, and relative imports between the workload modules need a package)."""
    if __package__:
        return __package__
    if _ALIAS not in sys.modules:
        here = Path(__file__).resolve().parent
        spec = importlib.util.spec_from_file_location(
            _ALIAS, here / "__init__.py", submodule_search_locations=[str(here)])
        if spec is None or spec.loader is None:
            raise StartupError(f"cannot load the workload package from {here}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[_ALIAS] = module
        spec.loader.exec_module(module)
    return _ALIAS


def load_workload(workload: str) -> ModuleType:
    if workload not in WORKLOADS:
        raise KeyError(f"unknown workload {workload!r} (known: {', '.join(WORKLOADS)})")
    return importlib.import_module(f"{_package()}.{WORKLOADS[workload]}")


def startup(impl: str, expect: str | None) -> dict[str, Any]:
    """Import the implementation under test and describe it.

    ``expect`` is "compiled" (kvcore must report ``kvcore.__compiled__ is True``), "source"
    (kvcore must not), or None.  Raises :class:`StartupError` when the check fails."""
    hello: dict[str, Any] = {"impl": impl, "python": sys.executable,
                             "python_version": platform.python_version(), "pid": os.getpid()}
    if impl == "kvcore":
        import kvcore

        compiled = getattr(kvcore, "__compiled__", False) is True
        hello.update(module=kvcore.__file__, compiled=compiled)
        if expect == "compiled" and not compiled:
            raise StartupError(
                f"{sys.executable} imports kvcore from {kvcore.__file__}, which is not a compiled "
                "build (kvcore.__compiled__ is not True); point --compiled-python at an "
                "interpreter where `KVCORE_COMPILE=1 pip install .` was run")
        if expect == "source" and compiled:
            raise StartupError(
                f"{sys.executable} imports a compiled kvcore from {kvcore.__file__} "
                "(kvcore.__compiled__ is True) where pure-Python kvcore was expected; remove "
                "the compiled extension modules from the source tree")
    elif impl == "vllm":
        import vllm

        hello.update(module=vllm.__file__, vllm_version=getattr(vllm, "__version__", "?"),
                     compiled=False)
    else:
        raise StartupError(f"unknown implementation {impl!r}")
    return hello


def handle(impl: str, msg: dict[str, Any]) -> Any:
    """Answer one request (``cases`` or ``measure``)."""
    op = msg.get("op")
    module = load_workload(str(msg.get("workload")))
    params = msg.get("params") or {}
    if op == "cases":
        return module.cases(impl, params)
    if op == "measure":
        return module.measure(impl, msg["case"], params, int(msg.get("repeat", 0)),
                              bool(msg.get("warmup", False)))
    raise KeyError(f"unknown op {op!r}")


class _Settler:
    """Moves what imports left behind (modules, their caches) out of the collector's sight
    (``gc.freeze``) whenever a request imported something new, so the ``gc.collect()`` before each
    timed region walks only the workload's own objects (in the vLLM peer it would otherwise walk
    all of vLLM and torch: about 0.4 s per sample).  The timed code is unaffected: the GC is off
    inside timed regions anyway."""

    def __init__(self) -> None:
        self.seen = -1

    def __call__(self) -> None:
        if len(sys.modules) != self.seen:
            gc.collect()
            gc.freeze()
            self.seen = len(sys.modules)


def serve(impl: str, inp: TextIO, out: TextIO, freeze: bool = True) -> None:
    """Answer request lines from ``inp`` on ``out`` until ``exit`` or end of input
    (``freeze=False``: leave the GC alone, for serving inside another program's process)."""
    settle = _Settler() if freeze else (lambda: None)
    settle()
    for line in inp:
        if not line.strip():
            continue
        reply: dict[str, Any]
        try:
            msg = json.loads(line)
            if msg.get("op") == "exit":
                out.write(json.dumps({"ok": True, "result": None}) + "\n")
                out.flush()
                return
            reply = {"ok": True, "result": handle(impl, msg)}
        except Exception as exc:
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                     "traceback": traceback.format_exc()}
        out.write(json.dumps(reply) + "\n")
        out.flush()
        settle()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="kvcore benchmark worker (see module docstring)")
    ap.add_argument("--impl", choices=["kvcore", "vllm"], required=True)
    ap.add_argument("--expect", choices=["compiled", "source"])
    args = ap.parse_args(argv)
    # Keep the protocol on a private copy of stdout; stray prints go to stderr.
    proto = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    try:
        hello = startup(args.impl, args.expect)
    except StartupError as exc:  # an expected refusal: the message says it all
        proto.write(json.dumps({"ok": False, "error": str(exc)}) + "\n")
        proto.flush()
        return 2
    except Exception as exc:  # e.g. the implementation does not import
        proto.write(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}",
                                "traceback": traceback.format_exc()}) + "\n")
        proto.flush()
        return 2
    proto.write(json.dumps({"ok": True, "hello": hello}) + "\n")
    proto.flush()
    serve(args.impl, sys.stdin, proto)
    return 0


if __name__ == "__main__":
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        del sys.path[0]  # the workload modules are reached through the alias package only
    sys.exit(main())
