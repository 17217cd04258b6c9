"""The measured benchmarks (``pool``, ``hash``, ``manager``): which workers run, which cases,
and the tables they print.  The measuring itself is :mod:`kvcore.bench.workers`."""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcore.bench.peer import compiled_python, peer_python
from kvcore.bench.table import fmt, ratio, render
from kvcore.bench.workers import (
    REPO_ROOT,
    CaseSamples,
    Spread,
    WorkerSpec,
    list_cases,
    per_unit,
    run_interleaved,
    select_cases,
    spread,
    start_workers,
    work_mismatches,
)

KVCORE, VLLM, COMPILED, BASELINE = "kvcore", "vLLM", "compiled", "baseline"
MIN_REPEATS = 5


def worker_specs(no_peer: bool, compiled: str | None,
                 baseline: str | None = None) -> tuple[list[WorkerSpec], list[str]]:
    """kvcore from this source tree, the vLLM peer (unless ``no_peer``), a compiled kvcore when
    ``compiled`` names its interpreter, and a baseline when ``baseline`` names one: another
    kvcore source tree (e.g. a ``git worktree`` of an earlier commit), or the interpreter of a
    venv holding a compiled build of one (compared with ``compiled``); plus notes on what is
    missing."""
    specs = [WorkerSpec(KVCORE, "kvcore", sys.executable, source=REPO_ROOT, expect="source")]
    notes = []
    if not no_peer:
        py = peer_python()
        if py is None:
            notes.append("vLLM peer not found: build it with `bash scripts/peer_vllm.sh` or set "
                         "KVCORE_PEER_PYTHON")
        else:
            specs.append(WorkerSpec(VLLM, "vllm", str(py)))
    if compiled:
        specs.append(WorkerSpec(COMPILED, "kvcore", compiled, expect="compiled"))
    if baseline and Path(baseline).is_file():  # an interpreter: a compiled build of a tree
        if not compiled:
            raise ValueError(f"--baseline {baseline!r} is an interpreter: its compiled build is "
                             "compared with --compiled-python's, which is missing")
        specs.append(WorkerSpec(BASELINE, "kvcore", baseline, expect="compiled"))
    elif baseline:
        tree = Path(baseline).resolve()
        if not (tree / "kvcore" / "__init__.py").is_file():
            raise ValueError(f"--baseline {baseline!r} is not a kvcore source tree "
                             "(no kvcore/__init__.py in it) nor an interpreter")
        specs.append(WorkerSpec(BASELINE, "kvcore", sys.executable, source=tree,
                                expect="source"))
    return specs, notes


@dataclass
class Run:
    """One benchmark's outcome: who ran, every sample, and notes for the reader."""

    command: str
    params: dict[str, Any]
    repeats: int
    workers: dict[str, dict[str, Any]] = field(default_factory=dict)
    results: list[CaseSamples] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def labels(self) -> list[str]:
        return list(self.workers)

    def spreads(self, label: str, scale: float = 1.0,
                invert: bool = False) -> dict[str, Spread]:
        """Per case name: median, min and max over repeats of ``label``'s ns per unit times
        ``scale`` (or, with ``invert``, units per ns times ``scale``)."""
        out = {}
        for res in self.results:
            samples = res.samples.get(label)
            if samples:
                values = [1.0 / per_unit(s) * scale if invert else per_unit(s, scale)
                          for s in samples]
                out[res.name] = spread(values)
        return out

    def to_json(self) -> dict[str, Any]:
        return {"command": self.command, "params": self.params, "repeats": self.repeats,
                "workers": self.workers, "notes": self.notes,
                "cases": [{"case": r.case, "samples": r.samples} for r in self.results]}


def measure(args: argparse.Namespace, workload: str, params: dict[str, Any], repeats: int,
            patterns: str | None = None, warmup: bool = False) -> Run:
    specs, notes = worker_specs(args.no_peer, compiled_python(args.compiled_python),
                                args.baseline)
    workers, start_notes = start_workers(specs, optional=(VLLM,))
    run = Run(workload, params, repeats, {w.label: w.hello for w in workers}, [],
              notes + start_notes)
    try:
        cases = select_cases(list_cases(workers, workload, params), patterns)
        run.results = run_interleaved(workers, workload, cases, params, repeats, warmup,
                                      progress=lambda line: print(line, file=sys.stderr,
                                                                  flush=True))
    finally:
        for w in workers:
            w.close()
    for res in run.results:
        # A case may say why the peer's work differs by design (another eviction policy): its
        # column is then left out of the same-work check, and the note says what each did.
        peer_note = res.case.get("peer_note")
        ignore = (VLLM,) if peer_note else ()
        run.notes += [f"different work done: {m}" for m in work_mismatches(res, ignore)]
        run.notes += [f"{label} skipped {res.name!r}: {why}"
                      for label, why in res.skipped.items()]
        if peer_note and res.samples.get(VLLM):
            did = ", ".join(f"{label} {_typical_info(samples)}"
                            for label, samples in res.samples.items() if samples)
            run.notes.append(f"{res.name}: {peer_note}; median per repeat: {did}")
    return run


