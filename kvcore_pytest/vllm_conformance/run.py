"""Run vLLM's own unit tests twice — stock, then with kvcore's schedulers — and compare.

    python -m kvcore_pytest.vllm_conformance.run --vllm-version 0.32.0 \\
        --python .vllm-venv/bin/python [--jobs 2]

(``scripts/vllm_conformance.sh VERSION`` builds the venv, fetches the tests and runs this.)

The files are :data:`FILES` (globs over vLLM's source tree, extracted by
``scripts/vllm_tests.sh`` into ``.vllm-tests/VERSION/src``).  The stock run runs them all, once
per vLLM version and file list: its outcomes are committed as the version's *stock fixture*
(``stock/VERSION.json``, written by ``--write-stock-fixture``, i.e.
``scripts/vllm_stock_fixture.sh VERSION``), and a run with the fixture runs only the kvcore
side, then reruns stock just for the tests whose kvcore outcome differs from the fixture's (a
fixture entry that no longer holds fails the suite: regenerate it).  Without a fixture (or with
``--rerun-stock``) the stock run is made here, its results kept for the same inputs.  The
kvcore run (``--kvcore-schedulers``, :mod:`~kvcore_pytest.vllm_conformance.plugin`) runs the
tests that pass stock and build a vLLM scheduler in the test's process (the scheduler tests;
``--kvcore-all``: every test that passes stock).  The verdict (:func:`compare`) fails when

* a test run with kvcore does not pass (failed, error, skipped, not collected) and is not on
  the version's exceptions list (``exceptions/VERSION.toml``: node id → reason);
* an excepted test passes with kvcore, or is not one the kvcore run runs (stale entry);
* a test that built a vLLM scheduler in the stock run passes with kvcore without having built a
  kvcore-managed one, or built one with vLLM's manager (the rebinding missed it).

Tests that build no scheduler are not counted (the summary says how many): the rebinding
cannot reach them but through class identity, and running them again would triple the time
(with ``--kvcore-all`` a regression among them fails the suite too).
Results (JSON per run, pytest's logs) are kept in ``.vllm-tests/VERSION/results``.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import hashlib
import json
import os
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib

HERE = Path(__file__).resolve().parent
FILES = HERE / "files.txt"
EXCEPTIONS = HERE / "exceptions"
STOCK = HERE / "stock"
FIXTURE_FORMAT = 1
PLUGIN = "kvcore_pytest.vllm_conformance.plugin"
ADAPTER = "KVCacheManagerAdapter"  # kvcore's manager class inside vLLM's scheduler


class ConformanceError(Exception):
    """The suite could not be run or its inputs are wrong (not a test verdict)."""


# --- inputs -----------------------------------------------------------------------------------

def read_patterns(path: Path = FILES) -> list[str]:
    """The file list: one glob per line; ``#`` starts a comment."""
    patterns = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            patterns.append(line)
    return patterns


def expand(patterns: Iterable[str], src: Path) -> list[str]:
    """The test files the patterns match under ``src``, relative, sorted, each once."""
    files: set[str] = set()
    for pattern in patterns:
        matches = [Path(p).relative_to(src).as_posix()
                   for p in glob.glob(str(src / pattern)) if Path(p).is_file()]
        if not matches:
            raise ConformanceError(f"{pattern!r} matches no file under {src}")
        files.update(matches)
    return sorted(files)


def read_exceptions(path: Path) -> dict[str, str]:
    """``[[cause]]`` tables (``reason``, ``tests``) → node id → reason; a missing file is an
    empty list."""
    if not path.is_file():
        return {}
    if sys.version_info < (3, 11):
        raise ConformanceError("reading the exceptions list needs Python 3.11 (tomllib)")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConformanceError(f"{path}: {e}") from e
    unknown = set(data) - {"cause"}
    if unknown:
        raise ConformanceError(f"{path}: unknown keys {sorted(unknown)} (only [[cause]] tables)")
    out: dict[str, str] = {}
    for i, cause in enumerate(data.get("cause", [])):
        reason, tests = cause.get("reason"), cause.get("tests")
        if not isinstance(reason, str) or not reason.strip():
            raise ConformanceError(f"{path}: cause #{i + 1} has no reason")
        if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
            raise ConformanceError(f"{path}: cause {reason!r} lists no tests")
        if set(cause) - {"reason", "tests"}:
            raise ConformanceError(f"{path}: cause {reason!r} has keys other than reason, tests")
        for test in tests:
            if test in out:
                raise ConformanceError(f"{path}: {test} is listed twice ({out[test]!r} and "
                                       f"{reason!r})")
            out[test] = reason
    return out


