"""The benchmark harness (``kvcore.bench.workers`` and the worker in ``kvcore/bench/workloads``):
interleaving and aggregation, identical case lists, clear errors when a worker dies, hangs or
refuses to start, the compiled-kvcore start-up check, and the commands end to end on tiny
inputs.  No timing is asserted anywhere."""

from __future__ import annotations

import io
import json
import os
import re
import stat
import sys
from pathlib import Path
from typing import Any

import pytest

import kvcore
from kvcore.bench.__main__ import main
from kvcore.bench.peer import compiled_python, peer_python
from kvcore.bench.workers import (
    REPO_ROOT,
    CaseSamples,
    Worker,
    WorkerError,
    WorkerSpec,
    list_cases,
    per_unit,
    run_interleaved,
    select_cases,
    spread,
    work_mismatches,
)
from kvcore.bench.workloads import hash_ops, manager_cycle, pool_ops
from kvcore.bench.workloads.worker import StartupError, serve, startup
from tests.factories import run_main

KVCORE_SPEC = WorkerSpec("kvcore", "kvcore", sys.executable, source=REPO_ROOT, expect="source")


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    return run_main(main, capsys, *argv)


def _executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _kvcore_stub(root: Path, extra: str) -> Path:
    """A ``kvcore`` package under ``root`` that is the repository's kvcore, then runs ``extra``
    (source appended to its ``__init__``); returns the package directory."""
    stub = root / "kvcore"
    stub.mkdir(parents=True)
    real = REPO_ROOT / "kvcore"
    (stub / "__init__.py").write_text(
        f"__path__ = [{str(real)!r}]\n"
        f"_src = {str(real / '__init__.py')!r}\n"
        "exec(compile(open(_src).read(), _src, 'exec'))\n" + extra)
    return stub


def _fake_compiled_python(tmp_path: Path) -> Path:
    """This interpreter, with a ``kvcore`` package first on the path that is the repository's
    kvcore plus ``__compiled__ = True``: what a compiled build looks like to the worker."""
    stub = _kvcore_stub(tmp_path / "stub", "__compiled__ = True\n")
    return _executable(tmp_path / "python-compiled",
                       f'#!/bin/sh\nPYTHONPATH="{stub.parent}" exec "{sys.executable}" "$@"\n')


# -- the driver's logic, with fake workers (no processes) ----------------------------------------
class FakeWorker:
    def __init__(self, label: str, log: list[tuple[str, str, int, bool]],
                 names: list[str] | None = None, skips: tuple[str, ...] = ()) -> None:
        self.label = label
        self.log = log
        self.names = names or ["one", "two"]
        self.skips = skips

    def cases(self, workload: str, params: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"name": n} for n in self.names]

    def measure(self, workload: str, case: str, params: dict[str, Any], repeat: int,
                warmup: bool = False) -> dict[str, Any]:
        self.log.append((self.label, case, repeat, warmup))
        if case in self.skips:
            return {"skipped": f"{self.label} cannot run {case}"}
        info = {"hits": 7 if self.label != "odd" else 8}
        return {"ns": 1000 * (repeat + 1), "units": 10, "clock": "thread_cpu", "wall_ns": 0,
                "info": info}


def test_repeats_interleave_with_rotating_order_and_aggregate() -> None:
    log: list[tuple[str, str, int, bool]] = []
    workers = [FakeWorker(x, log) for x in "abc"]
    results = run_interleaved(workers, "manager", [{"name": "one"}, {"name": "two"}],
                              {}, repeats=3, warmup=True)
    per_case = [(label, repeat, warmup) for label, case, repeat, warmup in log if case == "one"]
    assert per_case == [("a", -1, True), ("b", -1, True), ("c", -1, True),
                        ("a", 0, False), ("b", 0, False), ("c", 0, False),
                        ("b", 1, False), ("c", 1, False), ("a", 1, False),
                        ("c", 2, False), ("a", 2, False), ("b", 2, False)]
    assert [case for _, case, _, _ in log] == ["one"] * 12 + ["two"] * 12
    assert [r.name for r in results] == ["one", "two"]
    samples = results[0].samples["b"]
    assert len(samples) == 3 and [s["ns"] for s in samples] == [1000, 2000, 3000]
    s = spread([per_unit(x, 1e-3) for x in samples])
    assert (s.median, s.low, s.high) == (0.2, 0.1, 0.3)
    assert work_mismatches(results[0]) == []


