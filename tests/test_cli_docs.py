"""The command-line reference (docs/cli/*.md) is each command's current ``--help``: a change of
an option without ``python scripts/cli_docs.py`` fails here."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "cli_docs.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("cli_docs", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_every_command_page_equals_its_help() -> None:
    cli_docs = _script()
    if sys.version_info[:2] != cli_docs.PYTHON:
        pytest.skip(f"the pages are argparse's layout on Python {cli_docs.PYTHON}, which CI runs")
    assert cli_docs.stale() == [], "run python scripts/cli_docs.py"
    assert len(cli_docs.pages()) == len(cli_docs.COMMANDS) + 1


def test_every_subcommand_has_a_page() -> None:
    """A new ``kvcore`` subcommand or benchmark without a page fails here."""
    from kvcore.cli import build_parser

    cli_docs = _script()
    typed = {c.typed for c in cli_docs.COMMANDS}
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert sub.choices is not None
    assert {f"kvcore {name}" for name in sub.choices} <= typed
    bench = cli_docs.help_text(next(c for c in cli_docs.COMMANDS if c.typed == "kvcore bench"))
    names = bench.split("{", 1)[1].split("}", 1)[0].split(",")
    assert {f"kvcore bench {name}" for name in names} <= typed