@dataclasses.dataclass(frozen=True)
class Result:
    outcome: str  # passed, failed, error, skipped, xfailed, xpassed
    managers: Mapping[str, int]  # KV-cache manager class name -> schedulers built with it
    message: str = ""

    @property
    def kvcore_schedulers(self) -> int:
        return self.managers.get(ADAPTER, 0)

    @property
    def other_schedulers(self) -> int:
        return sum(n for name, n in self.managers.items() if name != ADAPTER)


@dataclasses.dataclass(frozen=True)
class RunResults:
    tests: Mapping[str, Result]
    collection_errors: Mapping[str, str]

    @classmethod
    def load(cls, path: Path) -> RunResults:
        data = json.loads(path.read_text())
        tests = {nodeid: Result(t["outcome"], t["managers"], t.get("message", ""))
                 for nodeid, t in data["tests"].items()}
        return cls(tests, data["collection_errors"])


def write_fixture(path: Path, version: str, files: list[str], stock: RunResults) -> None:
    """The stock run's outcomes as the version's fixture: the vLLM version, the test files it
    ran, and per test its outcome and the KV-cache managers of the schedulers it built (one
    test per line, sorted, so a regenerated fixture diffs line by line)."""
    lines = [f'{{"format": {FIXTURE_FORMAT}, "version": {json.dumps(version)},',
             f' "files": {json.dumps(files)},',
             f' "collection_errors": {json.dumps(dict(sorted(stock.collection_errors.items())))},',
             ' "tests": {']
    tests = sorted(stock.tests.items())
    for i, (nodeid, r) in enumerate(tests):
        comma = "," if i + 1 < len(tests) else ""
        entry = [r.outcome, dict(sorted(r.managers.items()))]
        lines.append(f"  {json.dumps(nodeid)}: {json.dumps(entry)}{comma}")
    lines.append("}}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def read_fixture(path: Path, version: str, files: list[str]) -> RunResults:
    """The stock outcomes a fixture holds; raises :class:`ConformanceError` when it is for
    another version or another file list (it is stale: regenerate it)."""
    try:
        data = json.loads(path.read_text())
        if data.get("format") != FIXTURE_FORMAT:
            raise ConformanceError(f"{path}: format {data.get('format')!r}, expected "
                                   f"{FIXTURE_FORMAT}")
        tests = {nodeid: Result(entry[0], entry[1]) for nodeid, entry in data["tests"].items()}
        collection_errors = dict(data["collection_errors"])
        fixture_version, fixture_files = data["version"], data["files"]
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        raise ConformanceError(f"{path} is not a stock fixture: {e}") from e
    regenerate = f"regenerate it: bash scripts/vllm_stock_fixture.sh {version}"
    if fixture_version != version:
        raise ConformanceError(f"{path} is vLLM {fixture_version}'s, not {version}'s: "
                               f"{regenerate}")
    if fixture_files != files:
        added = sorted(set(files) - set(fixture_files))
        removed = sorted(set(fixture_files) - set(files))
        raise ConformanceError(f"{path} was made for other test files (now also {added}, no "
                               f"longer {removed}): {regenerate}")
    return RunResults(tests, collection_errors)


def recheck(stock: RunResults, kvcore: RunResults, selected: Iterable[str],
            fresh: RunResults) -> tuple[RunResults, dict[str, str]]:
    """Fold a stock rerun of the tests that did not pass with kvcore (``fresh``) into the
    fixture's outcomes; returns the corrected stock results and the fixture entries that no
    longer hold (test -> what the rerun gave)."""
    tests = dict(stock.tests)
    stale: dict[str, str] = {}
    for test in selected:
        k = kvcore.tests.get(test)
        if k is not None and k.outcome == "passed":
            continue
        now = fresh.tests.get(test)
        if now is None:
            stale[test] = "not collected in the stock rerun"
            tests[test] = Result("error", {}, "not collected in the stock rerun")
        elif now.outcome != stock.tests[test].outcome:
            stale[test] = f"the fixture says {stock.tests[test].outcome}, the rerun {now.outcome}"
            tests[test] = now
    return RunResults(tests, stock.collection_errors), stale


# --- the verdict ------------------------------------------------------------------------------

def to_run_with_kvcore(stock: RunResults, everything: bool = False) -> list[str]:
    """The kvcore run's tests: those that pass stock and build a vLLM scheduler (in this
    process: engines in child processes are stock either way), or all that pass stock."""
    return sorted(test for test, r in stock.tests.items() if r.outcome == "passed" and (
        everything or r.kvcore_schedulers + r.other_schedulers))


@dataclasses.dataclass
class Verdict:
    stock: RunResults
    kvcore: RunResults
    exceptions: Mapping[str, str]
    passed_stock: list[str] = dataclasses.field(default_factory=list)
    scheduler_tests: list[str] = dataclasses.field(default_factory=list)  # pass stock, build one
    built_kvcore: list[str] = dataclasses.field(default_factory=list)
    passed_kvcore: list[str] = dataclasses.field(default_factory=list)  # scheduler tests
    excepted: dict[str, str] = dataclasses.field(default_factory=dict)  # test -> reason
    regressions: dict[str, str] = dataclasses.field(default_factory=dict)  # test -> what kvcore did
    stale: dict[str, str] = dataclasses.field(default_factory=dict)  # exception -> why stale
    stale_fixture: dict[str, str] = dataclasses.field(default_factory=dict)  # test -> rerun
    bypassed: dict[str, str] = dataclasses.field(default_factory=dict)  # test -> what it built
    uncounted_run: list[str] = dataclasses.field(default_factory=list)  # build none, run anyway
    uncounted_passed: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.regressions or self.stale or self.bypassed or self.stale_fixture)


