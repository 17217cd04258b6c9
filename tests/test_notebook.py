"""The experiments notebook runs top to bottom (nbclient), is committed without outputs, and its
figures in ``docs/notebook/`` are current."""

from __future__ import annotations

import json
import re
import resource
from pathlib import Path

import nbformat
import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "prefix_cache_experiments.ipynb"
FIGURES = NOTEBOOK.parents[1] / "docs" / "notebook"


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def test_notebook_is_committed_without_outputs() -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None


def test_notebook_loads_the_shipped_trace_without_a_fallback() -> None:
    """The Mooncake trace ships in the repository: the notebook loads it by its built-in name
    and has no path outside the repository, nor a workload to fall back on."""
    source = "\n".join(c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells)
    assert 'load_mooncake("mooncake-synthetic")' in source
    assert "../shared" not in source and "is_file()" not in source


def test_notebook_executes_within_a_minute_and_its_committed_figures_are_current(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The notebook writes its figures and the numbers they plot (``figures.json``); those in
    ``docs/notebook/``, which docs/getting-started.md shows, must be what it draws now."""
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("KVCORE_NOTEBOOK_FIGURES", str(tmp_path))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # The kernel's CPU time (a child process, reaped when the client shuts it down), not the
    # wall clock: the minute is the notebook's work, however busy the machine is.
    start = _children_cpu_s()
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    cpu = _children_cpu_s() - start
    assert cpu < 60, f"notebook took {cpu:.0f}s of CPU time"
    text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "hit rate" in text and "requests" in text
    assert "LRU→Belady gap closed" in text and "queue_hints" in text  # the eviction-policy section
    assert "schedule policy x eviction policy" in text  # the schedule-policy section
    assert any("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code"
               for o in c.outputs)
    drawn = json.loads((tmp_path / "figures.json").read_text())
    committed = json.loads((FIGURES / "figures.json").read_text())
    assert drawn.keys() == committed.keys() == {"hit_rate_vs_capacity", "kv_usage", "queue_hints",
                                                "schedule_policies"}
    for name in drawn:
        assert drawn[name] == committed[name], (
            f"docs/notebook/{name}.png is out of date: run the notebook and commit docs/notebook/")
        assert (tmp_path / f"{name}.png").stat().st_size > 10_000
        assert (FIGURES / f"{name}.png").stat().st_size > 10_000


def test_docs_say_how_to_open_the_notebook_and_show_its_figures() -> None:
    """Getting started (docs/getting-started.md, where the README's notebook section moved)."""
    repo = NOTEBOOK.parents[1]
    page = (repo / "docs" / "getting-started.md").read_text()
    command = ".venv/bin/pip install -e '.[notebook]' && .venv/bin/jupyter lab " \
              "notebooks/prefix_cache_experiments.ipynb"
    assert f"```bash\n{command}\n```" in page
    pyproject = (repo / "pyproject.toml").read_text()
    extras = dict(re.findall(r"^(\w+) = \[(.*?)\]$", pyproject, flags=re.M | re.S))
    assert '"jupyterlab"' in extras["notebook"]
    assert "jupyter" not in extras["dev"]  # hence the extra
    shown = re.findall(r"!\[[^]]*\]\((notebook/[^)]+\.png)\)", page)
    assert sorted(shown) == sorted(f"notebook/{p.name}" for p in FIGURES.glob("*.png"))
    assert len(shown) == 4
