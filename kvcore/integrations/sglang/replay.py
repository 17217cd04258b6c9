"""SGLang's prefix cache (its own ``RadixCache`` with its policies, or kvcore's backend with
kvcore's) replayed through a trace without a model, with SGLang's scheduling pieces.

::

    python -m kvcore.integrations.sglang.replay agent --block-size 512 --num-blocks 2048
    python -m kvcore.integrations.sglang.replay TRACE.jsonl --block-size 512 --num-blocks 4096 \\
        --engines sglang:lru,sglang:slru,sglang:lfu,kvcore:lru,kvcore:recommended --json

What is SGLang's (its code, called as its scheduler calls it): the ``Req`` objects; the
``SchedulePolicy`` (``--schedule-policy fcfs`` or ``lpm``: ``calc_priority`` every admission,
with its matching and waiting-prefix refresh); the admission, a ``PrefillAdder`` built every
step with the arguments of ``Scheduler.get_new_batch_prefill`` (page size, the cache, the
allocator, the running ``ScheduleBatch``, the current new-token ratio, ``--max-prefill-tokens``,
``--chunk-size``, ``--max-running``; no mixed chunk, priority preemption or prefill delayer), the
chunked request first through ``add_chunked_req``, then ``add_one_req`` for each waiting request
in the policy's order until its budget says stop (``budget_state``, ``NO_TOKEN``/``OTHER``) or
the running limit and free request rows are reached (``get_num_allocatable_reqs``'s rule, with
``batch_is_full`` set and cleared where the scheduler does); the new-token ratio
(``NewTokenRatioTracker``: decayed every decode step, re-estimated after a retraction); the
``ReqToTokenPool``; the token allocator (``PagedTokenToKVPoolAllocator`` over ``--num-blocks``
pages of ``--block-size`` tokens) and its ``max_new_tokens_for_memory`` (a request's
``max_new_tokens`` bounded on arrival, as ``init_req_max_new_tokens`` does) and
``check_decode_capacity``; the prefix cache; ``match_kv_cache`` / ``checkpoint_kv_cache`` /
``release_kv_cache`` and the retraction's ``release_req``, with the retraction order
(``ScheduleBatch._get_decode_retraction_order``); the hit rate is PrefillAdder's own
(``log_hit_tokens`` over ``log_hit_tokens + log_input_tokens``).

What is the replay's, because there is no model worker (SGLang's ``ScheduleBatch.init_new`` /
``prepare_for_extend`` / ``prepare_for_decode`` and its result processing need the model's
configuration and tensors): the step loop, in the scheduler's order (admit; run the prefill
batch if one was formed, else one decode step of the running batch); allocating a prefill
batch's request rows and slots (the prefix written from the cache, each chunk's pages
allocated, evicting what is short); the "forward" (a prompt's last chunk yields its first output
token, each decode step one more, a fixed function of the request and position); what SGLang
does with the result (a finished request is released with a checkpoint, an unfinished one
checkpointed, the chunked one stashed); the decode step's retraction loop around SGLang's
pieces (retract while the step does not fit, keep at least one, abort the last if it still does
not fit); requests whose prompt exceeds the pool are refused on arrival (SGLang's
``validate_input_length`` rule, with the pool as the length limit).  Every request is queued at
the start, at most ``--window`` of them visible to the policy at once (in arrival order; a
retracted request goes back to the end of the queue).

Each engine reports the hit rate (tokens found cached at admission over tokens admitted: a
retracted request's prompt and output so far count again when it is admitted again), tokens
evicted, retractions, refused and aborted requests, steps, and the CPU time per step (median
over steps; the whole step: SGLang's pieces and the cache).  Engines: ``sglang:POLICY`` (SGLang's
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
    refused: int
    aborted: int
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


class Replay:
    """One engine's run (see the module docstring for the step loop)."""

    def __init__(self, engine: str, requests: Sequence[TraceRequest], args: argparse.Namespace):
        import torch
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.managers.schedule_policy import SchedulePolicy
        from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import (
            NewTokenRatioTracker,
        )
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

        self.torch = torch
        self.engine = engine
        self.ps = args.block_size
        self.cache = make_cache(engine, self.ps, args.num_blocks)
        self.alloc = self.cache.token_to_kv_pool_allocator
        self.capacity = args.num_blocks * self.ps
        longest = max(r.num_prompt_tokens + r.output_len for r in requests) + 1
        self.req_pool = ReqToTokenPool(args.max_running, -(-longest // self.ps) * self.ps,
                                       "cpu", False)
        self.cache.req_to_token_pool = self.req_pool
        self.policy = SchedulePolicy(args.schedule_policy, self.cache, False, False, False)
        self.ratio = NewTokenRatioTracker.from_config()
        self.batch = ScheduleBatch(reqs=[])  # the running (decoding) requests
        self.chunked: Any = None  # the request whose prompt is being prefilled in chunks
        self.args = args
        self.requests = requests
        self.pending = deque(requests)
        self.waiting: list[Any] = []
        self.hit_tokens = self.prompt_tokens = self.retractions = self.evicted = 0
        self.refused = self.aborted = self.finished = 0
        self._count_evictions()

    def _count_evictions(self) -> None:
        """Count the tokens every eviction frees (SGLang's allocator and the replay both evict
        through the cache's ``evict``)."""
        evict = self.cache.evict

        def counted(params: Any) -> Any:
            result = evict(params)
            self.evicted += result.num_tokens_evicted
            return result

        self.cache.evict = counted

    def _req(self, tr: TraceRequest) -> Any:
        """SGLang's ``Req`` for a trace request, its ``max_new_tokens`` bounded as SGLang's
        scheduler bounds it on arrival (``init_req_max_new_tokens``: the request length cap and
        the allocator's ``max_new_tokens_for_memory`` over the pool); ``None`` when the prompt
        cannot fit the pool (SGLang aborts it)."""
        from array import array

        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        input_len = tr.num_prompt_tokens
        max_req_len = self.capacity - 1  # no model: the pool bounds a request's length
        if input_len >= max_req_len - 5:  # SGLang's validate_input_length, no auto-truncate
            return None
        max_new = max(0, min(max(tr.output_len, 1), max_req_len - input_len - 1))
        max_new = self.alloc.max_new_tokens_for_memory(
            input_len, max_new, token_capacity=self.capacity, sliding_window_size=None,
            chunk_size=self.args.chunk_size)
        if max_new is None:
            return None
        req = Req(tr.request_id, "", array("q", tr.prompt_token_ids()),
                  SamplingParams(max_new_tokens=max_new))
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
                self.cache.evict(self._evict_params(short))
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

    def busy(self) -> bool:
        """Whether a request is still queued, waiting, running or being prefilled."""
        return bool(self.pending or self.waiting or self.batch.reqs or self.chunked is not None)

    def step(self) -> list[Any]:
        """One scheduler step (see the module docstring); returns the prefill batch it ran
        (empty for a decode step)."""
        waiting = self.waiting
        while self.pending and len(waiting) < self.args.window:
            req = self._req(self.pending.popleft())
            if req is None:
                self.refused += 1
            else:
                waiting.append(req)
        admitted = self._admit(waiting)
        if admitted:
            self._extend(admitted)
        elif self.batch.reqs:
            self._decode(waiting)
        elif waiting:
            raise RuntimeError(f"{self.engine}: nothing running and PrefillAdder admits none "
                               f"of {len(waiting)} waiting requests")
        return admitted

    def run(self) -> ReplayResult:
        steps = 0
        step_s: list[float] = []
        cpu0 = time.process_time()
        while self.busy():
            t0 = time.perf_counter()
            steps += 1
            self.step()
            step_s.append(time.perf_counter() - t0)
        cpu = time.process_time() - cpu0
        return ReplayResult(
            engine=self.engine,
            hit_rate=self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            hit_tokens=self.hit_tokens, prompt_tokens=self.prompt_tokens,
            evicted_tokens=self.evicted, retractions=self.retractions, steps=steps,
            finished=self.finished, refused=self.refused, aborted=self.aborted,
            step_ms_median=statistics.median(step_s) * 1e3 if step_s else 0.0, cpu_s=cpu)

    # -- admission: SGLang's get_new_batch_prefill ------------------------------------------------
    def _allocatable(self, running_bs: int, held_rows: int) -> int:
        """The requests a prefill may still add (SGLang's ``get_num_allocatable_reqs``: the
        running limit, and the free request rows plus those the counted requests hold)."""
        return min(self.args.max_running - running_bs,
                   max(self.req_pool.available_size() + held_rows, 0))

    def new_adder(self, waiting_len: int) -> Any:
        """SGLang's ``PrefillAdder`` for this step, built with the arguments its scheduler
        passes (no mixed chunk, no priority preemption, no prefill delayer)."""
        from sglang.srt.managers.schedule_policy import PrefillAdder

        return PrefillAdder(self.ps, self.cache, self.alloc, self.batch, self.ratio.current,
                            self.args.max_prefill_tokens, self.args.chunk_size, 0, 0,
                            max_prefill_bs=0, max_running_requests=self.args.max_running,
                            prefill_max_requests=None, waiting_queue_len=waiting_len)

    def _admit(self, waiting: list[Any]) -> list[Any]:
        """One prefill admission, in the order SGLang's ``get_new_batch_prefill`` runs it; returns
        the requests of the prefill batch (``PrefillAdder.can_run_list``) and removes them from
        ``waiting``."""
        from sglang.srt.managers.schedule_policy import AddReqResult

        batch = self.batch
        if batch.is_empty():
            batch.batch_is_full = False
        if (batch.batch_is_full or not waiting) and self.chunked is None:
            return []
        if self._allocatable(len(batch.reqs), 0) <= 0 and self.chunked is None:
            batch.batch_is_full = True
            return []
        self.policy.calc_priority(waiting, batch)
        adder = self.new_adder(len(waiting))
        if self.chunked is not None:
            self.chunked.init_next_round_input()
            adder.chunked_req_limit = self.policy.shortest_prefill_chunk_limit(
                self.chunked, waiting, adder.rem_chunk_tokens or 0, self.ps)
            self.chunked = adder.add_chunked_req(self.chunked)
        for req in waiting:
            if adder.budget_state() == AddReqResult.OTHER:
                break
            held = sum(r.kv.holds_kv for r in adder.can_run_list)
            if len(adder.can_run_list) >= self._allocatable(len(batch.reqs), held):
                batch.batch_is_full = True
            if batch.batch_is_full:
                break
            req.init_next_round_input(self.cache)
            result = adder.add_one_req(req, has_chunked_req=self.chunked is not None,
                                       truncation_align_size=None)
            if result != AddReqResult.CONTINUE:
                if result == AddReqResult.NO_TOKEN:
                    batch.batch_is_full = bool(adder.can_run_list) or not batch.is_empty()
                break
        self.hit_tokens += adder.log_hit_tokens
        self.prompt_tokens += adder.log_hit_tokens + adder.log_input_tokens
        admitted: list[Any] = adder.can_run_list
        if not admitted:
            return []
        chosen = set(map(id, admitted))
        waiting[:] = [r for r in waiting if id(r) not in chosen]
        if adder.new_chunked_req is not None:
            self.chunked = adder.new_chunked_req
        return admitted

    # -- the model's work, without a model ------------------------------------------------------
    def _extend(self, admitted: list[Any]) -> None:
        """Run a prefill batch: allocate each request's row and its chunk's slots (as SGLang's
        ``prepare_for_extend`` does), then what SGLang does with the result: a chunk that ends
        the prompt yields the first output token; a finished request is released with a
        checkpoint, an unfinished one checkpointed (the chunked one too: SGLang's stash)."""
        from sglang.srt.mem_cache.common import checkpoint_kv_cache

        for req in admitted:
            if not req.kv.holds_kv:
                self.req_pool.alloc([req])
                prefix = self.cache.prefix_device_indices(req)
                self.req_pool.write((req.kv.req_pool_idx, slice(0, req.prefix_len)), prefix)
                req.kv.kv_allocated_len = req.kv.kv_committed_len = req.prefix_len
            n = req.extend_end - req.kv.kv_committed_len
            if n > 0 and not self._grow(req, n):
                raise RuntimeError(f"{self.engine}: PrefillAdder admitted {req.rid} but its "
                                   f"{n} tokens do not fit the pool")
        for req in admitted:
            if req is self.chunked:
                checkpoint_kv_cache(req, self.cache)
                continue
            self._emit(req)
            if not self._finish_if_done(req):
                checkpoint_kv_cache(req, self.cache)
                self.batch.reqs.append(req)

    def _emit(self, req: Any) -> None:
        """The request's next output token (a fixed function of the request and position)."""
        req.output_ids.append(1 + (len(req.output_ids) * 7919 + zlib.crc32(req.rid.encode()))
                              % 30000)

    def _finish_if_done(self, req: Any) -> bool:
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH
        from sglang.srt.mem_cache.common import release_kv_cache

        if len(req.output_ids) < max(req.sampling_params.max_new_tokens, 1):
            return False
        req.finished_reason = FINISH_LENGTH(len(req.output_ids))
        release_kv_cache(req, self.cache, checkpoint=True)
        self.finished += 1
        return True

    def _decode_fits(self, reqs: list[Any]) -> bool:
        """SGLang's ``check_decode_mem``: a new page for every request at a page boundary,
        evicting what is short (the allocator's ``check_decode_capacity``)."""
        ps = self.ps
        need = ps * sum(1 for r in reqs if r.kv.kv_committed_len % ps == 0)
        fits: bool = self.alloc.check_decode_capacity(num_tokens=need, tree_cache=self.cache)
        return fits

    def _decode(self, waiting: list[Any]) -> None:
        """One decode step (SGLang's ``update_running_batch``): retract in SGLang's order while
        the step does not fit (``retract_decode``; the ratio then re-estimated from the rest),
        else decay the new-token ratio; then one token for every running request, releasing the
        finished ones."""
        from sglang.srt.managers.schedule_batch import ScheduleBatch, release_req
        from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import (
            NewTokenRatioTracker,
        )
        from sglang.srt.mem_cache.common import release_kv_cache

        batch = self.batch
        reqs = batch.reqs
        if not self._decode_fits(reqs):
            order = ScheduleBatch._get_decode_retraction_order(reqs)
            retracted: list[Any] = []
            first = True
            while first or not self._decode_fits([reqs[i] for i in order]):
                if len(order) == 1:
                    break
                first = False
                victim = reqs[order.pop()]
                release_req(req=victim, remaing_req_count=len(order),
                            req_to_token_pool=self.req_pool, token_to_kv_pool_allocator=self.alloc,
                            tree_cache=self.cache, hisparse_coordinator=None)
                retracted.append(victim)
            if len(order) <= 1 and not self._decode_fits([reqs[i] for i in order]):
                last = reqs[order.pop()]  # SGLang aborts the last request that cannot fit
                release_kv_cache(last, self.cache, checkpoint=False)
                self.aborted += 1
            batch.reqs = [reqs[i] for i in order]
            self.ratio.current = NewTokenRatioTracker.estimate_new_token_ratio_after_retract(
                batch.reqs)
            self.retractions += len(retracted)
            waiting.extend(retracted)
            batch.batch_is_full = False
        else:
            self.ratio.decay_step()
        done = False
        for req in batch.reqs:
            if not self._grow(req, 1):
                raise RuntimeError(f"{self.engine}: the decode step of {req.rid} does not fit "
                                   "after SGLang's capacity check")
            self._emit(req)
            req.refresh_fill_ids()
            done = self._finish_if_done(req) or done
        if done:
            batch.reqs = [r for r in batch.reqs if not r.finished()]
            batch.batch_is_full = False


def replay(requests: Sequence[TraceRequest], engines: Sequence[str],
           args: argparse.Namespace) -> list[ReplayResult]:
    """Every engine through ``requests``, one after the other."""
    _publish_context()
    return [Replay(engine, requests, args).run() for engine in engines]


def _load(source: str, limit: int) -> list[TraceRequest]:
    import os

    from kvcore.sim.traces import load_mooncake
    from kvcore.sim.workloads import make_workload

    requests = load_mooncake(source) if os.path.exists(source) else make_workload(source)
    return requests[:limit] if limit else requests


def parser() -> argparse.ArgumentParser:
    """The command line (its namespace is what :class:`Replay` reads)."""
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
    ap.add_argument("--max-prefill-tokens", type=int, default=16384,
                    help="SGLang's --max-prefill-tokens (PrefillAdder's input budget per step)")
    ap.add_argument("--max-running", type=int, default=64,
                    help="SGLang's --max-running-requests (and request rows)")
    ap.add_argument("--window", type=int, default=128,
                    help="requests visible to the schedule policy at once")
    ap.add_argument("--max-requests", type=int, default=0, help="replay only the first N")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    for name in ("block_size", "num_blocks", "chunk_size", "max_prefill_tokens", "max_running",
                 "window"):
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
    if any(r.refused or r.aborted for r in results):
        print("refused (prompt larger than the pool) / aborted: "
              + ", ".join(f"{r.engine} {r.refused}/{r.aborted}" for r in results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
