"""The README's Python examples run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_setup_block_first() -> None:
    first = re.search(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
    assert first is not None
    lines = first.group(1).strip().splitlines()
    assert lines[0].startswith("python3 -m venv .venv && .venv/bin/pip install -e")
    assert "pytest" in lines[1]


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_python_block_runs(code: str) -> None:
    exec(compile(code, str(README), "exec"), {"__name__": "readme"})
