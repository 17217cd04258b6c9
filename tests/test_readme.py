"""The README opens with the commands CI runs, and its Python examples run as written."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_opens_with_main_job_and_test_commands() -> None:
    """The README opens with two self-contained lines for a fresh clone (nothing activated): the
    main job (``kvcore replay``) and the tests.  ``.ci/run`` reads this block: the line with
    ``pytest`` and the line with ``kvcore replay``, whose set-up (all before the last ``&&``)
    must be the same."""
    text = README.read_text()
    first = re.search(r"```bash\n(.*?)```", text, flags=re.S)
    assert first is not None and text.index(first.group(0)) < text.index("\n## ")
    lines = first.group(1).strip().splitlines()
    assert len(lines) == 2
    replay, test = lines
    setup = "python3 -m venv .venv && .venv/bin/pip install -c requirements/cpu.txt -e '.[dev]'"
    assert replay == f"{setup} && .venv/bin/kvcore replay"
    assert test.startswith(f"{setup} && ") and "pytest" in test.rsplit(" && ", 1)[1]
    assert "pytest" not in replay and "kvcore replay" not in test
    assert replay.rsplit(" && ", 1)[0] == test.rsplit(" && ", 1)[0]
    # The CPU torch comes from the README's own constraint, never from kvcore's metadata.
    assert (README.parent / "requirements" / "cpu.txt").read_text().splitlines()[-1] == (
        "torch==2.13.0")


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_python_block_runs(code: str) -> None:
    exec(compile(code, str(README), "exec"), {"__name__": "readme"})


def _main_job_commands() -> list[str]:
    """The main-job section's commands as ``.ci/run`` gets them (scripts/readme_main_job.sh)."""
    out = subprocess.run(["bash", str(README.parent / "scripts" / "readme_main_job.sh")],
                         capture_output=True, text=True, check=True).stdout
    return out.splitlines()


def test_ci_runs_every_command_of_the_main_job_section() -> None:
    section = README.read_text().split("\n## The main job\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```\n(.*?)```", section, flags=re.S)
    assert block is not None
    commands = _main_job_commands()
    assert commands == [line for line in block.group(1).splitlines() if line.strip()]
    assert len(commands) >= 5 and "scripts/readme_main_job.sh" in (
        README.parent / ".ci" / "run").read_text()


def test_readme_trace_commands_run_from_a_clone() -> None:
    """No command reaches outside the repository, and every trace a main-job `kvcore replay`
    names is there (by path from the repository root, or by its built-in name)."""
    from kvcore.cli import build_parser
    from kvcore.sim.traces import resolve_trace

    docs = ["README.md", "BENCHMARKS.md"] + [
        str(p.relative_to(README.parent)) for p in sorted((README.parent / "docs").rglob("*.md"))]
    for doc in docs:
        for block in re.findall(r"```(?:bash)?\n(.*?)```", (README.parent / doc).read_text(),
                                flags=re.S):
            assert "../shared" not in block, (doc, block)
    replays = [c for c in _main_job_commands() if c.startswith("kvcore replay")]
    traces = [build_parser().parse_args(shlex.split(c, comments=True)[1:]).trace
              for c in replays]
    assert [t for t in traces if t] == ["mooncake-synthetic",
                                        "kvcore/data/mooncake/synthetic_trace.jsonl"]
    for trace in filter(None, traces):
        path = resolve_trace(trace)
        assert (path if path.is_absolute() else README.parent / path).is_file(), trace