def test_work_mismatch_is_reported() -> None:
    log: list[tuple[str, str, int, bool]] = []
    res = run_interleaved([FakeWorker("a", log), FakeWorker("odd", log)], "manager",
                          [{"name": "one"}], {}, repeats=2)
    assert len(work_mismatches(res[0])) == 1 and "odd" in work_mismatches(res[0])[0]
    assert work_mismatches(CaseSamples({"name": "x"}, {"a": []})) == []


def test_a_worker_that_skips_a_case_is_not_asked_again() -> None:
    log: list[tuple[str, str, int, bool]] = []
    workers = [FakeWorker("a", log), FakeWorker("old", log, skips=("two",)),
               FakeWorker("odd", log)]
    one, two = run_interleaved(workers, "manager", [{"name": "one"}, {"name": "two"}], {},
                               repeats=3, warmup=True)
    assert one.skipped == {} and all(len(v) == 3 for v in one.samples.values())
    assert two.skipped == {"old": "old cannot run two"} and two.samples["old"] == []
    assert [(r, w) for label, case, r, w in log if label == "old" and case == "two"] == [
        (-1, True)]  # asked once (the warm-up), then left out
    assert len(two.samples["a"]) == len(two.samples["odd"]) == 3
    # the work check leaves out the skipped worker and any label it is told to ignore
    assert len(work_mismatches(two)) == 1
    assert work_mismatches(two, ignore=("odd",)) == []


def test_case_lists_must_agree() -> None:
    log: list[tuple[str, str, int, bool]] = []
    same = [FakeWorker("a", log), FakeWorker("b", log)]
    assert [c["name"] for c in list_cases(same, "manager", {})] == ["one", "two"]
    other = [FakeWorker("a", log), FakeWorker("b", log, ["one", "three"])]
    with pytest.raises(WorkerError, match="list different manager cases"):
        list_cases(other, "manager", {})


def test_select_cases() -> None:
    cases = manager_cycle.cases("kvcore", {})
    names = [c["name"] for c in select_cases(cases, "caching off,PREEMPTION")]
    assert names == [manager_cycle.SCENARIOS[0].name,
                     next(s.name for s in manager_cycle.SCENARIOS if s.max_running)]
    full = "hybrid full + SWA(64), 96 shared + 32 unique, 32 decode"  # a name with commas
    assert [c["name"] for c in select_cases(cases, full)] == [full]
    assert len(select_cases(cases, "verify_hits")) >= 2
    assert select_cases(cases, None) == cases
    with pytest.raises(ValueError, match="no scenario matches 'nope'"):
        select_cases(cases, "caching off,nope")


def test_every_workload_lists_the_same_cases_for_both_implementations() -> None:
    for module, params in ((manager_cycle, {"requests": 16}), (pool_ops, {}), (hash_ops, {})):
        ours, theirs = module.cases("kvcore", params), module.cases("vllm", params)
        assert [c["name"] for c in ours] == [c["name"] for c in theirs]
        assert len({c["name"] for c in ours}) == len(ours)


def test_manager_scenarios_cover_the_brief() -> None:
    scenarios = manager_cycle.SCENARIOS
    assert all(s.doc for s in scenarios)
    assert any(not s.caching for s in scenarios)
    assert any(s.max_running for s in scenarios)  # preemption
    assert {("full", 64), ("full", 512)} <= {s.groups for s in scenarios}
    assert ("full", *[1024] * 5) in {s.groups for s in scenarios}
    assert {8192, 32768} <= {s.prompt_len for s in scenarios if s.hash_timed}
    assert all(s.decode == 0 for s in scenarios if s.hash_timed)  # hashes come from the loop
    verified = [s.groups for s in scenarios if s.verify]
    assert ("full",) in verified and ("full", 64) in verified



def test_eviction_heavy_rows_per_policy_run_the_same_requests() -> None:
    lru = manager_cycle.EVICTION_HEAVY
    rows = [s for s in manager_cycle.SCENARIOS if s.name.startswith(lru.name)]
    assert [s.eviction_policy for s in rows] == ["lru", "slru", "s3fifo", "arc", "learned"]
    assert [s.name for s in rows[1:]] == [f"{lru.name}, kvcore {p}"
                                          for p in ("slru", "s3fifo", "arc", "learned")]
    assert all(s.seed == lru.name and s.num_blocks == lru.num_blocks for s in rows[1:])
    cases = {c["name"]: c for c in manager_cycle.cases("kvcore", {})}
    assert "lru_row" not in cases[lru.name] and "peer_note" not in cases[lru.name]
    for s in rows[1:]:
        assert cases[s.name]["lru_row"] == lru.name and "LRU" in cases[s.name]["peer_note"]
    # every policy row selected by the LRU row's name; one alone by its policy
    assert len(select_cases(list(cases.values()), "eviction-heavy")) == 5
    assert [c["name"] for c in select_cases(list(cases.values()), "kvcore slru")] == [
        rows[1].name]
    # same requests: kvcore LRU and SLRU see the same prompts, so their figures compare
    params = {"requests": 64}
    samples = [manager_cycle.measure("kvcore", s.name, params, 0) for s in rows]
    assert all(x["units"] == 64 and x["ns"] > 0 for x in samples)


