"""The experiments notebook runs top to bottom (nbclient) and is committed without outputs."""

from __future__ import annotations

import time
from pathlib import Path

import nbformat
import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "prefix_cache_experiments.ipynb"


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


def test_notebook_executes_within_a_minute() -> None:
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    start = time.perf_counter()
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    elapsed = time.perf_counter() - start
    assert elapsed < 60, f"notebook took {elapsed:.0f}s"
    text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "hit rate" in text and "requests" in text
    assert "LRU→Belady gap closed" in text and "queue_hints" in text  # the eviction-policy section
    assert any("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code"
               for o in c.outputs)