def _describe(result: Result | None) -> str:
    if result is None:
        return "not run (not collected with kvcore)"
    if result.message:
        return f"{result.outcome}: {result.message}"
    return result.outcome


def compare(stock: RunResults, kvcore: RunResults, exceptions: Mapping[str, str],
            selected: Iterable[str]) -> Verdict:
    """The verdict on the tests run with kvcore (``selected``, from
    :func:`to_run_with_kvcore`)."""
    v = Verdict(stock, kvcore, exceptions)
    selected = set(selected)
    for test, s in sorted(stock.tests.items()):
        if s.outcome != "passed":
            continue
        v.passed_stock.append(test)
        counted = s.other_schedulers + s.kvcore_schedulers > 0
        if counted:
            v.scheduler_tests.append(test)
        elif test in selected:
            v.uncounted_run.append(test)
        if test not in selected:
            continue
        k = kvcore.tests.get(test)
        if counted and k is not None and k.kvcore_schedulers:
            v.built_kvcore.append(test)
        passes = k is not None and k.outcome == "passed"
        if passes and counted:
            assert k is not None
            if not k.kvcore_schedulers or k.other_schedulers:
                v.bypassed[test] = (f"built {k.kvcore_schedulers} kvcore-managed and "
                                    f"{k.other_schedulers} vLLM-managed schedulers")
            else:
                v.passed_kvcore.append(test)
        elif passes:
            v.uncounted_passed.append(test)
        if test in exceptions:
            if passes:
                v.stale[test] = "passes with kvcore now: remove it from the list"
            else:
                v.excepted[test] = exceptions[test]
        elif not passes:
            v.regressions[test] = _describe(k)
    for test in exceptions:
        if test in selected:
            continue
        if test not in stock.tests:
            v.stale[test] = "not collected stock"
        elif stock.tests[test].outcome != "passed":
            v.stale[test] = f"does not pass stock ({stock.tests[test].outcome})"
        else:
            v.stale[test] = "builds no scheduler, so it is not run with kvcore"
    return v