# -- the worker, in process ----------------------------------------------------------------------
def test_worker_serves_requests_and_survives_a_failing_one() -> None:
    requests = [{"op": "cases", "workload": "manager", "params": {"requests": 8}},
                {"op": "measure", "workload": "manager", "case": "nope", "params": {}},
                {"op": "measure", "workload": "manager",
                 "case": manager_cycle.SCENARIOS[0].name, "params": {"requests": 8},
                 "repeat": 0},
                {"op": "exit"},
                {"op": "cases", "workload": "manager", "params": {}}]  # after exit: unread
    out = io.StringIO()
    serve("kvcore", io.StringIO("".join(json.dumps(r) + "\n" for r in requests)), out,
          freeze=False)
    replies = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(replies) == 4
    assert replies[0]["ok"] and len(replies[0]["result"]) == len(manager_cycle.SCENARIOS)
    assert not replies[1]["ok"] and "unknown scenario" in replies[1]["error"]
    sample = replies[2]["result"]
    assert replies[2]["ok"] and sample["units"] == 8 and sample["clock"] == "thread_cpu"
    assert sample["ns"] > 0 and sample["info"] == {"hit_tokens": 0}
    assert replies[3] == {"ok": True, "result": None}


def test_startup_check_for_a_compiled_kvcore(monkeypatch: pytest.MonkeyPatch) -> None:
    if getattr(kvcore, "__compiled__", False) is not True:
        with pytest.raises(StartupError, match="not a compiled build"):
            startup("kvcore", "compiled")
        assert startup("kvcore", "source")["compiled"] is False
    monkeypatch.setattr(kvcore, "__compiled__", True, raising=False)
    assert startup("kvcore", "compiled")["compiled"] is True
    with pytest.raises(StartupError, match="pure-Python kvcore was expected"):
        startup("kvcore", "source")


def test_compiled_python_setting_and_worker_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCORE_COMPILED_PYTHON", "/opt/compiled/bin/python")
    assert compiled_python(None) == "/opt/compiled/bin/python"
    assert compiled_python("/x/python") == "/x/python"
    monkeypatch.delenv("KVCORE_COMPILED_PYTHON")
    assert compiled_python(None) is None
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO_ROOT), "/elsewhere"]))
    compiled = WorkerSpec("compiled", "kvcore", "py", expect="compiled")
    assert compiled.env()["PYTHONPATH"] == "/elsewhere"  # never the repository
    assert KVCORE_SPEC.env()["PYTHONPATH"] == os.pathsep.join([str(REPO_ROOT), "/elsewhere"])
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT))
    assert "PYTHONPATH" not in compiled.env()
    assert compiled.command()[-2:] == ["--expect", "compiled"]


# -- real worker processes -----------------------------------------------------------------------
def test_worker_failures_are_clear_errors() -> None:
    with Worker(KVCORE_SPEC) as w:
        assert w.hello["impl"] == "kvcore" and w.hello["compiled"] is False
        with pytest.raises(WorkerError, match="failed while measuring manager case 'nope'"):
            w.measure("manager", "nope", {}, 0)
        assert len(w.cases("manager", {"requests": 4})) == len(manager_cycle.SCENARIOS)
        w.proc.kill()
        w.proc.wait()
        with pytest.raises(WorkerError) as info:
            w.measure("manager", manager_cycle.SCENARIOS[0].name, {}, 2)
    msg = str(info.value)
    assert "the kvcore worker" in msg and "exited with status -9" in msg
    assert "while measuring manager case 'caching off" in msg and "(repeat 3)" in msg