def _typical_info(samples: list[dict[str, Any]]) -> str:
    """What a worker's runs of a case did: each ``info`` count's median over the repeats."""
    keys = dict.fromkeys(k for s in samples for k in s.get("info", {}))
    return " ".join(f"{k}={statistics.median_low([s['info'].get(k, 0) for s in samples]):,}"
                    for k in keys) or "(nothing reported)"


def _print_footer(run: Run) -> None:
    print()
    for label, hello in run.workers.items():
        version = hello.get("vllm_version") or hello.get("python_version")
        print(f"{label}: {hello.get('module')} ({hello.get('python')}, {version})")
    for note in run.notes:
        print(f"note: {note}")


def _value(s: Spread | None, digits: int) -> str:
    return fmt(s.median if s else None, digits)


def _range_cell(s: Spread | None, digits: int) -> str:
    if s is None:
        return "n/a"
    return f"{fmt(s.median, digits)} ({fmt(s.low, digits)}–{fmt(s.high, digits)})"


def _ratio(a: Spread | None, b: Spread | None) -> str:
    return ratio(a.median if a else None, b.median if b else None)


@dataclass(frozen=True)
class _Extra:
    """Two more columns for a worker beyond kvcore and vLLM (compiled kvcore, a baseline tree):
    its figure, and a time ratio ``num/den`` (compiled vs vLLM; this tree vs the baseline)."""

    label: str
    figure: dict[str, Spread]
    num: dict[str, Spread]
    den: dict[str, Spread]
    ratio_header: str

    def cells(self, case: str, cell: Callable[[Spread | None], str]) -> list[str]:
        return [cell(self.figure.get(case)), _ratio(self.num.get(case), self.den.get(case))]


def _extras(run: Run, scale: float = 1.0, invert: bool = False) -> list[_Extra]:
    """The extra column pairs ``run`` has, with figures as ``Run.spreads(scale, invert)``."""
    times = {label: run.spreads(label) for label in run.labels}
    out = []
    if COMPILED in run.workers:
        out.append(_Extra(COMPILED, run.spreads(COMPILED, scale, invert), times[COMPILED],
                          times.get(VLLM, {}), "compiled/vLLM"))
    if BASELINE in run.workers:  # a compiled baseline is compared with the compiled build
        mine = COMPILED if run.workers[BASELINE].get("compiled") else KVCORE
        out.append(_Extra(BASELINE, run.spreads(BASELINE, scale, invert), times[mine],
                          times[BASELINE], f"{mine}/baseline"))
    return out


def bench_pool(args: argparse.Namespace) -> Run:
    params = {"pool_sizes": args.pool_sizes, "batch_sizes": args.batch_sizes}
    run = measure(args, "pool", params, args.repeats)
    ours, peer = run.spreads(KVCORE), run.spreads(VLLM)
    extras = _extras(run)
    rows = []
    for res in run.results:
        c, n = res.case, res.name
        row = [c["op"], f"{c['pool_size']:,}", str(c["batch"]), _value(ours.get(n), 1),
               _value(peer.get(n), 1), _ratio(ours.get(n), peer.get(n))]
        for extra in extras:
            row += extra.cells(n, lambda s: _value(s, 1))
        rows.append(row)
    headers = ["op", "pool blocks", "batch", "kvcore ns/block", "vLLM ns/block", "kvcore/vLLM"]
    for extra in extras:
        headers += [f"{extra.label} ns/block", extra.ratio_header]
    print(render(headers, rows, title="BlockPool: ns per block (median; wall-clock sections)"))
    # O(1) evidence: cost at the largest pool relative to the smallest, per op and batch.
    by = {(r.case["op"], r.case["pool_size"], r.case["batch"]): ours.get(r.name)
          for r in run.results}
    sizes = sorted({r.case["pool_size"] for r in run.results})
    if len(sizes) > 1:
        scale_rows = []
        for op in dict.fromkeys(r.case["op"] for r in run.results):
            for batch in sorted({r.case["batch"] for r in run.results}):
                lo, hi = by.get((op, sizes[0], batch)), by.get((op, sizes[-1], batch))
                if lo and hi:
                    scale_rows.append([op, str(batch), f"{hi.median / lo.median:.2f}x"])
        print()
        print(render(["op", "batch", f"{sizes[-1]:,} vs {sizes[0]:,} blocks"], scale_rows,
                     title="kvcore scaling with pool size (1.00x = flat)"))
    _print_footer(run)
    return run