def summary(v: Verdict, version: str) -> str:
    lines = [f"vLLM {version} conformance: vLLM's unit tests, stock and with kvcore's schedulers"]

    def outcomes(run: RunResults) -> str:
        counts = Counter(t.outcome for t in run.tests.values())
        parts = [f"{counts[o]} {o}" for o in ("passed", "failed", "error", "skipped",
                                              "xfailed", "xpassed") if counts[o]]
        if run.collection_errors:
            parts.append(f"{len(run.collection_errors)} files failed to collect")
        return ", ".join(parts) or "nothing"

    lines.append(f"  stock:  {len(v.stock.tests)} tests: {outcomes(v.stock)}")
    lines.append(f"  kvcore: {len(v.kvcore.tests)} tests (those that pass stock"
                 f"{'' if v.uncounted_run else ' and build a scheduler'}): "
                 f"{outcomes(v.kvcore)}")
    n_sched = len(v.scheduler_tests)
    lines.append(f"  scheduler tests (pass stock and build a vLLM scheduler): {n_sched}; "
                 f"built a kvcore-managed scheduler: {len(v.built_kvcore)} (none: "
                 f"{n_sched - len(v.built_kvcore)}); pass with kvcore: {len(v.passed_kvcore)}")
    uncounted = len(v.passed_stock) - n_sched
    lines.append(f"  not counted (pass stock, build no scheduler): {uncounted}; " + (
        f"run with kvcore: {len(v.uncounted_run)}, of them pass: {len(v.uncounted_passed)}"
        if v.uncounted_run else "not run with kvcore (--kvcore-all runs them)"))
    by_reason: dict[str, int] = Counter(v.excepted.values())
    lines.append(f"  excepted (exceptions/{version}.toml): {len(v.excepted)}")
    for reason, n in sorted(by_reason.items(), key=lambda kv: (-kv[1], kv[0])):
        lines.append(f"    {n:4d}  {reason}")

    def section(title: str, items: Mapping[str, str]) -> None:
        if items:
            lines.append(f"  {title}: {len(items)}")
            lines.extend(f"    {test}\n        {why}" for test, why in sorted(items.items()))

    section("REGRESSIONS (pass stock, not with kvcore, not excepted)", v.regressions)
    section("STALE EXCEPTIONS", v.stale)
    section("BYPASSED (passed with kvcore, but not on a kvcore-managed scheduler alone)",
            v.bypassed)
    section(f"STALE STOCK FIXTURE (stock/{version}.json; regenerate: bash "
            f"scripts/vllm_stock_fixture.sh {version})", v.stale_fixture)
    lines.append(f"  verdict: {'PASS' if v.ok else 'FAIL'}")
    return "\n".join(lines)


def draft_exceptions(v: Verdict) -> str:
    """The current failures as an exceptions file, grouped by kvcore's error line: a draft for
    a person to give each group its cause."""
    groups: dict[str, list[str]] = defaultdict(list)
    for test in sorted({*v.regressions, *v.excepted}):
        k = v.kvcore.tests.get(test)
        reason = v.exceptions.get(test) or _describe(k)
        groups[reason].append(test)
    out = []
    for reason, tests in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        out.append("[[cause]]")
        out.append(f"reason = {json.dumps(reason)}")
        out.append("tests = [")
        out.extend(f"    {json.dumps(t)}," for t in tests)
        out.append("]\n")
    return "\n".join(out)


# --- running pytest ---------------------------------------------------------------------------

def _guarded(cmd: list[str]) -> list[str]:
    """``cmd`` made to end with this process, however it ends (a run takes minutes)."""
    from kvcore.proc.lifeline import guarded  # kvcore's import is slow: only when running

    return guarded(cmd)