def test_worker_crash_mid_request_and_hang(tmp_path: Path) -> None:
    fake = tmp_path / "fake_worker.py"
    fake.write_text(
        "import json, sys, time\n"
        "print(json.dumps({'ok': True, 'hello': {'impl': 'kvcore'}}), flush=True)\n"
        "line = sys.stdin.readline()\n"
        "if 'hang' in line:\n"
        "    time.sleep(60)\n"
        "print('boom: the manager exploded', file=sys.stderr)\n"
        "sys.exit(3)\n")
    py = _executable(tmp_path / "python", f'#!/bin/sh\nexec "{sys.executable}" "{fake}"\n')
    crash = r"(?s)exited with status 3 while measuring manager case 'x'.*boom: the manager"
    with Worker(WorkerSpec("vLLM", "vllm", str(py))) as w, \
            pytest.raises(WorkerError, match=crash):
        w.measure("manager", "x", {}, 0)
    with Worker(WorkerSpec("vLLM", "vllm", str(py))) as w, \
            pytest.raises(WorkerError, match="killed after 1s without answering"):
        w.timeout = 1  # once started: a start-up slower than 1 s on a busy machine is no hang
        w.measure("manager", "hang", {}, 0)
    with pytest.raises(WorkerError, match="cannot start the vLLM worker"):
        Worker(WorkerSpec("vLLM", "vllm", str(tmp_path / "missing-python")))


def test_compiled_worker_refuses_a_plain_kvcore() -> None:
    # The source tree's kvcore is pure Python (whichever build runs the tests).
    spec = WorkerSpec("compiled", "kvcore", sys.executable, source=REPO_ROOT, expect="compiled")
    with pytest.raises(WorkerError, match=r"compiled worker .* failed while starting up: .*"
                                          r"not a compiled build"):
        Worker(spec)


def test_manager_no_peer_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json = tmp_path / "raw.json"
    rc, out, err = _run(capsys, "manager", "--no-peer", "--quick", "--repeats", "2",
                        "--requests", "8", "--scenarios", "caching off,preemption",
                        "--json", str(out_json))
    assert rc == 0, err
    assert "kvcore pure µs/cycle" in out and "vLLM µs/cycle" in out
    assert "compiled µs/cycle" not in out and "compiled/vLLM" not in out
    assert "caching off, 128-token prompts" in out and "preemption-heavy" in out
    raw = json.loads(out_json.read_text())
    assert raw["repeats"] == 2 and list(raw["workers"]) == ["kvcore"]
    assert [c["case"]["name"].split(",")[0] for c in raw["cases"]] == [
        "caching off", "preemption-heavy: 32 running"]
    for case in raw["cases"]:
        samples = case["samples"]["kvcore"]
        assert len(samples) == 2 and all(s["clock"] == "thread_cpu" for s in samples)
    assert "preemptions" in raw["cases"][1]["samples"]["kvcore"][0]["info"]


