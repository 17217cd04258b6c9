"""The documentation under docs/: its Python examples run as written (they moved there from the
README, whose test ran them), every page is in the site's navigation, the site shows the README's
set-up and main-job blocks as CI runs them, and the README's and BENCHMARKS.md's links resolve.
``mkdocs build --strict`` (a stage of .ci/run) checks the site's own links and anchors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
# Upstream bug reports: their code reproduces a crash or an exception in another project, by
# design, and is not kvcore's to run.
NOT_RUN = {"mypyc_weakref_bug.md", "vllm_swa_lookahead_bug.md",
           "vllm_mamba_external_undercount_bug.md"}
# The pages the README's Python examples moved to, with how many each holds (so that none is
# lost from the tests in a later move).
EXPECTED_BLOCKS = {"policies.md": 1, "scheduler-api.md": 1, "events-routing.md": 1,
                   "runner.md": 1}


def _pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def _python_blocks(path: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", path.read_text(), flags=re.S | re.M)


BLOCKS = [(p.relative_to(DOCS).as_posix(), i, code) for p in _pages()
          if p.name not in NOT_RUN for i, code in enumerate(_python_blocks(p))]


def test_the_moved_examples_are_where_they_moved() -> None:
    counts: dict[str, int] = {}
    for page, _, _ in BLOCKS:
        counts[page] = counts.get(page, 0) + 1
    assert counts == EXPECTED_BLOCKS


@pytest.mark.parametrize("page,index,code", BLOCKS, ids=[f"{p}:{i}" for p, i, _ in BLOCKS])
def test_docs_python_block_runs(page: str, index: int, code: str) -> None:
    exec(compile(code, str(DOCS / page), "exec"), {"__name__": "docs"})


def test_every_page_is_in_the_navigation_once() -> None:
    nav = re.findall(r"^\s*- (?:[^\n]*: )?([\w./-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(),
                     flags=re.M)
    assert sorted(nav) == sorted(p.relative_to(DOCS).as_posix() for p in _pages())


def test_the_site_shows_the_readme_blocks_ci_runs() -> None:
    """docs/getting-started.md includes the README's set-up and main-job blocks at build time
    (pymdownx.snippets), between markers that enclose exactly the blocks .ci/run reads."""
    readme = (ROOT / "README.md").read_text()
    for name, fence in (("setup", "```bash"), ("main-job", "```")):
        section = re.search(rf"<!-- --8<-- \[start:{name}\] -->\n(.*?)<!-- --8<-- \[end:{name}\] -->",
                            readme, flags=re.S)
        assert section is not None, name
        assert section.group(1).startswith(fence + "\n") and section.group(1).endswith("```\n")
        assert f'--8<-- "README.md:{name}"' in (DOCS / "getting-started.md").read_text()
    main_job = readme.split("\n## The main job\n", 1)[1].split("\n## ", 1)[0]
    assert "[start:main-job]" in main_job


def _links(text: str) -> list[str]:
    return [m for m in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in m]


@pytest.mark.parametrize("doc", ["README.md", "BENCHMARKS.md"])
def test_root_documents_links_resolve(doc: str) -> None:
    """The README and BENCHMARKS.md are read on the repository's page, outside the site: each
    relative link names a file that exists, and each anchor into BENCHMARKS.md is one of its
    ``<a id>`` anchors."""
    text = (ROOT / doc).read_text()
    anchors = set(re.findall(r'<a id="([\w-]+)"></a>', (ROOT / "BENCHMARKS.md").read_text()))
    links = _links(text)
    assert links
    for link in links:
        target, _, anchor = link.partition("#")
        path = (ROOT / target) if target else ROOT / doc
        assert path.exists(), (doc, link)
        if anchor and path.name == "BENCHMARKS.md":
            assert anchor in anchors, (doc, link)


def test_benchmarks_summary_links_every_row_to_a_dated_section() -> None:
    text = (ROOT / "BENCHMARKS.md").read_text()
    summary = text.split("## Summary", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in summary.splitlines() if r.startswith("| ") and not r.startswith("| ---")]
    assert len(rows) >= 6
    for row in rows[1:]:
        dates = re.findall(r"\[(\d{4}-\d\d-\d\d)\]\(#([\w-]+)\)", row)
        assert dates, row
        for date, anchor in dates:
            before, after = text.split(f'<a id="{anchor}"></a>', 1)
            heading = after.lstrip().splitlines()[0]
            assert heading.startswith("## ") or heading.startswith("### "), (anchor, heading)
            dated = heading if heading.startswith("## ") else before.rsplit("\n## ", 1)[1]
            assert dated.startswith(("## " + date, date)), (anchor, dated[:80])
