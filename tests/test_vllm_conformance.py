"""The vLLM conformance runner's inputs and verdict (kvcore_pytest.vllm_conformance.run), on
made-up results: no vLLM needed.  The plugin itself is tested in the vLLM venv
(tests/integrations/vllm/test_conformance_plugin.py)."""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path

import pytest

from kvcore_pytest.vllm_conformance.run import (
    EXCEPTIONS,
    FILES,
    STOCK,
    ConformanceError,
    Result,
    RunResults,
    Verdict,
    compare,
    draft_exceptions,
    expand,
    read_exceptions,
    read_fixture,
    read_patterns,
    recheck,
    summary,
    to_run_with_kvcore,
    write_fixture,
)

VLLM = {"KVCacheManager": 1}
KVCORE = {"KVCacheManagerAdapter": 1}


def run(**tests: tuple[str, dict[str, int]]) -> RunResults:
    return RunResults({f"t.py::{name}": Result(outcome, managers, "boom" * (
        outcome != "passed")) for name, (outcome, managers) in tests.items()}, {})


def compare_all(stock: RunResults, kvcore: RunResults, exceptions: dict[str, str]) -> Verdict:
    """The verdict when every test that passes stock was run with kvcore (--kvcore-all)."""
    return compare(stock, kvcore, exceptions, to_run_with_kvcore(stock, everything=True))


def test_a_scheduler_test_that_passes_both_ways_counts() -> None:
    v = compare_all(run(a=("passed", VLLM)), run(a=("passed", KVCORE)), {})
    assert v.ok
    assert v.scheduler_tests == v.built_kvcore == v.passed_kvcore == ["t.py::a"]


def test_a_regression_fails_unless_excepted() -> None:
    stock, kv = run(a=("passed", VLLM), b=("passed", {})), run(a=("failed", {}), b=("passed", {}))
    v = compare_all(stock, kv, {})
    assert not v.ok
    assert v.regressions == {"t.py::a": "failed: boom"}
    v = compare_all(stock, kv, {"t.py::a": "refused: Mamba"})
    assert v.ok
    assert v.excepted == {"t.py::a": "refused: Mamba"}
    assert "refused: Mamba" in summary(v, "0.32.0")


@pytest.mark.parametrize("outcome", ["error", "skipped", "xfailed", None])
def test_anything_but_a_pass_with_kvcore_is_a_regression(outcome: str | None) -> None:
    kv = run(a=(outcome, KVCORE)) if outcome else run()
    v = compare_all(run(a=("passed", VLLM)), kv, {})
    assert list(v.regressions) == ["t.py::a"]
    if outcome is None:
        assert "not collected" in v.regressions["t.py::a"]


def test_a_test_that_builds_no_scheduler_is_not_counted_but_must_not_regress() -> None:
    v = compare_all(run(a=("passed", {})), run(a=("passed", {})), {})
    assert v.ok and v.scheduler_tests == [] and v.uncounted_passed == ["t.py::a"]
    v = compare_all(run(a=("passed", {})), run(a=("failed", {})), {})
    assert list(v.regressions) == ["t.py::a"]


def test_by_default_only_scheduler_tests_are_run_with_kvcore() -> None:
    stock = run(a=("passed", VLLM), b=("passed", {}), c=("failed", VLLM))
    assert to_run_with_kvcore(stock) == ["t.py::a"]
    assert to_run_with_kvcore(stock, everything=True) == ["t.py::a", "t.py::b"]
    v = compare(stock, run(a=("passed", KVCORE)), {}, to_run_with_kvcore(stock))
    assert v.ok and v.passed_kvcore == ["t.py::a"] and v.uncounted_run == []
    assert "not run with kvcore" in summary(v, "0.32.0")
    v = compare(stock, run(a=("passed", KVCORE)), {"t.py::b": "x"}, to_run_with_kvcore(stock))
    assert v.stale == {"t.py::b": "builds no scheduler, so it is not run with kvcore"}


def test_tests_that_fail_stock_are_not_compared() -> None:
    v = compare_all(run(a=("failed", VLLM), b=("skipped", {})), run(), {})
    assert v.ok and v.passed_stock == [] and not v.regressions


@pytest.mark.parametrize("kvcore_managers", [{}, VLLM, {**VLLM, **KVCORE}])
def test_a_pass_without_kvcore_managing_every_scheduler_is_bypassed(
        kvcore_managers: dict[str, int]) -> None:
    v = compare_all(run(a=("passed", VLLM)), run(a=("passed", kvcore_managers)), {})
    assert not v.ok
    assert list(v.bypassed) == ["t.py::a"]
    assert v.passed_kvcore == []


def test_stale_exceptions_fail() -> None:
    stock = run(a=("passed", VLLM), b=("failed", VLLM))
    v = compare_all(stock, run(a=("passed", KVCORE)),
                {"t.py::a": "x", "t.py::b": "y", "t.py::gone": "z"})
    assert not v.ok
    assert "passes with kvcore now" in v.stale["t.py::a"]
    assert v.stale["t.py::b"] == "does not pass stock (failed)"
    assert v.stale["t.py::gone"] == "not collected stock"


def test_the_draft_groups_failures_by_error_and_reads_back(tmp_path: Path) -> None:
    stock = run(a=("passed", VLLM), b=("passed", VLLM), c=("passed", VLLM))
    kv = RunResults({"t.py::a": Result("failed", {}, "E1"),
                     "t.py::b": Result("failed", {}, "E1"),
                     "t.py::c": Result("error", {}, "E2")}, {})
    path = tmp_path / "x.toml"
    path.write_text(draft_exceptions(compare_all(stock, kv, {})))
    listed = read_exceptions(path)
    assert listed == {"t.py::a": "failed: E1", "t.py::b": "failed: E1", "t.py::c": "error: E2"}
    assert compare_all(stock, kv, listed).ok