def _pytest(python: Path, src: Path, args: list[str], env: Mapping[str, str], log: Path,
            json_path: Path) -> float:
    """One pytest run in vLLM's tree; returns its wall time.  Test failures are results;
    anything else (pytest crashed, no results) raises."""
    json_path.unlink(missing_ok=True)
    cmd = [str(python), "-m", "pytest", "-p", PLUGIN, "--kvcore-conformance-json",
           str(json_path), "-p", "no:cacheprovider", "-q", "-rN",
           "--continue-on-collection-errors",
           "-o", "asyncio_default_fixture_loop_scope=function", *args]
    start = time.monotonic()
    with log.open("w") as out:
        rc = subprocess.call(_guarded(cmd), cwd=src, env={**os.environ, **env}, stdout=out,
                             stderr=subprocess.STDOUT)
    elapsed = time.monotonic() - start
    if rc not in (0, 1) or not json_path.is_file():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise ConformanceError(f"pytest exited {rc} without results ({log}):\n{tail}")
    return elapsed


def _inputs_key(python: Path, src: Path, files: list[str], hf_home: Path,
                options: list[str]) -> str:
    """What the stock run's results depend on: vLLM's tree, the venv, the configs, the files
    and this harness (not kvcore, which the stock run does not use)."""
    h = hashlib.sha256()
    venv = python.resolve().parent.parent
    for part in (sorted(venv.glob(".kvcore-*stamp")), [src / ".kvcore-vllm-tests-stamp"],
                 [hf_home / ".kvcore-hf-cache"], [HERE / "plugin.py"]):
        for p in part:
            h.update(p.name.encode() + b"\0" + (p.read_bytes() if p.is_file() else b"-"))
    h.update("\n".join([*files, *options]).encode())
    return h.hexdigest()


