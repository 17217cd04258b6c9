"""SGLang's prefix cache (its own ``RadixCache`` with its policies, or kvcore's backend with
kvcore's) replayed through a trace without a model, with SGLang's scheduling pieces.

::

    python -m kvcore.integrations.sglang.replay agent --block-size 512 --num-blocks 2048
    python -m kvcore.integrations.sglang.replay TRACE.jsonl --block-size 512 --num-blocks 4096 \\
        --engines sglang:lru,sglang:slru,sglang:lfu,kvcore:lru,kvcore:recommended --json

What is SGLang's: the ``Req`` objects, ``SchedulePolicy`` (``--schedule-policy fcfs`` or
``lpm``, sorting the waiting queue every step), the ``ReqToTokenPool``, the token allocator
(``PagedTokenToKVPoolAllocator`` over ``--num-blocks`` pages of ``--block-size`` tokens), the
prefix cache, and ``match_kv_cache`` / ``checkpoint_kv_cache`` / ``release_kv_cache`` (what its
scheduler calls).  What is the replay's, because SGLang's ``Scheduler`` and ``PrefillAdder``
cannot be driven without a model worker and its configuration: the step loop, in the order
SGLang's scheduler runs it (sort the waiting queue; admit in that order, pinning each match,
while the step's token budget ``--chunk-size``, the running limit and the free + evictable pages
allow, the last admitted request's prompt chunked; decode one token per running request; retract
the newest request when a decode step cannot get a page; release finished requests with a
checkpoint, retracted ones without).  Admission reserves the request's whole prompt plus
``--decode-reserve`` tokens, PrefillAdder's rule without its new-token ratio.  Every request is
queued at the start, at most ``--window`` of them visible to the policy at once (in arrival
order).  A prompt's chunk is checkpointed into the cache when it is computed.

Each engine reports the hit rate (prompt tokens found cached at admission over prompt tokens
admitted), tokens evicted, retractions, steps, and the CPU time per step (median over steps; the
whole step: SGLang's pieces and the cache).  Engines: ``sglang:POLICY`` (SGLang's
``RadixCache``: ``lru``, ``lfu``, ``slru``, ``fifo``, ``priority``, ...) and ``kvcore:POLICY``
(kvcore's backend: ``lru``, ``slru``, ``s3fifo``, ``arc``, ``learned`` or ``recommended``,
which runs without queue hints; :mod:`~kvcore.integrations.sglang.settings`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import zlib
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvcore.errors import InvalidArgumentError
from kvcore.sim.traces import TraceRequest

DEFAULT_ENGINES = "sglang:lru,kvcore:lru,kvcore:recommended"


@dataclass
class ReplayResult:
    """What one engine's run produced."""

    engine: str
    hit_rate: float
    hit_tokens: int
    prompt_tokens: int
    evicted_tokens: int
    retractions: int
    steps: int
    finished: int
    step_ms_median: float
    cpu_s: float


def _publish_context() -> None:
    """SGLang's request code reads its published server arguments."""
    from sglang.srt.runtime_context import publish, reset_context
    from sglang.srt.server_args import ServerArgs

    reset_context()
    publish(ServerArgs(model_path="dummy", device="cpu"), role="tokenizer")


def make_cache(engine: str, page_size: int, num_pages: int) -> Any:
    """The allocator and cache of ``engine`` (``sglang:POLICY`` or ``kvcore:POLICY``)."""
    import torch
    from sglang.srt.mem_cache.allocator import (
        PagedTokenToKVPoolAllocator,
        TokenToKVPoolAllocator,
    )
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixCache

    from kvcore.integrations.sglang.cache import KVCoreRadixCache
    from kvcore.integrations.sglang.settings import SGLangSettings

    kind, _, policy = engine.partition(":")
    size = num_pages * page_size
    allocator = (TokenToKVPoolAllocator(size, torch.int64, "cpu", None, need_sort=False)
                 if page_size == 1 else
                 PagedTokenToKVPoolAllocator(size, page_size, torch.int64, "cpu", None,
                                             need_sort=False))
    params = CacheInitParams(disable=False, req_to_token_pool=None,
                             token_to_kv_pool_allocator=allocator, page_size=page_size,
                             eviction_policy=policy or "lru")
    if kind == "sglang":
        return RadixCache(params)
    if kind == "kvcore":
        settings = SGLangSettings.from_env({"KVCORE_SGLANG_EVICTION_POLICY": policy or "lru"})
        return KVCoreRadixCache(params, settings)
    raise InvalidArgumentError(f"engine {engine!r}: expected sglang:POLICY or kvcore:POLICY")