def bench_hash(args: argparse.Namespace) -> Run:
    params = {"block_sizes": args.block_sizes, "num_tokens": args.num_tokens}
    run = measure(args, "hash", params, args.repeats)
    # million tokens per second of thread CPU time; ratios are of time per token
    ours, peer = (run.spreads(label, 1e3, invert=True) for label in (KVCORE, VLLM))
    times = {label: run.spreads(label) for label in (KVCORE, VLLM)}
    extras = _extras(run, 1e3, invert=True)
    rows = []
    for res in run.results:
        c, n = res.case, res.name
        p = peer.get(n)
        row = [c["algorithm"], str(c["block_size"]), _range_cell(ours.get(n), 2),
               c["peer_algorithm"] if p else "n/a", _range_cell(p, 2),
               _ratio(times[KVCORE].get(n), times[VLLM].get(n))]
        for extra in extras:
            row += extra.cells(n, lambda s: _range_cell(s, 2))
        rows.append(row)
    headers = ["algorithm", "block size", "kvcore Mtok/s", "vLLM algo", "vLLM Mtok/s",
               "kvcore time/vLLM time"]
    for extra in extras:
        headers += [f"{extra.label} Mtok/s", extra.ratio_header]
    print(render(headers, rows, title=(
        "Request block hashing: million tokens per second of CPU time, median (min–max) of "
        f"{args.repeats} interleaved repeats")))
    _print_footer(run)
    return run


def bench_manager(args: argparse.Namespace) -> Run:
    params = {"requests": args.requests}
    run = measure(args, "manager", params, args.repeats, patterns=args.scenarios,
                  warmup=not args.quick)
    ours, peer = (run.spreads(label, 1e-3) for label in (KVCORE, VLLM))
    extras = _extras(run, 1e-3)
    rows = []
    for res in run.results:
        n = res.name
        row = [n, _range_cell(ours.get(n), 2), _range_cell(peer.get(n), 2),
               _ratio(ours.get(n), peer.get(n))]
        for extra in extras:
            row += extra.cells(n, lambda s: _range_cell(s, 2))
        rows.append(row)
    headers = ["scenario", "kvcore pure µs/cycle", "vLLM µs/cycle", "pure/vLLM"]
    for extra in extras:
        headers += [f"{extra.label} µs/cycle", extra.ratio_header]
    print(render(headers, rows, title=(
        f"KVCacheManager: µs of CPU time per request cycle, median (min–max) of {args.repeats} "
        f"interleaved repeats, --requests {args.requests}")))
    _print_policy_table(run)
    _print_footer(run)
    return run


def _print_policy_table(run: Run) -> None:
    """Each kvcore column's cost under a non-default eviction policy relative to its own LRU
    row (same requests), for the policy rows whose LRU row was measured too.  The two rows were
    measured one after the other, not interleaved: read small differences with the ranges."""
    measured = {res.name for res in run.results}
    pairs = [(res, str(res.case["lru_row"])) for res in run.results
             if res.case.get("lru_row") in measured]
    if not pairs:
        return
    times = {label: run.spreads(label) for label in (KVCORE, COMPILED, BASELINE)
             if label in run.workers}
    # a column that skipped every policy row (a kvcore without eviction policies) is left out
    labels = [label for label, t in times.items() if any(res.name in t for res, _ in pairs)]
    rows = []
    for res, lru in pairs:
        row = [res.name, str(res.case["eviction_policy"])]
        row += [_ratio(times[label].get(res.name), times[label].get(lru)) for label in labels]
        rows.append(row)
    headers = ["scenario", "policy"] + [f"{label} policy/LRU" for label in labels]
    print()
    print(render(headers, rows, title=(
        "kvcore eviction policies: µs per cycle relative to the same requests under LRU (the "
        "row without the policy suffix), per column; medians")))


def list_scenarios() -> None:
    """Print the manager scenarios and what each exercises (read from the workload module,
    which is the file every worker runs)."""
    from kvcore.bench.workloads.manager_cycle import SCENARIOS

    for s in SCENARIOS:
        print(f"{s.name}\n    {s.doc}")


COMMANDS: dict[str, Callable[[argparse.Namespace], Run]] = {
    "pool": bench_pool, "hash": bench_hash, "manager": bench_manager}
