"""Persistent, interleaved benchmark workers: the harness behind ``python -m kvcore.bench``.

Boundary: the driver (this module, in kvcore's process) never imports an implementation under
test.  It starts one long-lived worker process per implementation (:class:`WorkerSpec`: kvcore
from the repository's source, the vLLM peer, optionally a compiled kvcore), each running
``kvcore/bench/workloads/worker.py`` under that implementation's interpreter, and talks to it in
line-delimited JSON over stdin/stdout (protocol in the worker's docstring).  Workers build their
side of a case on request and return samples (``workloads/timing.py``).

:func:`run_interleaved` takes repeats in turns, rotating who goes first (repeat 1: A, B, C;
repeat 2: B, C, A; ...), so a slow phase of a shared machine hits every column alike; figures
are then compared as medians over repeats (:func:`spread`).  A worker that dies, hangs past its
timeout, fails a start-up check or raises while measuring surfaces as a :class:`WorkerError`
naming the worker, what it was doing, and the tail of its stderr.  A worker ends with the driver,
however the driver ends (:mod:`kvcore.proc.lifeline`).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from kvcore.proc.lifeline import guarded


def _repo_root() -> Path:
    """The kvcore source tree whose column this is: the one this module lives in, or, when
    kvcore is installed from a wheel (the compiled build's venv), the current directory."""
    here = Path(__file__).resolve().parents[2]
    return here if (here / "pyproject.toml").is_file() else Path.cwd().resolve()


REPO_ROOT = _repo_root()
WORKER_SCRIPT = Path(__file__).resolve().parent / "workloads" / "worker.py"
DEFAULT_TIMEOUT_S = 1800.0


class WorkerError(RuntimeError):
    """A worker could not start, died, timed out, or failed a request."""


@dataclass(frozen=True)
class WorkerSpec:
    """One implementation under test.

    ``label`` names its column; ``impl`` is "kvcore" or "vllm"; ``source`` is a kvcore source tree
    put first on ``PYTHONPATH`` (this repository, or a baseline checkout); every worker gets this
    repository removed from ``PYTHONPATH`` otherwise, so one without ``source`` imports what its
    interpreter has installed.  ``expect`` is the
    worker's start-up check: "source" (kvcore must not be compiled), "compiled" (it must be:
    ``kvcore.__compiled__ is True``) or None."""

    label: str
    impl: str
    python: str
    source: Path | None = None
    expect: str | None = None

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("PYTHONHASHSEED", "0")
        env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                 if p and not _is_repo_root(p)]
        if self.source is not None:
            parts.insert(0, str(self.source))
        if parts:
            env["PYTHONPATH"] = os.pathsep.join(parts)
        else:
            env.pop("PYTHONPATH", None)
        return env

    def command(self) -> list[str]:
        cmd = [self.python, str(WORKER_SCRIPT), "--impl", self.impl]
        return [*cmd, "--expect", self.expect] if self.expect else cmd


def _is_repo_root(path: str) -> bool:
    try:
        return Path(path).resolve() == REPO_ROOT
    except OSError:
        return False


