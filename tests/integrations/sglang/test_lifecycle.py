"""The checkpoint lifecycle through SGLang's own request code: ``Req`` objects, SGLang's
``ReqToTokenPool`` and token allocator, and SGLang's ``match_kv_cache``,
``checkpoint_kv_cache`` and ``release_kv_cache`` (what its scheduler calls), over chunked
prefill, decoding, finishing, an abort and a retraction with re-admission.

kvcore's backend answers what SGLang's ``RadixCache`` and ``UnifiedRadixCache`` (Python and
Rust tree cores) answer at every step (hit lengths,
evictable and protected sizes), its lock counts stay balanced (each cached page's reference
count is the number of running requests whose lock covers it), and once every request is gone
nothing is protected and every slot is free or evictable."""

from __future__ import annotations

import random
from array import array
from collections import Counter
from typing import Any

import pytest
from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req
from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.mem_cache.common import checkpoint_kv_cache, match_kv_cache, release_kv_cache
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.sampling.sampling_params import SamplingParams

from kvcore.eviction import REGISTRY
from kvcore.integrations.sglang.cache import KVCoreRadixCache
from tests.integrations.sglang.helpers import make_cache

pytestmark = pytest.mark.usefixtures("sglang_context")


class Lifecycle:
    """One cache stepped the way SGLang's scheduler steps requests (no model: the KV slots are
    allocated and written, never computed)."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache
        self.alloc = cache.token_to_kv_pool_allocator
        self.ps = cache.page_size
        self.req_pool = ReqToTokenPool(8, 512, "cpu", False)
        cache.req_to_token_pool = self.req_pool
        self.running: dict[str, Req] = {}
        self.trace: list[tuple[str, int, int, int]] = []

    def note(self, what: str, value: int = 0) -> None:
        self.trace.append((what, value, self.cache.evictable_size(), self.cache.protected_size()))
        self.check()

    def admit(self, req: Req) -> None:
        req.refresh_fill_ids()
        match_kv_cache(req, self.cache)
        req.lock = self.cache.lock(req.last_node)
        self.req_pool.alloc([req])
        prefix = self.cache.prefix_device_indices(req)
        self.req_pool.write((req.kv.req_pool_idx, slice(0, req.prefix_len)), prefix)
        req.kv.cache_protected_len = req.prefix_len
        req.kv.kv_allocated_len = req.kv.kv_committed_len = req.prefix_len
        self.running[req.rid] = req
        self.note(f"admit {req.rid}", req.prefix_len)

    def _slots(self, req: Req, n: int) -> None:
        """Allocate and write KV slots for the next ``n`` tokens (paged: a new page at each page
        boundary, evicting what is short)."""
        row = self.req_pool.req_to_token[req.kv.req_pool_idx]
        for pos in range(req.kv.kv_committed_len, req.kv.kv_committed_len + n):
            if pos % self.ps == 0:
                if self.alloc.available_size() < self.ps:
                    self.cache.evict(EvictParams(num_tokens=self.ps))
                page = self.alloc.alloc(self.ps)
                assert page is not None, "out of KV slots"
                row[pos] = page[0]
            else:
                row[pos] = row[pos - 1] + 1
        req.kv.kv_committed_len += n
        req.kv.kv_allocated_len = req.kv.kv_committed_len

    def prefill_chunk(self, req: Req, n: int) -> None:
        self._slots(req, n)
        req.extend_end = req.kv.kv_committed_len
        checkpoint_kv_cache(req, self.cache)
        self.note(f"chunk {req.rid}")

    def decode(self, req: Req, token: int) -> None:
        req.output_ids.append(token)
        req.refresh_fill_ids()
        self._slots(req, 1)
        self.note(f"decode {req.rid}")

    def finish(self, req: Req) -> None:
        req.finished_reason = FINISH_LENGTH(len(req.output_ids))
        self._release(req, checkpoint=True)

    def abort(self, req: Req) -> None:
        self._release(req, checkpoint=False)

    def retract(self, req: Req) -> None:
        self._release(req, checkpoint=False)
        del req.output_ids[:]  # recomputed from the prompt when re-admitted
        req.reset_for_retract()

    def _release(self, req: Req, *, checkpoint: bool) -> None:
        release_kv_cache(req, self.cache, checkpoint=checkpoint)
        del self.running[req.rid]
        self.note(f"release {req.rid}")

    def check(self) -> None:
        # SGLang's leak check: a running request holds its pages past the tree-owned prefix.
        held_pages = sum(-(-r.kv.kv_allocated_len // self.ps) - r.kv.cache_protected_len
                         // self.ps for r in self.running.values())
        assert (self.alloc.available_size() + self.cache.evictable_size()
                + self.cache.protected_size() + held_pages * self.ps) == self.alloc.size
        if isinstance(self.cache, KVCoreRadixCache):
            self.cache.sanity_check()
            locks: Counter[int] = Counter()
            for r in self.running.values():
                if r.lock is not None:
                    locks.update(r.lock.node.block_ids)
            for block in self.cache.pool.blocks[1:]:
                if block.block_hash is not None:
                    assert block.ref_cnt == locks[block.block_id], (block, locks)


def request(rid: str, tokens: list[int], *, salt: str | None = None) -> Req:
    req = Req(rid, "", array("q", tokens), SamplingParams(max_new_tokens=64))
    req.cache_salt = salt
    return req


def scenario(driver: Lifecycle) -> list[tuple[str, int, int, int]]:
    doc = list(range(100, 148))
    a = request("a", [*doc, 1, 2, 3])
    b = request("b", [*doc[:30], 9, 9, 9, 9, 9])
    c = request("c", [*doc, 4, 5])
    d = request("d", [*doc, 1, 2, 3], salt="other-tenant")
    driver.admit(a)
    driver.prefill_chunk(a, 16)  # chunked prefill: 16 + 16 + the rest
    driver.admit(b)  # shares a's first chunk
    driver.prefill_chunk(a, 16)
    driver.prefill_chunk(b, len(b.origin_input_ids) - b.prefix_len)
    driver.prefill_chunk(a, len(a.origin_input_ids) - 32)
    for token in (7, 8, 9, 10, 11):
        driver.decode(a, token)
    driver.decode(b, 12)
    driver.abort(b)  # aborted mid-decode: nothing of its output is cached
    driver.admit(c)
    driver.prefill_chunk(c, len(c.origin_input_ids) - c.prefix_len)
    driver.decode(c, 13)
    driver.retract(c)  # retracted: its row is freed, its lock dropped
    driver.finish(a)
    driver.admit(d)  # the same tokens under another cache_salt: no hit
    driver.prefill_chunk(d, len(d.origin_input_ids))
    driver.admit(c)  # re-admitted after the retraction
    driver.prefill_chunk(c, len(c.origin_input_ids) - c.prefix_len)
    driver.decode(c, 14)
    driver.finish(c)
    driver.finish(d)
    return driver.trace


@pytest.mark.parametrize("reference", ["sglang", "unified:python", "unified:rust"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_lifecycle_matches_sglang_and_balances_locks(page_size: int, reference: str) -> None:
    """Against SGLang's RadixCache and its UnifiedRadixCache (0.5.23's default cache) with the
    Python and the Rust tree core."""
    sglang = scenario(Lifecycle(make_cache(reference, 400, page_size)))
    kvcore_driver = Lifecycle(make_cache("kvcore:lru", 400, page_size, check_every=1))
    kvcore = scenario(kvcore_driver)
    assert kvcore == sglang
    hits = dict((what, value) for what, value, _, _ in sglang if what.startswith("admit"))
    assert hits["admit b"] == 16 // page_size * page_size  # a's first chunk, checkpointed
    assert hits["admit d"] == 0  # another namespace
    assert kvcore[-1][3] == 0  # nothing protected at the end
    assert kvcore_driver.req_pool.available_size() == kvcore_driver.req_pool.size


@pytest.mark.parametrize("policy", REGISTRY.names(offline=False))
def test_lifecycle_under_pressure_balances_locks(policy: str) -> None:
    driver = Lifecycle(make_cache(f"kvcore:{policy}", 26, 4, check_every=1))
    trace = scenario(driver)  # Lifecycle.check: leak check and lock balance after every step
    assert driver.cache.num_evicted_pages > 0
    assert trace[-1][3] == 0


def random_scenario(driver: Lifecycle, seed: int) -> list[tuple[str, int, int, int]]:
    """Random requests over shared documents in several namespaces, stepped through admission,
    chunked prefill, decoding, finishing, aborts and retractions."""
    rng = random.Random(seed)
    ps = driver.ps
    docs = [[rng.randrange(1, 30_000) for _ in range(5 * ps)] for _ in range(4)]
    namespaces = [(None, None), ("lora-a", None), (None, "salt")]
    waiting: list[Req] = []
    for i in range(14):
        doc = docs[rng.randrange(len(docs))]
        tokens = doc[:rng.randrange(1, len(doc) + 1)] + [rng.randrange(1, 30_000)
                                                         for _ in range(rng.randrange(1, ps + 3))]
        req = request(f"q{i}", tokens, salt=None)
        req.extra_key, req.cache_salt = rng.choice(namespaces)
        waiting.append(req)
    running: list[Req] = []
    while waiting or running:
        r = rng.random()
        if waiting and (not running or (r < 0.3 and len(running) < 4)):
            req = waiting.pop(0)
            driver.admit(req)
            running.append(req)
            continue
        req = rng.choice(running)
        left = len(req.origin_input_ids) - req.kv.kv_committed_len
        if left > 0:
            driver.prefill_chunk(req, min(left, rng.choice([ps, 2 * ps + 1, left])))
        elif r < 0.55:
            driver.decode(req, rng.randrange(1, 30_000))
        elif r < 0.8:
            driver.finish(req)
            running.remove(req)
        elif r < 0.9:
            driver.abort(req)
            running.remove(req)
        else:
            driver.retract(req)
            running.remove(req)
            waiting.append(req)
    return driver.trace


@pytest.mark.parametrize("reference", ["sglang", "unified:python", "unified:rust"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_random_lifecycles_match_sglang(page_size: int, reference: str) -> None:
    """Random traces through SGLang's scheduler calls, with room for everything: every hit
    length and the evictable and protected sizes after every call are the reference cache's."""
    for seed in (1, 2):
        sglang = random_scenario(Lifecycle(make_cache(reference, 2000, page_size)), seed)
        kvcore = random_scenario(Lifecycle(make_cache("kvcore:lru", 2000, page_size)), seed)
        assert any(value for what, value, _, _ in sglang if what.startswith("admit"))
        assert kvcore == sglang


def test_learned_hears_each_finished_request() -> None:
    """``learned`` learns from releases: each finished request's last checkpoint tells it the
    request's pages and prompt / output lengths (aborted and retracted ones tell nothing)."""
    driver = Lifecycle(make_cache("kvcore:learned", 400, 4, check_every=1))
    heard: list[tuple[int, int, int]] = []
    note = driver.cache.pool.note_release

    def spy(groups: Any, release: Any, **kwargs: Any) -> None:
        heard.append((len(groups[0]), release.num_prompt_tokens, release.num_output_tokens))
        note(groups, release, **kwargs)

    driver.cache.pool.note_release = spy
    scenario(driver)
    # a: 51 prompt + 5 output tokens (56 // 4 pages); c, re-admitted: 50 + 1; d: 51 + 0.
    assert heard == [(14, 51, 5), (12, 50, 1), (12, 51, 0)]
