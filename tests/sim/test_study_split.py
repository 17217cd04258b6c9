"""``python -m kvcore.sim.study``'s development split options: ``--seed`` draws the built-in
workload with another seed, ``--head`` keeps the earliest share of the requests by arrival."""

from __future__ import annotations

import pytest

from kvcore.sim.study import _load, main
from kvcore.sim.workloads import few_shot


def test_seed_and_head_pick_the_development_split() -> None:
    assert _load(None, "few-shot") == few_shot()
    other = _load(None, "few-shot", seed=1)
    assert other == few_shot(seed=1) and other != few_shot()
    first = _load(None, "few-shot", seed=1, head=0.25)
    by_arrival = sorted(few_shot(seed=1), key=lambda r: r.arrival_ms)
    assert first == by_arrival[:len(by_arrival) // 4]


@pytest.mark.parametrize("head", ["0", "1.5"])
def test_a_head_outside_0_1_is_refused(head: str) -> None:
    with pytest.raises(SystemExit):
        main(["--workload", "few-shot", "--head", head])