@pytest.mark.parametrize("text, error", [
    ('[[cause]]\ntests = ["a"]\n', "has no reason"),
    ('[[cause]]\nreason = "r"\ntests = []\n', "lists no tests"),
    ('[[cause]]\nreason = "r"\ntests = ["a"]\n[[cause]]\nreason = "s"\ntests = ["a"]\n',
     "listed twice"),
    ('reason = "r"\n', "unknown keys"),
])
def test_bad_exception_files_are_refused(tmp_path: Path, text: str, error: str) -> None:
    path = tmp_path / "x.toml"
    path.write_text(text)
    with pytest.raises(ConformanceError, match=error):
        read_exceptions(path)


def test_patterns_expand_and_a_pattern_matching_nothing_is_an_error(tmp_path: Path) -> None:
    for name in ("tests/a/test_x.py", "tests/a/test_y.py", "tests/a/utils.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).touch()
    assert expand(["tests/a/test_*.py", "tests/a/test_x.py"], tmp_path) == [
        "tests/a/test_x.py", "tests/a/test_y.py"]
    with pytest.raises(ConformanceError, match="test_z"):
        expand(["tests/a/test_z.py"], tmp_path)


def test_the_committed_lists_read() -> None:
    assert "tests/v1/core/test_scheduler.py" in read_patterns(FILES)
    for path in sorted(EXCEPTIONS.glob("*.toml")):
        for test, reason in read_exceptions(path).items():
            assert test.startswith("tests/") and "::" in test, (path, test)
            assert reason.strip(), (path, test)


# --- the stock fixture ---------------------------------------------------------------------------

def test_a_fixture_round_trips_the_stock_outcomes(tmp_path: Path) -> None:
    stock = RunResults({"t.py::a": Result("passed", VLLM), "t.py::b": Result("failed", {})},
                       {"t.py": "boom"})
    path = tmp_path / "0.32.0.json"
    write_fixture(path, "0.32.0", ["t.py"], stock)
    back = read_fixture(path, "0.32.0", ["t.py"])
    assert {k: (r.outcome, dict(r.managers)) for k, r in back.tests.items()} == {
        "t.py::a": ("passed", VLLM), "t.py::b": ("failed", {})}
    assert back.collection_errors == {"t.py": "boom"}


@pytest.mark.parametrize("version, files, says", [
    ("0.33.0", ["t.py"], "vLLM 0.32.0's, not 0.33.0's"),
    ("0.32.0", ["t.py", "u.py"], "other test files (now also ['u.py']"),
])
def test_a_fixture_for_another_version_or_file_list_is_refused(
        tmp_path: Path, version: str, files: list[str], says: str) -> None:
    path = tmp_path / "f.json"
    write_fixture(path, "0.32.0", ["t.py"], run(a=("passed", VLLM)))
    with pytest.raises(ConformanceError, match="regenerate it: bash scripts/"
                       f"vllm_stock_fixture.sh {version}") as e:
        read_fixture(path, version, files)
    assert says in str(e.value)


def test_a_broken_fixture_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "f.json"
    path.write_text('{"format": 1, "version": "0.32.0"}')
    with pytest.raises(ConformanceError, match="not a stock fixture"):
        read_fixture(path, "0.32.0", [])


def test_the_stock_rerun_confirms_a_regression_or_finds_the_fixture_stale() -> None:
    stock = run(a=("passed", VLLM), b=("passed", VLLM), c=("passed", VLLM))
    kvcore = run(a=("passed", KVCORE), b=("failed", {}), c=("failed", {}))
    fresh = run(b=("passed", VLLM), c=("failed", {}))  # b still passes stock, c no longer does
    selected = to_run_with_kvcore(stock)
    corrected, stale = recheck(stock, kvcore, ["t.py::b", "t.py::c"], fresh)
    assert stale == {"t.py::c": "the fixture says passed, the rerun failed"}
    v = compare(corrected, kvcore, {}, selected)
    v.stale_fixture = stale
    assert v.regressions == {"t.py::b": "failed: boom"}  # a real regression
    assert "t.py::c" not in v.regressions  # fails stock now: not kvcore's
    assert not v.ok
    assert "STALE STOCK FIXTURE" in summary(v, "0.32.0")
    # With the fixture right, only the regression fails the suite.
    v = compare(*recheck(stock, kvcore, ["t.py::b"], fresh)[:1], kvcore, {}, ["t.py::a", "t.py::b"])
    assert not v.ok and not v.stale_fixture and list(v.regressions) == ["t.py::b"]


def test_the_committed_fixtures_match_the_file_list_and_the_exceptions() -> None:
    patterns = read_patterns()
    versions = sorted(p.stem for p in EXCEPTIONS.glob("*.toml"))
    assert versions == sorted(p.stem for p in STOCK.glob("*.json"))
    for version in versions:
        data = json.loads((STOCK / f"{version}.json").read_text())
        files = data["files"]
        assert data["version"] == version
        assert all(any(fnmatch.fnmatchcase(f, p) for p in patterns) for f in files)
        assert all(any(fnmatch.fnmatchcase(f, p) for f in files) for p in patterns)
        stock = read_fixture(STOCK / f"{version}.json", version, files)
        selected = set(to_run_with_kvcore(stock))
        # Every excepted test passes stock and builds a scheduler (else the entry is stale).
        assert set(read_exceptions(EXCEPTIONS / f"{version}.toml")) <= selected