class Worker:
    """A running worker process; use as a context manager or call :meth:`close`."""

    def __init__(self, spec: WorkerSpec, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.spec = spec
        self.timeout = timeout
        self._timed_out = False
        # The worker's stderr goes to a file (a pipe nobody reads could fill and block it);
        # its tail explains a failure.  Closed in close().
        self._stderr: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(guarded(spec.command()), stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=self._stderr,
                                         env=spec.env(), text=True, bufsize=1)
        except OSError as exc:
            self._stderr.close()
            raise WorkerError(f"cannot start the {spec.label} worker ({spec.python}): "
                              f"{exc}") from None
        try:
            self.hello: dict[str, Any] = self._read("starting up")["hello"]
        except BaseException:
            self.close()
            raise

    @property
    def label(self) -> str:
        return self.spec.label

    def _stderr_tail(self, limit: int = 3000) -> str:
        try:
            self._stderr.seek(0)
            text = self._stderr.read().decode(errors="replace")
        except (OSError, ValueError):
            return ""
        return text[-limit:].strip()

    def _died(self, what: str) -> WorkerError:
        try:
            code = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        why = (f"was killed after {self.timeout:.0f}s without answering" if self._timed_out
               else f"exited with status {code}")
        tail = self._stderr_tail()
        return WorkerError(f"the {self.label} worker ({self.spec.python}) {why} while {what}"
                           + (f"; its stderr ends with:\n{tail}" if tail else
                              " (nothing on its stderr)"))

    def _kill_for_timeout(self) -> None:
        self._timed_out = True
        self.proc.kill()

    def _read(self, what: str) -> dict[str, Any]:
        assert self.proc.stdout is not None
        timer = threading.Timer(self.timeout, self._kill_for_timeout)
        timer.daemon = True
        timer.start()
        try:
            line = self.proc.stdout.readline()
        finally:
            timer.cancel()
        if not line:
            raise self._died(what)
        try:
            msg = json.loads(line)
        except json.JSONDecodeError:
            raise WorkerError(f"the {self.label} worker wrote a line that is not JSON while "
                              f"{what}: {line[:200]!r}") from None
        if not isinstance(msg, dict) or not msg.get("ok"):
            err = msg.get("error", msg) if isinstance(msg, dict) else msg
            tb = msg.get("traceback", "") if isinstance(msg, dict) else ""
            raise WorkerError(f"the {self.label} worker ({self.spec.python}) failed while "
                              f"{what}: {err}" + (f"\n{tb.rstrip()}" if tb else ""))
        return msg

    def request(self, msg: dict[str, Any], what: str) -> Any:
        """Send one request and return its result (raises :class:`WorkerError`)."""
        assert self.proc.stdin is not None
        if self.proc.poll() is not None:
            raise self._died(what)
        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise self._died(what) from None
        return self._read(what)["result"]

    def cases(self, workload: str, params: dict[str, Any]) -> list[dict[str, Any]]:
        return list(self.request({"op": "cases", "workload": workload, "params": params},
                                 f"listing the {workload} cases"))

    def measure(self, workload: str, case: str, params: dict[str, Any], repeat: int,
                warmup: bool = False) -> dict[str, Any]:
        what = (f"warming up {workload} case {case!r}" if warmup
                else f"measuring {workload} case {case!r} (repeat {repeat + 1})")
        return dict(self.request({"op": "measure", "workload": workload, "case": case,
                                  "params": params, "repeat": repeat, "warmup": warmup}, what))

    def close(self) -> None:
        proc = self.proc if hasattr(self, "proc") else None
        if proc is not None and proc.poll() is None:
            try:
                assert proc.stdin is not None
                proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                proc.stdin.close()
            except (BrokenPipeError, OSError, ValueError):
                pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc is not None and proc.stdout is not None:
            proc.stdout.close()
        self._stderr.close()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


@dataclass
class CaseSamples:
    """Every sample of one case, per worker label, in repeat order."""

    case: dict[str, Any]
    samples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    """Worker label -> why it could not run the case (it has no samples of it)."""

    @property
    def name(self) -> str:
        return str(self.case["name"])


def list_cases(workers: Sequence[Worker], workload: str,
               params: dict[str, Any]) -> list[dict[str, Any]]:
    """The workload's cases as the first worker lists them, after checking that every worker
    lists the same names in the same order (raises :class:`WorkerError` otherwise)."""
    lists = [(w, w.cases(workload, params)) for w in workers]
    first_worker, first = lists[0]
    names = [c["name"] for c in first]
    for w, other in lists[1:]:
        other_names = [c["name"] for c in other]
        if other_names != names:
            only_first = sorted(set(names) - set(other_names))
            only_other = sorted(set(other_names) - set(names))
            raise WorkerError(f"the {first_worker.label} and {w.label} workers list different "
                              f"{workload} cases (only {first_worker.label}: {only_first}; only "
                              f"{w.label}: {only_other}; or a different order)")
    return first


def select_cases(cases: Sequence[dict[str, Any]], patterns: str | None) -> list[dict[str, Any]]:
    """The cases whose name contains one of the comma-separated ``patterns`` (case-insensitive),
    in their own order; every pattern must match (else ValueError).  Names may contain commas:
    at each point the longest run of comma-separated pieces that matches is one pattern."""
    if not patterns:
        return list(cases)
    names = [str(c["name"]).lower() for c in cases]
    pieces = patterns.lower().split(",")

    def matches(pattern: str) -> list[int]:
        return [i for i, n in enumerate(names) if pattern and pattern in n]

    chosen: set[int] = set()
    i = 0
    while i < len(pieces):
        for j in range(len(pieces), i, -1):
            hits = matches(",".join(pieces[i:j]).strip())
            if hits:
                chosen.update(hits)
                i = j
                break
        else:
            if pieces[i].strip():
                listing = "; ".join(str(c["name"]) for c in cases)
                raise ValueError(f"no scenario matches {pieces[i].strip()!r} "
                                 f"(scenarios: {listing})")
            i += 1
    return [c for i, c in enumerate(cases) if i in chosen]


def run_interleaved(workers: Sequence[Worker], workload: str, cases: Iterable[dict[str, Any]],
                    params: dict[str, Any], repeats: int, warmup: bool = False,
                    progress: Callable[[str], None] | None = None) -> list[CaseSamples]:
    """Measure every case ``repeats`` times on every worker, in turns.

    Per case: an optional warm-up run on each worker (discarded), then repeat r runs the workers
    starting from worker ``r mod len(workers)``, so no worker always goes first.  A worker that
    answers a skipped sample (``{"skipped": reason}``: it cannot run the case, e.g. an older
    kvcore) is recorded in ``skipped``, keeps no samples of the case and is not asked again."""
    cases = list(cases)
    out = []
    k = len(workers)
    for ci, case in enumerate(cases):
        name = str(case["name"])
        if progress is not None:
            progress(f"[{ci + 1}/{len(cases)}] {name}")
        result = CaseSamples(case, {w.label: [] for w in workers})
        if warmup:
            for w in workers:
                _take(w, workload, result, params, -1, warmup=True)
        for r in range(repeats):
            for j in range(k):
                _take(workers[(r + j) % k], workload, result, params, r)
        out.append(result)
    return out


def _take(w: Worker, workload: str, result: CaseSamples, params: dict[str, Any], repeat: int,
          warmup: bool = False) -> None:
    """One measurement of ``result``'s case on ``w`` (none if ``w`` skipped the case), kept in
    ``result`` unless a warm-up."""
    if w.label in result.skipped:
        return
    sample = w.measure(workload, result.name, params, repeat, warmup=warmup)
    if "skipped" in sample:
        result.skipped[w.label] = str(sample["skipped"])
    elif not warmup:
        result.samples[w.label].append(sample)


@dataclass(frozen=True)
class Spread:
    median: float
    low: float
    high: float


def per_unit(sample: dict[str, Any], scale: float = 1.0) -> float:
    """The sample's measured ns per unit of work, times ``scale``."""
    return float(sample["ns"]) / float(sample["units"]) * scale


def spread(values: Sequence[float]) -> Spread:
    return Spread(statistics.median(values), min(values), max(values))


def work_mismatches(result: CaseSamples, ignore: Iterable[str] = ()) -> list[str]:
    """Descriptions of repeats whose ``info`` (what the run did) differs between workers (those
    in ``ignore`` and those without samples left out)."""
    left_out = set(ignore)
    labels = [label for label, samples in result.samples.items()
              if samples and label not in left_out]
    if len(labels) < 2:
        return []
    out = []
    base = labels[0]
    for label in labels[1:]:
        for r, (a, b) in enumerate(zip(result.samples[base], result.samples[label])):
            if a.get("info") != b.get("info"):
                out.append(f"{result.name}, repeat {r + 1}: {base} {a.get('info')} vs "
                           f"{label} {b.get('info')}")
                break
    return out


def start_workers(specs: Sequence[WorkerSpec], optional: Sequence[str] = (),
                  timeout: float = DEFAULT_TIMEOUT_S) -> tuple[list[Worker], list[str]]:
    """Start a worker per spec.  A failure of a worker whose label is in ``optional`` becomes a
    note (returned) and the others go on; any other failure closes the started ones and
    raises."""
    workers: list[Worker] = []
    notes: list[str] = []
    try:
        for spec in specs:
            try:
                workers.append(Worker(spec, timeout))
            except WorkerError as exc:
                if spec.label not in optional:
                    raise
                notes.append(f"{spec.label} skipped: {exc}")
    except BaseException:
        for w in workers:
            w.close()
        raise
    return workers, notes
