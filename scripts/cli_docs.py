"""Write the command-line reference, docs/cli/*.md, from each command's ``--help``.

    python scripts/cli_docs.py           # (re)write the pages
    python scripts/cli_docs.py --check   # exit 1, naming the pages, if any differs from --help

One page per command (``kvcore``, ``kvcore replay``, ``kvcore bench`` and its benchmarks, the
policy study, the replay inside vLLM's scheduler, ``kvcore-generate`` and the runner's
benchmarks), each the command's help as argparse prints it at 100 columns, plus
docs/cli/index.md listing them.  tests/test_cli_docs.py fails when a committed page differs from
what this writes, so the reference cannot drift from the code.  argparse's layout changes between
Python versions (3.13 writes ``-o, --opt X`` where 3.11 writes ``-o X, --opt X``): the pages are
written with the Python CI runs, :data:`PYTHON`, and the script refuses another.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "cli"
PYTHON = (3, 11)  # the Python whose argparse layout the committed pages have (CI's)
COLUMNS = 100


@dataclass(frozen=True)
class Command:
    """One page: the command as typed, the entry point and the arguments that print its help."""

    slug: str
    typed: str
    entry: str  # the module whose main(argv) runs the command
    argv: tuple[str, ...]
    summary: str


COMMANDS = (
    Command("kvcore", "kvcore", "kvcore.cli", ("--help",), "the command and its subcommands"),
    Command("kvcore-replay", "kvcore replay", "kvcore.cli", ("replay", "--help"),
            "replay a trace or a built-in workload through the scheduler and the manager"),
    Command("kvcore-bench", "kvcore bench", "kvcore.cli", ("bench", "--help"),
            "benchmarks against vLLM (also `python -m kvcore.bench`)"),
    Command("kvcore-bench-pool", "kvcore bench pool", "kvcore.cli", ("bench", "pool", "--help"),
            "the block pool: alloc+free, touch, eviction"),
    Command("kvcore-bench-hash", "kvcore bench hash", "kvcore.cli", ("bench", "hash", "--help"),
            "request block hashing per algorithm"),
    Command("kvcore-bench-manager", "kvcore bench manager", "kvcore.cli",
            ("bench", "manager", "--help"), "the manager's CPU time per request cycle"),
    Command("kvcore-bench-fuzz", "kvcore bench fuzz", "kvcore.cli", ("bench", "fuzz", "--help"),
            "the long hostile fuzz run of the manager"),
    Command("kvcore-bench-fuzz-scheduler", "kvcore bench fuzz --scheduler", "kvcore.cli",
            ("bench", "fuzz", "--scheduler", "--help"),
            "the same for kvcore's scheduler with a failing KV connector"),
    Command("kvcore-sim-study", "python -m kvcore.sim.study", "kvcore.sim.study", ("--help",),
            "the eviction-policy study: the scheduler replay over cache sizes × configurations"),
    Command("kvcore-vllm-replay", "python -m kvcore.integrations.vllm.replay",
            "kvcore.integrations.vllm.replay", ("--help",),
            "vLLM's own scheduler through a trace, vLLM's manager against kvcore's (needs vLLM "
            "to run)"),
    Command("kvcore-sglang-replay", "python -m kvcore.integrations.sglang.replay",
            "kvcore.integrations.sglang.replay", ("--help",),
            "SGLang's scheduling pieces through a trace, SGLang's prefix cache against kvcore's "
            "backend (needs SGLang to run)"),
    Command("kvcore-generate", "kvcore-generate", "runner.generate", ("--help",),
            "the runner's engine end to end (also `python -m runner.generate`)"),
    Command("runner-bench", "python -m runner.bench", "runner.bench", ("--help",),
            "the runner's GPU benchmarks"),
)

NOTE = ("Generated from `{typed} --help` by `scripts/cli_docs.py`; do not edit it by hand: "
        "`tests/test_cli_docs.py` fails when this page differs from the command's help.")


def _entry(module: str) -> Callable[[Sequence[str]], int]:
    main: Callable[[Sequence[str]], int] = importlib.import_module(module).main
    return main


def help_text(command: Command) -> str:
    """The command's ``--help`` output at :data:`COLUMNS` columns (run in this process)."""
    out = io.StringIO()
    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(COLUMNS)
    try:
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            _entry(command.entry)(list(command.argv))
    finally:
        if saved is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = saved
    text = out.getvalue()
    if not text.startswith("usage: "):
        raise RuntimeError(f"{command.typed} --help printed no usage: {text[:200]!r}")
    return text


def render(command: Command) -> str:
    """The page of one command."""
    return (f"# `{command.typed}`\n\n{NOTE.format(typed=command.typed)}\n\n"
            f"```text\n{help_text(command).rstrip()}\n```\n")


def render_index() -> str:
    rows = "\n".join(f"- [`{c.typed}`]({c.slug}.md): {c.summary}" for c in COMMANDS)
    return ("# Command-line reference\n\n"
            "One page per command, each its `--help` as the command prints it (generated by "
            "`scripts/cli_docs.py`; `tests/test_cli_docs.py` keeps them equal). Every command "
            "reports bad input as one line with exit status 2.\n\n" + rows + "\n")


def pages() -> dict[Path, str]:
    """Every page this script writes, by path."""
    written = {OUT / f"{c.slug}.md": render(c) for c in COMMANDS}
    written[OUT / "index.md"] = render_index()
    return written


def stale() -> list[str]:
    """The pages (relative to the repository) that differ from what :func:`pages` writes, and
    any page in docs/cli that it does not write."""
    expected = pages()
    names = [str(p.relative_to(ROOT)) for p, text in expected.items()
             if not p.is_file() or p.read_text() != text]
    names += [str(p.relative_to(ROOT)) for p in sorted(OUT.glob("*.md")) if p not in expected]
    return names


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--check", action="store_true",
                    help="write nothing; exit 1 if a page differs from the command's help")
    args = ap.parse_args(argv)
    if sys.version_info[:2] != PYTHON:
        print(f"cli_docs.py: the pages are written with Python {PYTHON[0]}.{PYTHON[1]} "
              f"(argparse's layout differs between versions); this is "
              f"{sys.version_info[0]}.{sys.version_info[1]}", file=sys.stderr)
        return 2
    if args.check:
        names = stale()
        for name in names:
            print(f"{name} differs from the command's --help: run python scripts/cli_docs.py",
                  file=sys.stderr)
        return 1 if names else 0
    OUT.mkdir(parents=True, exist_ok=True)
    for path, text in pages().items():
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