class _Replay:
    """One engine's run (see the module docstring for the step loop)."""

    def __init__(self, engine: str, requests: Sequence[TraceRequest], args: argparse.Namespace):
        import torch
        from sglang.srt.managers.schedule_policy import SchedulePolicy
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

        self.torch = torch
        self.engine = engine
        self.ps = args.block_size
        self.cache = make_cache(engine, self.ps, args.num_blocks)
        self.alloc = self.cache.token_to_kv_pool_allocator
        longest = max(r.num_prompt_tokens + r.output_len for r in requests) + 1
        self.req_pool = ReqToTokenPool(args.max_running, -(-longest // self.ps) * self.ps,
                                       "cpu", False)
        self.cache.req_to_token_pool = self.req_pool
        self.policy = SchedulePolicy(args.schedule_policy, self.cache, False, False, False)
        self.args = args
        self.requests = requests
        self.hit_tokens = self.prompt_tokens = self.retractions = self.evicted = 0

    def _req(self, tr: TraceRequest) -> Any:
        from array import array

        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        req = Req(tr.request_id, "", array("q", tr.prompt_token_ids()),
                  SamplingParams(max_new_tokens=max(tr.output_len, 1)))
        req.trace_output_len = max(tr.output_len, 1)
        return req

    def _grow(self, req: Any, n: int) -> bool:
        """Allocate and write slots for the request's next ``n`` tokens (a new page at each page
        boundary), evicting what is short; ``False`` (nothing changed) when pages run out."""
        torch, ps = self.torch, self.ps
        start = req.kv.kv_allocated_len
        pages = -(-(start + n) // ps) - -(-start // ps)
        if pages:
            short = pages * ps - self.alloc.available_size()
            if short > 0:
                self.evicted += self.cache.evict(self._evict_params(short)).num_tokens_evicted
            got = self.alloc.alloc(pages * ps)
            if got is None:
                return False
        row = self.req_pool.req_to_token[req.kv.req_pool_idx]
        positions = torch.arange(start, start + n)
        slots = torch.empty(n, dtype=torch.int64)
        in_last = min(n, -(-start // ps) * ps - start)  # the rest of a partly used page
        if in_last:
            slots[:in_last] = row[start - 1].to(torch.int64) + 1 + torch.arange(in_last)
        if pages:
            fresh = got.to(torch.int64)
            slots[in_last:] = fresh[:n - in_last]
        row[positions] = slots.to(row.dtype)
        req.kv.kv_allocated_len = req.kv.kv_committed_len = start + n
        return True

    @staticmethod
    def _evict_params(n: int) -> Any:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        return EvictParams(num_tokens=n)

    def run(self) -> ReplayResult:
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH
        from sglang.srt.mem_cache.common import (
            checkpoint_kv_cache,
            match_kv_cache,
            release_kv_cache,
        )

        args, cache = self.args, self.cache
        pending = deque(self.requests)
        waiting: list[Any] = []
        running: list[Any] = []
        prefilling: Any = None
        finished = steps = 0
        step_s: list[float] = []
        cpu0 = time.process_time()
        while pending or waiting or running:
            t0 = time.perf_counter()
            steps += 1
            while pending and len(waiting) < args.window:
                waiting.append(self._req(pending.popleft()))
            budget = args.chunk_size
            # A chunked prompt continues first, as SGLang's chunked request does.
            if prefilling is not None:
                budget -= self._prefill(prefilling, budget, checkpoint_kv_cache)
                if prefilling.kv.kv_committed_len == len(prefilling.origin_input_ids):
                    prefilling = None
            if prefilling is None and waiting and budget > 0:
                self.policy.calc_priority(waiting)
                while waiting and budget > 0 and len(running) < args.max_running:
                    req = waiting[0]
                    req.refresh_fill_ids()
                    match_kv_cache(req, cache)
                    lock = cache.lock(req.last_node)
                    need = len(req.origin_input_ids) - req.prefix_len + args.decode_reserve
                    free = self.alloc.available_size() + cache.evictable_size()
                    if need > free:
                        cache.unlock(lock)
                        break
                    waiting.pop(0)
                    req.lock = lock
                    self.req_pool.alloc([req])
                    prefix = cache.prefix_device_indices(req)
                    self.req_pool.write((req.kv.req_pool_idx, slice(0, req.prefix_len)), prefix)
                    req.kv.cache_protected_len = req.prefix_len
                    req.kv.kv_allocated_len = req.kv.kv_committed_len = req.prefix_len
                    self.hit_tokens += req.prefix_len
                    self.prompt_tokens += len(req.origin_input_ids)
                    running.append(req)
                    budget -= self._prefill(req, budget, checkpoint_kv_cache)
                    if req.kv.kv_committed_len < len(req.origin_input_ids):
                        prefilling = req
                        break
            for req in list(running):
                if req is prefilling or req not in running:
                    continue
                req.output_ids.append(1 + (len(req.output_ids) * 7919 + zlib.crc32(req.rid.encode()))
                                       % 30000)
                req.refresh_fill_ids()
                while not self._grow(req, 1):
                    victim = running[-1]  # retract the newest request
                    running.remove(victim)
                    if victim is prefilling:
                        prefilling = None
                    release_kv_cache(victim, cache, checkpoint=False)
                    del victim.output_ids[:]
                    victim.reset_for_retract()
                    waiting.insert(0, victim)
                    self.retractions += 1
                    if victim is req:
                        break
                if req not in running:
                    continue
                if len(req.output_ids) >= req.trace_output_len:
                    req.finished_reason = FINISH_LENGTH(len(req.output_ids))
                    release_kv_cache(req, cache, checkpoint=True)
                    running.remove(req)
                    finished += 1
            step_s.append(time.perf_counter() - t0)
            if steps > 50 * (len(self.requests) + 10) * max(1, args.chunk_size // 64):
                raise RuntimeError(f"{self.engine}: the replay is not making progress")
        cpu = time.process_time() - cpu0
        return ReplayResult(
            engine=self.engine,
            hit_rate=self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            hit_tokens=self.hit_tokens, prompt_tokens=self.prompt_tokens,
            evicted_tokens=self.evicted, retractions=self.retractions, steps=steps,
            finished=finished, step_ms_median=statistics.median(step_s) * 1e3, cpu_s=cpu)

    def _prefill(self, req: Any, budget: int, checkpoint: Any) -> int:
        """Compute the next chunk of ``req``'s prompt (at most ``budget`` tokens) and checkpoint
        it; returns the tokens computed."""
        n = min(budget, len(req.origin_input_ids) - req.kv.kv_committed_len)
        if n <= 0 or not self._grow(req, n):
            return 0
        req.extend_end = req.kv.kv_committed_len
        checkpoint(req, self.cache)
        return n


def replay(requests: Sequence[TraceRequest], engines: Sequence[str],
           args: argparse.Namespace) -> list[ReplayResult]:
    """Every engine through ``requests``, one after the other."""
    _publish_context()
    return [_Replay(engine, requests, args).run() for engine in engines]


def _load(source: str, limit: int) -> list[TraceRequest]:
    import os

    from kvcore.sim.traces import load_mooncake
    from kvcore.sim.workloads import make_workload

    requests = load_mooncake(source) if os.path.exists(source) else make_workload(source)
    return requests[:limit] if limit else requests


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvcore.integrations.sglang.replay",
                                 description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("trace", help="a Mooncake-format trace file or a built-in workload "
                    "(shared-prefix, multi-turn, few-shot, random, agent, api, rag)")
    ap.add_argument("--engines", default=DEFAULT_ENGINES,
                    help="comma-separated sglang:POLICY (SGLang's RadixCache) and kvcore:POLICY "
                    "(kvcore's backend) (default: %(default)s)")
    ap.add_argument("--block-size", type=int, default=16, help="SGLang's page size")
    ap.add_argument("--num-blocks", type=int, default=1024, help="pages in SGLang's KV pool")
    ap.add_argument("--schedule-policy", default="fcfs", choices=("fcfs", "lpm"))
    ap.add_argument("--chunk-size", type=int, default=8192,
                    help="prefill tokens per step (SGLang's --chunked-prefill-size)")
    ap.add_argument("--max-running", type=int, default=64)
    ap.add_argument("--decode-reserve", type=int, default=128,
                    help="tokens an admission keeps free beyond the prompt")
    ap.add_argument("--window", type=int, default=128,
                    help="requests visible to the schedule policy at once")
    ap.add_argument("--max-requests", type=int, default=0, help="replay only the first N")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args(argv)
    for name in ("block_size", "num_blocks", "chunk_size", "max_running", "window"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    try:
        requests = _load(args.trace, args.max_requests)
        results = replay(requests, engines, args)
    except InvalidArgumentError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"trace": args.trace, "block_size": args.block_size,
                          "num_blocks": args.num_blocks, "schedule_policy": args.schedule_policy,
                          "requests": len(requests), "results": [asdict(r) for r in results]},
                         indent=2))
        return 0
    print(f"{args.trace}: {len(requests)} requests, {args.num_blocks} pages of "
          f"{args.block_size} tokens, {args.schedule_policy}")
    print(f"{'engine':<24} {'hit rate':>9} {'evicted':>10} {'retracted':>9} {'steps':>7} "
          f"{'ms/step':>8} {'cpu s':>7}")
    for r in results:
        print(f"{r.engine:<24} {r.hit_rate:>9.4f} {r.evicted_tokens:>10} {r.retractions:>9} "
              f"{r.steps:>7} {r.step_ms_median:>8.3f} {r.cpu_s:>7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
