"""SGLang's cache-aware admission orders over the kvcore backend: ``SchedulePolicy`` (SGLang's
own class) sorts a waiting queue of SGLang ``Req`` objects over kvcore's backend exactly as over
SGLang's ``RadixCache`` holding the same prefixes: ``lpm`` (longest cached prefix first) and
``dfs-weight`` (grouped by shared cached path, heavier groups first)."""

from __future__ import annotations

import random
from array import array
from typing import Any

import pytest
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.schedule_policy import SchedulePolicy
from sglang.srt.sampling.sampling_params import SamplingParams

from tests.integrations.sglang.helpers import Driver, make_cache, random_ops, run

pytestmark = pytest.mark.usefixtures("sglang_context")


def waiting_queue(seed: int, page_size: int) -> list[Req]:
    """Requests over the same documents as ``random_ops(seed, ...)``, in its namespaces."""
    rng = random.Random(seed)
    corpus = [[rng.randrange(1, 50_000) for _ in range(6 * page_size)] for _ in range(6)]
    out = []
    for i in range(24):
        doc = corpus[rng.randrange(len(corpus))]
        tokens = doc[:rng.randrange(1, len(doc) + 1)] + [rng.randrange(1, 50_000)
                                                         for _ in range(rng.randrange(1, 9))]
        req = Req(f"r{i}", "", array("q", tokens), SamplingParams(max_new_tokens=8))
        req.extra_key = rng.choice([None, None, "lora-a"])
        out.append(req)
    return out


def order(cache: Any, policy: str, queue: list[Req]) -> list[tuple[str, int]]:
    SchedulePolicy(policy, cache, False, False, False).calc_priority(queue)
    return [(r.rid, r.prefix_len) for r in queue]


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_admission_order_identical(policy: str, page_size: int) -> None:
    ops = random_ops(5, page_size, 120, evictions=False)
    caches = []
    for kind in ("sglang", "kvcore:lru"):
        driver = Driver(make_cache(kind, 2000, page_size), deep=False)
        run(driver, ops)
        for rid in list(driver.running):
            driver.finish(rid)
        caches.append(driver.cache)
    sglang = order(caches[0], policy, waiting_queue(5, page_size))
    kvcore = order(caches[1], policy, waiting_queue(5, page_size))
    assert sum(hit for _, hit in sglang) > 0
    assert kvcore == sglang
