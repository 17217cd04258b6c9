"""The summary at the end of ``scripts/gpu_check.sh``: ``python -m runner.check_report OUTDIR``.

The script records each step in ``OUTDIR/steps.tsv`` (name, status, exit code, seconds, time
limit, log file) and leaves the benchmark JSON and the tests' JUnit XML beside it.  This
reads them and writes ``OUTDIR/summary.md`` and ``OUTDIR/summary.json``: one line per step,
the test counts with the failing tests' names, and the issue's targets, each with the value
measured in this run and whether it is met ("not measured" where the run had no GPU or the
step did not produce the figure).  Exit status: 0 when every step ran to completion ("ok"),
1 otherwise (a failed or timed-out step); a missed target does not fail the check.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from kvcore.bench.table import render

# End-to-end targets (tok/s, nano-vllm recipe, async scheduling) per device family.
E2E_TARGETS = {"H200": 22_000.0, "H100": 16_000.0}
TESTS_TARGET_S = 240.0


def read_steps(outdir: Path) -> list[dict[str, Any]]:
    """The steps the script ran, in order."""
    steps: list[dict[str, Any]] = []
    path = outdir / "steps.tsv"
    if not path.exists():
        return steps
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        name, status, rc, seconds, limit, log = line.split("\t")
        steps.append({"step": name, "status": status, "rc": int(rc), "seconds": float(seconds),
                      "limit": float(limit), "log": log})
    return steps


def read_tests(xml_path: Path) -> dict[str, Any] | None:
    """Counts and failing test names from pytest's JUnit XML (None when there is none, e.g.
    a run killed by its time limit; its log then has the names as they ran, ``-v``)."""
    if not xml_path.exists():
        return None
    try:
        root = ET.parse(xml_path).getroot()
    except ET.ParseError:
        return None
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failed = []
    for case in root.iter("testcase"):
        counts["tests"] += 1
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("failure") is not None:
            counts["failures"] += 1
            failed.append(name)
        elif case.find("error") is not None:
            counts["errors"] += 1
            failed.append(name)
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
    return {**counts, "failed": failed}


def _load(path: Path) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data


def _pct(attn: dict[str, Any], backend: str, batch: int, ctx: int) -> float | None:
    for r in attn.get("attention", []):
        if (r["backend"], r["batch"], r["context"]) == (backend, batch, ctx) and r["ms"]:
            return float(100 * r["gbps"] / attn["copy_gbps"])
    return None


def targets(outdir: Path, steps: list[dict[str, Any]], dry_run: bool) -> list[dict[str, Any]]:
    """The issue's targets with this run's values: ``{"target", "value", "met"}`` where
    ``met`` is True/False, or None when not measured."""
    out: list[dict[str, Any]] = []

    def add(name: str, value: float | str | None, met: bool | None, unit: str = "") -> None:
        if dry_run or value is None:
            out.append({"target": name, "value": "not measured" + (" (dry run)" if dry_run
                                                                   else ""), "met": None})
        else:
            text = f"{value:,.0f}{unit}" if isinstance(value, float) else value
            out.append({"target": name, "value": text, "met": met})

    attn = _load(outdir / "attention.json") or {}
    for batch, ctx, floor in [(8, 8192, 90.0), (8, 32768, 90.0), (1, 32768, 80.0),
                              (1, 2048, 30.0)]:
        v = _pct(attn, "triton", batch, ctx) if attn else None
        add(f"decode batch {batch} x {ctx}: >= {floor:.0f}% of copy", v,
            None if v is None else v >= floor, "%")
    pairs = [(r["batch"], r["context"]) for r in attn.get("attention", [])
             if r["backend"] == "peer:flex" and r["ms"]]
    below = [f"{b}x{c}" for b, c in pairs
             if (ours := _pct(attn, "triton", b, c)) is not None
             and ours < (_pct(attn, "peer:flex", b, c) or 0.0)]
    add("decode never below the FlexAttention column",
        (f"below at {', '.join(below)}" if below else f"at or above in {len(pairs)} cases")
        if pairs else None, not below)
    e2e = _load(outdir / "throughput_async.json") or {}
    rows = e2e.get("throughput") or []
    device = str(e2e.get("device", ""))
    family = next((f for f in E2E_TARGETS if f in device), None)
    if rows and family:
        v = float(rows[0]["tokens_per_s"])
        add(f"end to end >= {E2E_TARGETS[family]:,.0f} tok/s on an {family}", v,
            v >= E2E_TARGETS[family], " tok/s")
    else:
        add("end to end >= 22k tok/s (H200) / 16k (H100)", None, None)
    runs = rows[0]["runs"] if rows else []
    if len(runs) >= 2:
        cold, warm = runs[0]["tokens_per_s"], runs[1]["tokens_per_s"]
        add("first timed run within 5% of a warm one", f"{cold:,.0f} vs {warm:,.0f} tok/s",
            cold >= 0.95 * warm)
    else:
        add("first timed run within 5% of a warm one", None, None)
    tests = next((s for s in steps if s["step"] == "tests"), None)
    if tests is not None and not dry_run:
        add(f"tests/runner green on the GPU in <= {TESTS_TARGET_S / 60:.0f} minutes",
            f"{tests['status']} in {tests['seconds']:.0f} s",
            tests["status"] == "ok" and tests["seconds"] <= TESTS_TARGET_S)
    else:
        add("tests/runner green on the GPU in <= 4 minutes", None, None)
    return out


def summarize(outdir: Path, dry_run: bool = False) -> dict[str, Any]:
    """Everything ``summary.md``/``summary.json`` hold."""
    steps = read_steps(outdir)
    tests = read_tests(outdir / "tests.xml")
    if tests is None and (outdir / "tests_serial.xml").exists():
        tests = read_tests(outdir / "tests_serial.xml")
    elif tests is not None:
        serial = read_tests(outdir / "tests_serial.xml")
        if serial is not None:
            tests = {k: tests[k] + serial[k] for k in tests}
    warm = []
    for name in ("throughput_async", "throughput_sync"):
        for r in (_load(outdir / f"{name}.json") or {}).get("throughput", []):
            warm.append({"run": name, "backend": r.get("backend", "?"),
                         "shapes_not_warmed": r.get("shapes_not_warmed"),
                         "kernels_compiled_in_timed_runs": r.get("kernels_compiled_in_timed_runs")})
    return {"dry_run": dry_run, "steps": steps, "tests": tests, "warm_up": warm,
            "targets": targets(outdir, steps, dry_run),
            "all_steps_ok": bool(steps) and all(s["status"] == "ok" for s in steps)}


def render_summary(summary: dict[str, Any]) -> str:
    lines = ["# gpu_check summary" + (" (dry run: CPU, tiny shapes, Triton interpreter)"
                                      if summary["dry_run"] else ""), ""]
    lines.append(render(["step", "status", "exit", "seconds", "limit", "log"],
                        [[s["step"], s["status"], str(s["rc"]), f"{s['seconds']:.0f}",
                          f"{s['limit']:.0f}", s["log"]] for s in summary["steps"]]))
    t = summary["tests"]
    lines.append("")
    if t is None:
        lines.append("tests: no JUnit report (see tests.log: -v lists each test as it ran)")
    else:
        lines.append(f"tests: {t['tests']} run, {t['failures']} failed, {t['errors']} errors, "
                     f"{t['skipped']} skipped")
        lines += [f"  FAILED {name}" for name in t["failed"]]
    for w in summary.get("warm_up", []):
        missed = w["shapes_not_warmed"]
        compiled = w["kernels_compiled_in_timed_runs"]
        lines.append(f"{w['run']} ({w['backend']}): warm-up missed "
                     f"{'?' if missed is None else len(missed)} shapes"
                     f"{': ' + ', '.join(missed) if missed else ''}; Triton kernels compiled "
                     f"while timed: {'not known' if compiled is None else compiled}")
    lines.append("")
    lines.append(render(["target", "this run", "met"],
                        [[x["target"], x["value"],
                          "-" if x["met"] is None else "yes" if x["met"] else "NO"]
                         for x in summary["targets"]]))
    lines.append("")
    lines.append("all steps ok" if summary["all_steps_ok"] else "NOT all steps ok")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    dry_run = "--dry-run" in args
    rest = [a for a in args if a != "--dry-run"]
    if len(rest) != 1:
        print("usage: python -m runner.check_report [--dry-run] OUTDIR", file=sys.stderr)
        return 2
    outdir = Path(rest[0])
    summary = summarize(outdir, dry_run)
    text = render_summary(summary)
    (outdir / "summary.md").write_text(text)
    (outdir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(text, end="")
    return 0 if summary["all_steps_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