def _stock_run(python: Path, src: Path, files: list[str], hf_home: Path, common: list[str],
               env: Mapping[str, str], results: Path, fresh: bool) -> RunResults:
    """The stock run of every file (its results kept for the same inputs unless ``fresh``)."""
    key = _inputs_key(python, src, files, hf_home, common)
    stock_json, key_file = results / "stock.json", results / "stock.key"
    if (not fresh and stock_json.is_file() and key_file.is_file()
            and key_file.read_text() == key):
        print("  stock run: results kept from a run with the same inputs "
              f"({stock_json}; --rerun-stock to run it again)", flush=True)
    else:
        key_file.unlink(missing_ok=True)
        t = _pytest(python, src, [*common, *files], env, results / "stock.log", stock_json)
        key_file.write_text(key)
        print(f"  stock run took {t:.0f}s", flush=True)
    return RunResults.load(stock_json)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-version", required=True, help="e.g. 0.32.0")
    parser.add_argument("--python", type=Path, required=True,
                        help="the python of a venv with that vLLM and kvcore")
    parser.add_argument("--root", type=Path, default=Path(".vllm-tests"),
                        help="where scripts/vllm_tests.sh extracted the tests "
                        "(ROOT/VERSION/src; default .vllm-tests)")
    parser.add_argument("--jobs", "-n", type=int, default=0,
                        help="pytest-xdist workers (0: none)")
    parser.add_argument("--exceptions", type=Path, default=None,
                        help="exceptions list (default: this package's exceptions/VERSION.toml)")
    parser.add_argument("--write-draft", type=Path, default=None,
                        help="also write the current failures, grouped by kvcore's error, as "
                        "an exceptions file to this path (each cause still needs a reason)")
    parser.add_argument("--rerun-stock", action="store_true",
                        help="run stock (every test) instead of reading the stock fixture, even "
                        "when results for the same inputs are kept")
    parser.add_argument("--stock-fixture", type=Path, default=None,
                        help="the stock outcomes (default: this package's stock/VERSION.json; "
                        "without one, stock is run)")
    parser.add_argument("--write-stock-fixture", action="store_true",
                        help="run stock and write its outcomes as the stock fixture, then stop")
    parser.add_argument("--kvcore-all", action="store_true",
                        help="run every test that passes stock with kvcore, not only those "
                        "that build a scheduler")
    parser.add_argument("--vllm-cleanup", action="store_true",
                        help="vLLM's own cleanup after every test (gc of the whole heap, 0.4 s "
                        "a test) instead of the plugin's --light-cleanup")
    args = parser.parse_args(argv)
    version: str = args.vllm_version
    base = args.root.resolve() / version
    src, hf_home, results = base / "src", base / "hf", base / "results"
    python = Path(os.path.abspath(args.python))
    exceptions_path = args.exceptions or EXCEPTIONS / f"{version}.toml"
    try:
        if not (src / "tests").is_dir():
            raise ConformanceError(f"no vLLM tests at {src}: run "
                                   f"bash scripts/vllm_tests.sh {version}")
        files = expand(read_patterns(), src)
        exceptions = read_exceptions(exceptions_path)
        results.mkdir(parents=True, exist_ok=True)
        subprocess.run(_guarded([str(python), "-m", "kvcore_pytest.vllm_conformance.hf_cache",
                                 str(hf_home)]), check=True)
        env = {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "VLLM_TARGET_DEVICE": "cpu", "VLLM_LOGGING_LEVEL": "ERROR",
               "PYTHONDONTWRITEBYTECODE": "1"}
        common = ["-n", str(args.jobs)] if args.jobs else ["-p", "no:xdist"]
        if not args.vllm_cleanup:
            common.append("--light-cleanup")
        fixture = args.stock_fixture or STOCK / f"{version}.json"
        use_fixture = not (args.rerun_stock or args.write_stock_fixture) and fixture.is_file()
        print(f"vLLM {version}: {len(files)} test files, {len(exceptions)} excepted tests",
              flush=True)
        if use_fixture:
            stock = read_fixture(fixture, version, files)
            print(f"  stock outcomes from the fixture {fixture} ({len(stock.tests)} tests; "
                  "--rerun-stock runs stock instead)", flush=True)
        else:
            stock = _stock_run(python, src, files, hf_home, common, env, results,
                               fresh=args.rerun_stock or args.write_stock_fixture)
        if args.write_stock_fixture:
            write_fixture(fixture, version, files, stock)
            print(f"  stock fixture written to {fixture} ({len(stock.tests)} tests)")
            return 0
        selected = to_run_with_kvcore(stock, args.kvcore_all)
        if not selected:
            raise ConformanceError("no test passed stock and built a scheduler: see "
                                   f"{results / 'stock.log'}")
        # pytest reads the node ids from a file ("@file", pytest >= 8.2): hundreds of them.
        ids = results / "kvcore-tests.txt"
        ids.write_text("\n".join(selected) + "\n")
        t = _pytest(python, src, [*common, "--kvcore-schedulers", f"@{ids}"], env,
                    results / "kvcore.log", results / "kvcore.json")
        print(f"  kvcore run ({len(selected)} tests) took {t:.0f}s", flush=True)
        kvcore = RunResults.load(results / "kvcore.json")
        stale_fixture: dict[str, str] = {}
        if use_fixture:
            differ = [test for test in selected if kvcore.tests.get(test) is None
                      or kvcore.tests[test].outcome != "passed"]
            if differ:  # do they still pass stock?  Rerun stock for those alone
                recheck_ids = results / "stock-recheck-tests.txt"
                recheck_ids.write_text("\n".join(differ) + "\n")
                t = _pytest(python, src, [*common, f"@{recheck_ids}"], env,
                            results / "stock-recheck.log", results / "stock-recheck.json")
                print(f"  stock rerun of the {len(differ)} tests that did not pass with kvcore "
                      f"took {t:.0f}s", flush=True)
                stock, stale_fixture = recheck(stock, kvcore, differ,
                                               RunResults.load(results / "stock-recheck.json"))
        verdict = compare(stock, kvcore, exceptions, selected)
        verdict.stale_fixture = stale_fixture
    except (ConformanceError, subprocess.CalledProcessError) as e:
        print(f"vllm_conformance: error: {e}", file=sys.stderr)
        return 2
    print(summary(verdict, version))
    if args.write_draft:
        args.write_draft.write_text(draft_exceptions(verdict))
        print(f"  draft exceptions written to {args.write_draft}")
    return 0 if verdict.ok else 1


if __name__ == "__main__":
    sys.exit(main())