def test_manager_compiled_column_with_a_fake_compiled_build(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fake = _fake_compiled_python(tmp_path)
    rc, out, err = _run(capsys, "--no-peer", "--compiled-python", str(fake), "manager",
                        "--quick", "--repeats", "1", "--requests", "4", "--scenarios",
                        "caching off")
    assert rc == 0, err
    assert "compiled µs/cycle" in out and "compiled/vLLM" in out
    assert f"compiled: {tmp_path / 'stub' / 'kvcore' / '__init__.py'}" in out


def test_baseline_tree_adds_a_column_and_a_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    # The repository itself as its own baseline: same code, so the same work is done.
    rc, out, err = _run(capsys, "--no-peer", "manager", "--baseline", str(REPO_ROOT), "--quick",
                        "--repeats", "1", "--requests", "4", "--scenarios", "caching off")
    assert rc == 0, err
    assert "baseline µs/cycle" in out and "kvcore/baseline" in out
    assert f"baseline: {REPO_ROOT / 'kvcore' / '__init__.py'}" in out
    assert "different work" not in out
    row = next(line for line in out.splitlines() if line.startswith("caching off"))
    assert re.search(r"\d+\.\d+ \(.*\)\s+\d+\.\d\dx$", row.rstrip()), row  # figure, ratio


def test_a_compiled_baseline_is_compared_with_the_compiled_build(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--baseline PYTHON: the interpreter of a venv holding a compiled build of another tree;
    its column is compared with --compiled-python's (an interpreter alone is refused)."""
    fake = _fake_compiled_python(tmp_path)
    rc, out, err = _run(capsys, "--no-peer", "manager", "--baseline", str(fake), "--quick",
                        "--repeats", "1", "--requests", "4", "--scenarios", "caching off")
    assert rc == 2 and "--compiled-python" in err and "missing" in err
    rc, out, err = _run(capsys, "--no-peer", "--compiled-python", str(fake), "manager",
                        "--baseline", str(fake), "--quick", "--repeats", "1", "--requests", "4",
                        "--scenarios", "caching off")
    assert rc == 0, err
    assert "baseline µs/cycle" in out and "compiled/baseline" in out
    assert "kvcore/baseline" not in out
    row = next(line for line in out.splitlines() if line.startswith("caching off"))
    assert re.search(r"\d+\.\d\dx$", row.rstrip()), row


def _baseline_without_eviction_policies(tmp_path: Path) -> Path:
    """A kvcore source tree as before eviction policies: the repository's kvcore, whose
    ``KVCacheManager`` refuses an ``eviction_policy`` argument as an older signature would."""
    stub = _kvcore_stub(
        tmp_path / "old",
        "import kvcore.manager as _m\n"
        "class KVCacheManager(_m.KVCacheManager):\n"
        "    __slots__ = ()\n"
        "    def __init__(self, config, max_model_len, **kw):\n"
        "        if 'eviction_policy' in kw:\n"
        "            raise TypeError(\"__init__() got an unexpected keyword argument "
        "'eviction_policy'\")\n"
        "        super().__init__(config, max_model_len, **kw)\n"
        "_m.KVCacheManager = KVCacheManager\n")
    return stub.parent


def test_baseline_without_eviction_policies_skips_their_rows(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = _baseline_without_eviction_policies(tmp_path)
    out_json = tmp_path / "raw.json"
    rc, out, err = _run(capsys, "--no-peer", "manager", "--baseline", str(old), "--quick",
                        "--repeats", "2", "--requests", "8", "--scenarios", "eviction-heavy",
                        "--json", str(out_json))
    assert rc == 0, err
    assert "different work" not in out
    lines = out.splitlines()
    lru = manager_cycle.EVICTION_HEAVY.name
    rows = {name: next(line for line in lines if line.rstrip().startswith(name) and
                       line[len(name):len(name) + 1] in (" ", ""))
            for name in (lru, *(f"{lru}, kvcore {p}"
                                for p in ("slru", "s3fifo", "arc", "learned")))}
    assert re.search(r"\d+\.\d\dx$", rows[lru].rstrip()), rows[lru]  # baseline ran LRU
    for policy in ("slru", "s3fifo", "arc", "learned"):
        row = rows[f"{lru}, kvcore {policy}"].rstrip()
        assert re.search(r"\d \(.*\)\s+n/a\s+n/a\s+n/a\s+n/a$", row), row  # kvcore ran
        assert (f"note: baseline skipped '{lru}, kvcore {policy}': this kvcore has no eviction "
                f"policy '{policy}'") in out
    # the policy/LRU table: a column for kvcore, none for a baseline that ran no policy row
    assert "kvcore policy/LRU" in out and "baseline policy/LRU" not in out
    raw = json.loads(out_json.read_text())
    counts = [len(c["samples"]["baseline"]) for c in raw["cases"]]
    assert counts == [2, 0, 0, 0, 0]


def test_baseline_must_be_a_kvcore_tree(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _run(capsys, "--no-peer", "hash", "--baseline", str(tmp_path))
    assert rc == 2 and "not a kvcore source tree" in err and str(tmp_path) in err


def test_manager_refuses_few_repeats(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _run(capsys, "--no-peer", "manager", "--repeats", "3")
    assert rc == 2 and "at least 5" in err and len(err.strip().splitlines()) == 1


def test_hash_no_peer(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _run(capsys, "--no-peer", "hash", "--block-sizes", "16",
                        "--num-tokens", "2048", "--repeats", "1")
    assert rc == 0, err
    assert "kvcore Mtok/s" in out and "sha256_cbor" in out


@pytest.mark.skipif(peer_python() is None, reason="vLLM peer not built (scripts/peer_vllm.sh)")
def test_manager_with_peer_does_the_same_work(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _run(capsys, "manager", "--quick", "--repeats", "1", "--requests", "16",
                        "--scenarios", "96 shared + 32 unique tokens,preemption,SWA(64), 96,"
                        "Gemma,8k,eviction")
    assert rc == 0, err
    assert "different work" not in out, out
    rows = [line for line in out.splitlines() if line.startswith(("96 shared", "Gemma"))]
    assert len(rows) == 2 and all("n/a" not in r for r in rows)
    # the eviction-policy rows: vLLM LRU on the same requests, said so in a note
    for policy in ("slru", "s3fifo", "arc", "learned"):
        assert f"kvcore {policy}: vLLM has LRU only" in out
    rows = [line for line in out.splitlines() if line.startswith("eviction-heavy")]
    assert len(rows) == 5 + 4 and all("n/a" not in r for r in rows)  # main table + policy/LRU
