"""The README opens with the commands CI runs, and its Python examples run as written."""

from __future__ import annotations

import re
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
    setup = "python3 -m venv .venv && .venv/bin/pip install -e '.[dev]'"
    assert replay == f"{setup} && .venv/bin/kvcore replay"
    assert test.startswith(f"{setup} && ") and "pytest" in test.rsplit(" && ", 1)[1]
    assert "pytest" not in replay and "kvcore replay" not in test
    assert replay.rsplit(" && ", 1)[0] == test.rsplit(" && ", 1)[0]


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_python_block_runs(code: str) -> None:
    exec(compile(code, str(README), "exec"), {"__name__": "readme"})
