"""A short seeded run of the hostile fuzzer over every setup (the long run is
``python -m kvcore.bench fuzz``, recorded in BENCHMARKS.md)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from pathlib import Path
from typing import SupportsIndex

import pytest

from kvcore.bench.fuzz import FuzzReport, fuzz, main, run_round
from kvcore.manager import KVCacheManager
from kvcore.testing.setups import SETUPS, Setup, full
from kvcore.types import KVCacheBlock, KVRequest


@pytest.mark.parametrize("setup", SETUPS, ids=[s.name for s in SETUPS])
def test_every_setup_survives_hostile_operations(setup: Setup) -> None:
    report = FuzzReport()
    run_round(setup, seed=7, num_ops=150, report=report)
    assert not report.violations, report.violations[0]
    assert report.counts["admit"] > 0


class ForgetsToUncache(KVCacheManager):
    """A manager that forgets to drop a failed step's unwritten KV."""

    def uncache_blocks(self, request: KVRequest, num_computed_tokens: SupportsIndex) -> None:
        return None


def test_fuzz_reports_a_planted_violation() -> None:
    # The planted bug must be caught.
    report = fuzz(3000, seed=1, round_ops=3000,
                  setups=(Setup("full", (full(4),), manager_class=ForgetsToUncache),))
    assert report.violations and "WrongKVError" in report.violations[0]


class KeepsPartialTailOnRunningState(KVCacheManager):
    """A manager whose Mamba producers keep their partial prompt-tail entry on the state block
    they go on writing: each copy's entries go back to its source before the step runs."""

    def take_block_copies(self) -> tuple[list[tuple[KVCacheBlock, KVCacheBlock]],
                                         list[KVCacheBlock]]:
        pairs, retained = super().take_block_copies()
        for source, copy in pairs:
            if copy.block_hash is not None and source.block_hash is None:
                self.pool.move_block_hashes(copy, source)  # the planted bug
        return pairs, retained


class RunsNoBlockCopies(KVCacheManager):
    """A manager that records copies-on-write but never hands them to the engine."""

    def take_block_copies(self) -> tuple[list[tuple[KVCacheBlock, KVCacheBlock]],
                                         list[KVCacheBlock]]:
        super().take_block_copies()
        return [], []


@pytest.mark.parametrize("planted", [KeepsPartialTailOnRunningState, RunsNoBlockCopies])
def test_fuzz_catches_a_partial_block_hit_serving_other_kv(planted: type[KVCacheManager]) -> None:
    """Partial-block hits: a state served after it went on, or a shared tail never copied,
    is caught by the content oracle (or the withheld-block check)."""
    setup = next(s for s in SETUPS if s.name == "full12+mamba-align12 unit3 partial")
    report = FuzzReport()
    for seed in range(4):
        run_round(dataclasses.replace(setup, manager_class=planted), seed=seed, num_ops=300,
                  report=report)
    assert report.violations
    assert any(w in report.violations[0] for w in ("WrongKVError", "withheld blocks differ"))


def test_fuzz_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--ops", "300", "--round-ops", "100", "--setup", "full verify",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "300 operations" in out and "0 violations" in out


def test_fuzz_command_runs_a_family_and_reports_each_setup(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--ops", "150", "--round-ops", "10", "--match", "mixed-bs full4+mamba-align8 la3",
                 "--per-setup", "--no-progress"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if "mixed-bs full4+mamba-align8" in line]
    assert len(rows) == 15  # dense, ret0 and ret16, each with the 5 pool policies
    assert {row[-2] for row in rows} == {"10"} and {row[-1] for row in rows} == {"0"}
    assert "150 operations in 15 rounds over 15 setups" in out


class EvictionFails(KVCacheManager):
    """A manager whose evict_blocks breaks."""

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        raise RuntimeError("planted")


def test_a_violation_names_the_operation_that_raised_it() -> None:
    report = fuzz(400, seed=0, round_ops=400,
                  setups=(Setup("full", (full(4),), manager_class=EvictionFails),))
    assert report.violations and "(evict): RuntimeError: planted" in report.violations[0]
    assert report.setup_violations == {"full": len(report.violations)}
    assert report.setup_ops == {"full": report.ops}


def test_the_reliability_page_counts_the_setups_ci_runs() -> None:
    readme = (Path(__file__).parent.parent / "docs" / "reliability.md").read_text()
    counts = re.findall(r"a seeded run of all (\d+) setups", readme)
    assert counts == [str(len(SETUPS))]
