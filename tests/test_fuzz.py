"""A short seeded run of the hostile fuzzer over every setup (the long run is
``python -m kvcore.bench fuzz``, recorded in BENCHMARKS.md)."""

from __future__ import annotations

from typing import SupportsIndex

import pytest

from kvcore.bench.fuzz import FuzzReport, fuzz, main, run_round
from kvcore.manager import KVCacheManager
from kvcore.testing.setups import SETUPS, Setup, full
from kvcore.types import KVRequest


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


def test_fuzz_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--ops", "300", "--round-ops", "100", "--setup", "full verify",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "300 operations" in out and "0 violations" in out
