"""A reference continuous-batching scheduler over :class:`~kvcore.manager.KVCacheManager`.

Engine-agnostic: it decides which requests run each step and how many tokens each computes; the
engine runs the model and reports the sampled tokens back.  One step::

    out = scheduler.schedule()                   # who runs, how many tokens, block tables
    sampled = engine.run(out)                    # {request_id: token} for requests that sample
    finished = scheduler.update_from_output(out, sampled)

Policy (vLLM v1's): running requests are served first, in admission order, each taking as many
tokens as the step's budget allows (decodes take 1; a prefill is split into chunks across steps
and mixed with decodes).  When the KV cache is full the most recently admitted running request is
preempted by recompute: its blocks are freed — they stay in the prefix cache, so re-admission
mostly hits — and it goes back to the front of the waiting queue.  Waiting requests are admitted
in steps that preempted nobody, while the budget and ``max_num_seqs`` allow, in arrival order or
``SchedulerConfig.schedule_policy``'s (:mod:`kvcore.scheduler.admission`; queue hints follow it).  A
request that could never fit is rejected at ``add_request`` (``RequestRejectedError``).  An
encoder-decoder model's request carries its encoder token count (``Request.num_encoder_tokens``):
its cross-attention blocks are allocated at each admission.

With a KV connector (:mod:`kvcore.connector`, e.g. a host-memory tier), admission also asks it for
tokens beyond the device prefix hit (``get_num_new_matched_tokens``); they are allocated as
external computed tokens.  An asynchronous load parks the request (``WAITING_FOR_REMOTE_KVS``,
holding its blocks, not cached yet) while the batch goes on; when the engine reports the load
finished (``update_from_output(..., kv_connector_output)``) its blocks are cached and it is
scheduled first.  A failed load (its device block ids in ``invalid_block_ids``) falls back to
recomputing: an asynchronous one re-admits the request (its device hit still cached), a
synchronous one sets the running request back to the first block that was not loaded where
every group can go on from there, and otherwise starts it over (a sliding window or chunk
released what it would read, a Mamba state exists only for its latest position); requests that
hit what the load was to write are set back too.  A request id is free again once the
connector has reported every transfer of the request that used it.  Each step's
``kv_connector_metadata`` tells the engine's worker-side connector what to copy.

Async scheduling (``SchedulerConfig(async_scheduling=True)``, vLLM's ``--async-scheduling``):
the engine schedules step N+1 while the device still runs step N, so it calls ``schedule()``
before ``update_from_output`` of the previous step.  Every token a scheduled step will sample is
counted in ``request.num_output_placeholders`` until it is reported; a running request's next
position is then the in-flight token, whose id the engine takes from the previous step's
sampled tokens on the device (``ScheduledRequest.token_ids`` lists only the known ones).  At
most one step may be in flight: report step N before scheduling step N+2.  A request is not
scheduled past ``max_tokens`` or ``max_model_len`` counting its placeholders; one that stops on
EOS or a stop token has one extra step already scheduled, whose token is dropped.  A request
preempted while its step is in flight still receives that token (it was computed from the
request's own KV), and finishes in the waiting queue if the token stops it.  ``fail_step`` of
a step in flight after the next one was scheduled drops from the prefix cache the blocks that
step allocated and the blocks of requests preempted meanwhile, and gives up their in-flight
tokens; fail the next step too (it may hit those blocks).  That includes a block an earlier
step filled partly, the failed step completed (hashing it) and the next ``schedule()`` released
because a sliding window left it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from itertools import islice

from kvcore.connector.base import KVConnectorBase, KVConnectorOutput
from kvcore.errors import InvalidArgumentError, UnknownRequestError, UnsupportedFeatureError
from kvcore.events import KVCacheEvent
from kvcore.manager import KVCacheManager
from kvcore.request import Request, RequestStatus
from kvcore.scheduler.admission import WaitingOrder, hint_key
from kvcore.scheduler.types import (
    RequestRejectedError,
    ScheduledRequest,
    SchedulerConfig,
    SchedulerOutput,
    SchedulerStats,
)


def holds_place(req: Request) -> bool:
    """Holds KV or a token in flight: keeps its place at the head of the waiting queue."""
    return (req.status is not RequestStatus.WAITING or req.num_computed_tokens > 0
            or req.num_output_placeholders > 0)


class Scheduler:
    """Continuous batching with chunked prefill and recompute preemption (see module doc)."""

    def __init__(self, kv_cache_manager: KVCacheManager,
                 config: SchedulerConfig | None = None,
                 connector: KVConnectorBase | None = None) -> None:
        self.kv = kv_cache_manager
        self.config = config or SchedulerConfig()
        # Waiting requests to declare every step (declare_upcoming): the cache's setting.
        self.queue_hints = kv_cache_manager.settings.queue_hints
        self.connector = connector
        self.max_model_len = kv_cache_manager.max_model_len
        if (not self.config.enable_chunked_prefill
                and self.config.max_num_batched_tokens < self.max_model_len):
            # A (re-)prefill longer than one step's budget could never be scheduled.
            raise InvalidArgumentError(
                "without chunked prefill, max_num_batched_tokens "
                f"({self.config.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len})")
        if self.config.async_scheduling and connector is not None:
            raise InvalidArgumentError("async_scheduling is not supported with a KV connector")
        # Encoder-decoder models: groups sized by the request's encoder tokens.
        self._reads_encoder = any(g.spec.reads_encoder for g in kv_cache_manager.config.groups)
        replay = kv_cache_manager.config.prefix_replay_tokens
        if replay and kv_cache_manager.enable_caching:
            # Its groups would get fresh blocks for hit tokens nobody recomputes.
            raise UnsupportedFeatureError(
                f"kvcore's Scheduler does not replay prefix hits ({replay} tokens of bounded "
                "replay): run this model inside vLLM's scheduler "
                "(kvcore.integrations.vllm), or with enable_caching=False")
        self.waiting: deque[Request] = deque()
        self._order: WaitingOrder[Request] = WaitingOrder(  # admission order
            self.config, lambda req: kv_cache_manager.get_computed_blocks(req)[1], holds_place)
        self.running: list[Request] = []
        self.loading: dict[str, Request] = {}  # WAITING_FOR_REMOTE_KVS
        self._load_target: dict[str, int] = {}  # their computed tokens once the load is done
        # Loading requests that hit a block whose load failed: their device hit tokens (they
        # start over once their own load is reported).
        self._load_failed: dict[str, int] = {}
        # Finished requests whose blocks the connector still reads (stores) or writes (loads).
        self._delayed_free: dict[str, Request] = {}
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        self._finished_ids: list[str] = []
        self._usable_blocks = kv_cache_manager.config.num_blocks - 1
        self._declared: tuple[tuple[int, object, bool], ...] = ()  # what the last hints covered
        # Async scheduling: the blocks of requests preempted while a step of theirs was in
        # flight, until its token is reported (or the step fails: then they leave the cache).
        self._preempted_in_flight: dict[str, list[int]] = {}
        self._last_scheduled: frozenset[str] = frozenset()  # (async) the previous step's ids
        # (async) step -> the partly filled blocks it completes, for the last two steps: the
        # next schedule() may slide a window past one (freeing it, hash and all) before the
        # step is reported or failed.
        self._partial_blocks: dict[int, list[int]] = {}

    # -- requests -------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request; raises :class:`RequestRejectedError` if it can never be served."""
        self.add_requests((request,))

    def add_requests(self, requests: Iterable[Request]) -> None:
        """Queue several requests atomically: if any of them is invalid or can never be served,
        raise (naming it) and queue none of them."""
        batch = list(requests)
        seen: set[str] = set()
        for request in batch:
            self._check_new_request(request, seen)
            seen.add(request.request_id)
        for request in batch:
            request.status = RequestStatus.WAITING
            self.requests[request.request_id] = request
            self.waiting.append(request)

    def _check_new_request(self, request: Request, batch_ids: set[str]) -> None:
        if not isinstance(request, Request):
            raise InvalidArgumentError(
                f"add_request expects a kvcore Request, got {type(request).__name__}")
        rid = request.request_id
        if rid in self.requests or rid in batch_ids:
            raise InvalidArgumentError(f"request {rid!r} is already in the scheduler")
        if rid in self._delayed_free:
            # Its connector reports the transfer by id: a new request under it would be taken
            # for the old one (its load or store would release the new request's blocks).
            raise InvalidArgumentError(
                f"request {rid!r} has finished, but the KV connector still transfers its blocks: "
                "its id can be used again once the transfer is reported finished")
        if request.status.is_finished or request.num_computed_tokens:
            raise InvalidArgumentError(
                f"request {rid!r} is not new (status {request.status.value}, "
                f"{request.num_computed_tokens} computed tokens)")
        if bool(request.num_encoder_tokens) != self._reads_encoder:
            raise InvalidArgumentError(
                f"request {rid!r} has num_encoder_tokens={request.num_encoder_tokens}, but the "
                + ("model's cross-attention layers read the encoder output: give each request "
                   "its encoder token count" if self._reads_encoder else
                   "model has no cross-attention layer to read them"))
        if request.num_tokens >= self.max_model_len:
            raise RequestRejectedError(
                f"request {rid!r}: prompt of {request.num_tokens} tokens leaves no room to "
                f"generate within max_model_len={self.max_model_len}")
        need = self.blocks_needed(request)
        if need > self._usable_blocks:
            raise RequestRejectedError(
                f"request {rid!r} needs up to {need} KV-cache blocks at once; the pool has "
                f"{self._usable_blocks}")

    def blocks_needed(self, request: Request) -> int:
        """Peak blocks the request holds at once if it runs to completion alone."""
        final = self.max_model_len if request.max_tokens is None else min(
            request.num_prompt_tokens + request.max_tokens, self.max_model_len)
        step = self.config.max_num_batched_tokens
        encoder = request.num_encoder_tokens
        return sum(-(-encoder // g.spec.block_size) if g.spec.reads_encoder
                   else g.spec.max_blocks_per_request(final, step)
                   for g in self.kv.config.groups)

    def abort_request(self, request_id: str) -> None:
        """Finish a waiting or running request as aborted, releasing its blocks."""
        request = self.requests.get(request_id)
        if request is None:
            raise UnknownRequestError(f"request {request_id!r} is not in the scheduler")
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self._release(request)
        elif request.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
            # A load is writing into its blocks: they are freed once it is reported finished.
            del self.loading[request_id]
            self._load_target.pop(request_id, None)
            self._load_failed.pop(request_id, None)
            if self.connector is not None:
                self.connector.request_finished(request, self.kv.get_block_ids(request_id))
            self._delayed_free[request_id] = request
        else:
            self.waiting.remove(request)
            if request.num_computed_tokens:  # loaded, not rescheduled yet: it holds blocks
                self._release(request)
        self._finish(request, RequestStatus.FINISHED_ABORTED)

    def fail_step(self, output: SchedulerOutput) -> list[Request]:
        """The engine could not execute ``output`` (an exception in the forward pass, the
        sampler, ...): none of its KV was written.

        The blocks that step was to fill leave the prefix cache, so no later hit can serve KV
        that was never computed, and every request it scheduled that is still running is
        aborted (its blocks freed).  Returns the aborted requests.
        """
        if self.connector is not None:  # its transfers never ran either (first: then no
            # aborted request waits for a store that will never be reported)
            self._apply_connector_output(
                self.connector.failed_step_output(output.kv_connector_metadata), output)
        if self.config.async_scheduling:
            self._fail_in_flight(output)
        failed = [s for s in output.scheduled if s.request.status is RequestStatus.RUNNING]
        for s in failed:
            self.kv.uncache_blocks(s.request, s.num_computed_tokens)
        for s in failed:
            self.abort_request(s.request_id)
        return [s.request for s in failed]

    def take_events(self) -> list[KVCacheEvent]:
        """The KV events since the last call: the device cache's, then the connector's (e.g. a
        host tier's, ``medium="CPU"``), as one batch for a publisher."""
        events = self.kv.take_events()
        if self.connector is not None:
            events.extend(self.connector.take_events())
        return events

    def _fail_in_flight(self, output: SchedulerOutput) -> None:
        """Async scheduling: ``output`` may have been followed by another ``schedule()`` that
        moved its requests on (preempted them, slid windows past blocks): drop from the prefix
        cache the blocks it allocated, the partly filled ones it completed, and those of its
        requests preempted since, and give up the tokens it was to sample for requests that are
        not aborted here."""
        kv = self.kv
        stale = self._partial_blocks.pop(output.step, [])
        for s in output.scheduled:
            req = s.request
            for ids in s.new_block_ids:
                stale.extend(ids)
            held = self._preempted_in_flight.pop(s.request_id, None)
            if held is not None:
                stale.extend(held)
            if s.samples and req.status is RequestStatus.PREEMPTED:
                req.num_output_placeholders -= 1  # that token will never be reported
        if stale:
            kv.evict_blocks([b for b in stale if b != 0])  # block 0: the null block, never cached

    def has_unfinished_requests(self) -> bool:
        """Waiting, running or loading requests, or finished ones a transfer still holds."""
        return bool(self.waiting or self.running or self.loading or self._delayed_free)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # -- one step -------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Choose this step's requests and token counts, allocating their KV slots."""
        kv = self.kv
        kv.new_step()
        self._order.reorder(self.waiting, self.stats.steps)  # fresh requests; hints follow it
        if self.queue_hints:
            self._declare_upcoming()
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        budget = self._schedule_running(budget, scheduled, preempted)
        if not preempted:
            budget = self._schedule_waiting(budget, scheduled)
        for s in scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
        self.stats.steps += 1
        if self.config.async_scheduling:
            partial: list[int] = []
            for s in scheduled:
                if s.samples:
                    s.request.num_output_placeholders += 1
                partial += kv.get_partial_block_ids(s.request_id, s.num_computed_tokens)
            self._last_scheduled = frozenset(s.request_id for s in scheduled)
            self._partial_blocks = {step: ids for step, ids in self._partial_blocks.items()
                                    if step == self.stats.steps - 1}
            self._partial_blocks[self.stats.steps] = partial
        num_tokens = self.config.max_num_batched_tokens - budget
        self.stats.scheduled_tokens += num_tokens
        finished, self._finished_ids = self._finished_ids, []
        out = SchedulerOutput(scheduled, preempted, finished, num_tokens, self.stats.steps)
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        return out

    def _declare_upcoming(self) -> None:
        """Hint the manager with the head of the waiting queue (only when it changed)."""
        head = list(islice(self.waiting, self.queue_hints))
        key = hint_key(head)
        if key != self._declared:
            self.kv.declare_upcoming(head)
            self._declared = key

    def _schedule_running(self, budget: int, scheduled: list[ScheduledRequest],
                          preempted: list[str]) -> int:
        """Give running requests, in admission order, their next tokens within ``budget``,
        preempting the newest running requests while the cache is full.  Appends to
        ``scheduled`` and ``preempted``; returns the budget left."""
        kv = self.kv
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            pending = req.num_output_placeholders
            if pending and (req.num_tokens + pending >= self.max_model_len or (
                    req.max_tokens is not None
                    and req.num_output_tokens + pending >= req.max_tokens)):
                i += 1  # its last token is in flight: it finishes when that is reported
                continue
            num_new = min(req.num_tokens + pending - req.num_computed_tokens, budget,
                          self.max_model_len - req.num_computed_tokens)
            if num_new <= 0:
                i += 1
                continue
            new_blocks = kv.allocate_slots(req, num_new)
            while new_blocks is None:
                victim = running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
                new_blocks = kv.allocate_slots(req, num_new)
            if new_blocks is None:
                break
            scheduled.append(ScheduledRequest(kv, req, req.num_computed_tokens, num_new,
                                              new_blocks.get_block_ids(), False))
            budget -= num_new
            i += 1
        return budget

    def _schedule_waiting(self, budget: int, scheduled: list[ScheduledRequest]) -> int:
        """Admit waiting requests in the queue's order (prefix hits first) while the budget
        and ``max_num_seqs`` allow; a request that cannot fit even alone with an empty cache is
        rejected.  Appends to ``scheduled``; returns the budget left."""
        kv = self.kv
        cfg = self.config
        waiting = self.waiting
        connector = self.connector
        while waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = waiting[0]
            if req.num_output_placeholders:  # preempted with its token in flight: admit it
                break  # once that is reported (its KV is recomputed with it)
            if req.num_computed_tokens:  # its KV was loaded by the connector: blocks held
                num_new = req.num_tokens - req.num_computed_tokens
                if num_new > budget and not cfg.enable_chunked_prefill:
                    break
                num_new = min(num_new, budget)
                if kv.allocate_slots(req, num_new) is None:
                    if self._drop_loaded(req, scheduled):
                        continue  # retry with the room made
                    break
                waiting.popleft()
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                scheduled.append(ScheduledRequest(kv, req, req.num_computed_tokens, num_new,
                                                  kv.get_block_ids(req.request_id), False))
                budget -= num_new
                continue
            hits, num_hit = kv.get_computed_blocks(req)
            num_external, load_async = 0, False
            if connector is not None:
                matched, load_async = connector.get_num_new_matched_tokens(req, num_hit)
                if matched is None:  # the connector does not know yet: keep the order
                    break
                # The last token is always computed (its logits are sampled), as vLLM's
                # connectors promise: a connector that offers it too is held to the rest.
                num_external = min(matched, max(req.num_tokens - num_hit - 1, 0))
                load_async = load_async and num_external > 0
            num_computed = num_hit + num_external
            num_new = 0 if load_async else req.num_tokens - num_computed
            if num_new > budget and not cfg.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            new_blocks = kv.allocate_slots(req, num_new, num_hit, hits,
                                           num_external_computed_tokens=num_external,
                                           delay_cache_blocks=load_async,
                                           num_encoder_tokens=req.num_encoder_tokens,
                                           full_sequence_must_fit=cfg.full_sequence_must_fit)
            if new_blocks is None:
                if self._drop_loaded(req, scheduled):
                    continue  # retry with the room made
                if not self.running and not scheduled and kv.num_free_blocks == self._usable_blocks:
                    # Alone with an empty cache and still no room: it never will fit.
                    waiting.popleft()
                    self._finish(req, RequestStatus.FINISHED_REJECTED)
                    continue
                break
            waiting.popleft()
            kv.record_prefix_cache_stats(req, num_hit)  # once per admission, as vLLM
            if connector is not None:
                connector.update_state_after_alloc(req, kv.get_blocks(req.request_id),
                                                   num_external)
            self.stats.prefix_hit_tokens += num_hit
            self.stats.external_hit_tokens += num_external
            if load_async:  # computed only once the load is reported done
                req.num_computed_tokens = req.num_cached_tokens = num_hit
                req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                self.loading[req.request_id] = req
                self._load_target[req.request_id] = num_computed
                continue
            req.num_computed_tokens = num_computed
            req.num_cached_tokens = num_computed
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append(ScheduledRequest(kv, req, num_computed, num_new,
                                              new_blocks.get_block_ids(), True))
            budget -= num_new
        return budget

    def update_from_output(self, output: SchedulerOutput,
                           sampled_token_ids: Mapping[str, int] | Sequence[int],
                           kv_connector_output: KVConnectorOutput | None = None) -> list[Request]:
        """Append each sampling request's new token and apply stop conditions.

        ``sampled_token_ids`` maps request id to token, or lists tokens in the order of the
        output's sampling requests.  ``kv_connector_output`` is what the worker-side connector
        reported after the step (finished loads and stores, failed loads).  Returns the
        requests that finished this step (their blocks are already freed, or held until the
        connector's stores of them complete).
        """
        sampling = [s for s in output.scheduled if s.samples]
        if isinstance(sampled_token_ids, Mapping):
            tokens = sampled_token_ids
        else:
            if len(sampled_token_ids) != len(sampling):
                raise InvalidArgumentError(
                    f"{len(sampled_token_ids)} sampled tokens for {len(sampling)} sampling requests")
            tokens = {s.request_id: t for s, t in zip(sampling, sampled_token_ids)}
        # Check everything before changing anything: a bad token leaves every request as it was.
        # Requests finished or aborted since they were scheduled are skipped; one preempted
        # meanwhile (async scheduling) still takes its token.
        placeholders = self.config.async_scheduling
        live = [s.request for s in sampling if s.request.status is RequestStatus.RUNNING
                or (placeholders and s.request.status is RequestStatus.PREEMPTED)]
        for req in live:
            rid = req.request_id
            if rid not in tokens:
                raise InvalidArgumentError(f"no sampled token for request {rid!r}")
            token = tokens[rid]
            if token.__class__ is not int or not 0 <= token < 1 << 32:
                raise InvalidArgumentError(
                    f"sampled token for request {rid!r} must be an int in [0, 2**32), "
                    f"got {token!r}")
            if placeholders and req.num_output_placeholders <= 0:
                raise InvalidArgumentError(
                    f"request {rid!r} has no token in flight (was this step reported twice?)")
        if kv_connector_output is not None and kv_connector_output.invalid_block_ids:
            num_blocks = self.kv.config.num_blocks
            wrong = [b for b in kv_connector_output.invalid_block_ids
                     if type(b) is not int or not 0 < b < num_blocks]
            if wrong:
                raise InvalidArgumentError(
                    f"invalid_block_ids holds {wrong!r}: not block ids of this pool (1 to "
                    f"{num_blocks - 1})")
        if kv_connector_output is not None and self.connector is not None:
            recomputing = self._apply_connector_output(kv_connector_output, output)
            live = [r for r in live if r.request_id not in recomputing]
        if placeholders:  # this step is done: its KV is written
            self._partial_blocks.pop(output.step, None)
        if placeholders and self._preempted_in_flight:
            for s in output.scheduled:
                self._preempted_in_flight.pop(s.request_id, None)
        finished: list[Request] = []
        for req in live:
            token = tokens[req.request_id]
            if placeholders:
                req.num_output_placeholders -= 1
            req.append_output_token_ids(token)
            reason = self._stop_reason(req, token)
            if reason is not None:
                if req.status is RequestStatus.RUNNING:
                    self.running.remove(req)
                    self._release(req, retain=self.config.retain_sessions
                                  and req.session_id is not None)
                else:  # preempted while its step was in flight: its blocks are already free
                    self.waiting.remove(req)
                self._finish(req, reason)
                finished.append(req)
        return finished

    def _release(self, req: Request, retain: bool = False) -> None:
        """Free a finished request's blocks, or hold them while the connector still copies
        them (``request_finished`` → delay_free)."""
        if self.connector is not None:
            delay, _ = self.connector.request_finished(req, self.kv.get_block_ids(req.request_id))
            if delay:
                self._delayed_free[req.request_id] = req
                return
        if retain:
            self.kv.free(req, retain=True)
        else:  # a manager subclass may override free(request) without the hint
            self.kv.free(req)

    # -- helpers --------------------------------------------------------------------------------
    def _stop_reason(self, req: Request, token: int) -> RequestStatus | None:
        if not req.ignore_eos and token == req.eos_token_id:
            return RequestStatus.FINISHED_STOPPED
        if token in req.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if req.max_tokens is not None and req.num_output_tokens >= req.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _preempt(self, req: Request) -> None:
        if req.request_id in self._last_scheduled:  # a step of its in flight: _fail_in_flight
            self._preempted_in_flight[req.request_id] = [
                b for ids in self.kv.get_block_ids(req.request_id) for b in ids]
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(req)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        req.num_output_placeholders = 0  # a step still in flight for it is dropped
        self._preempted_in_flight.pop(req.request_id, None)
        del self.requests[req.request_id]
        self._finished_ids.append(req.request_id)
        self.stats.num_finished += 1
        if status is RequestStatus.FINISHED_REJECTED:
            self.stats.num_rejected += 1
        self.stats.finish_reasons[status.value] = self.stats.finish_reasons.get(status.value, 0) + 1

    # -- the connector's side -------------------------------------------------------------------
    # Applying what the workers report (finished loads and stores, failed loads) and keeping
    # loaded requests from blocking admission forever.
    def _apply_connector_output(self, out: KVConnectorOutput, step: SchedulerOutput) -> set[str]:
        """Apply what the workers finished after ``step``; returns the running requests whose
        KV a failed synchronous load left unwritten (they recompute it: no token is taken from
        this step)."""
        assert self.connector is not None
        self.connector.update_connector_output(out)
        failed = out.invalid_block_ids
        kv = self.kv
        # Deterministic orders (the output holds sets): loads in admission order, resumed
        # requests back at the front of the queue in that order; frees in finishing order.
        recving = out.finished_recving
        resumed: list[Request] = []
        for rid in [r for r in self.loading if r in recving]:
            req = self.loading.pop(rid)
            target = self._load_target.pop(rid)
            hit = self._load_failed.pop(rid, None)  # a block of its hit failed earlier
            if hit is None and failed and kv.first_token_in(rid, failed) is not None:
                hit = req.num_computed_tokens
            if hit is not None:
                # Start over: its device hit is still cached (admission hits it again), the
                # blocks the load was to fill were never cached.
                self.stats.load_failures += 1
                self.stats.external_hit_tokens -= target - hit
                kv.free(req)
                req.num_computed_tokens = req.num_cached_tokens = 0
            else:  # (computed first: a checked manager checks its table at the call)
                req.num_computed_tokens = req.num_cached_tokens = target
                kv.cache_blocks(req, target)
            req.status = RequestStatus.WAITING
            resumed.append(req)
        self.waiting.extendleft(reversed(resumed))
        # Finished requests whose loads (aborted) or stores completed.
        for rid in [r for r in self._delayed_free
                    if r in out.finished_sending or r in recving]:
            kv.free(self._delayed_free.pop(rid))
        recomputing: set[str] = set()
        if failed:
            recomputing = self._recompute_failed(failed, step)
        return recomputing

    def _recompute_failed(self, failed: set[int], step: SchedulerOutput) -> set[str]:
        """No request counts as computed a token whose KV a load failed to write (the blocks
        ``failed``) or that ``step`` computed from such KV, and none of those blocks stays in the
        prefix cache.  From the first such token on, a running request goes on where every group
        can (``KVCacheManager.can_resume``) with blocks of its own, else it starts over
        (freed, back at the front of the queue like a preempted request: its valid prefix,
        loaded blocks included, stays cached); a loaded request not rescheduled yet starts over;
        one still loading (it hit such a block) starts over once its load is reported.  Returns
        the running requests affected (no token is taken from them this step)."""
        kv = self.kv
        sizes = [g.spec.block_size for g in kv.config.groups]
        step_start = {s.request_id: s.num_computed_tokens for s in step.scheduled}
        bad = set(failed)  # grows by what affected requests computed in the step
        recomputing: set[str] = set()
        pending = [*self.running, *(r for r in self.waiting if r.num_computed_tokens),
                   *self.loading.values()]
        found = True
        while found:  # until no request holds a bad block (a hit on one computed in the step)
            found = False
            for req in list(pending):
                rid = req.request_id
                start = kv.first_token_in(rid, bad)
                if start is None or start >= req.num_computed_tokens:
                    continue
                pending.remove(req)
                found = True
                self.stats.load_failures += 1
                if req.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                    self._load_failed[rid] = req.num_computed_tokens
                    req.num_computed_tokens = 0  # nothing of it counts: it starts over
                    continue
                if req.status is not RequestStatus.RUNNING:  # loaded, not rescheduled yet
                    kv.free(req)
                    req.num_computed_tokens = req.num_cached_tokens = 0
                    continue
                recomputing.add(rid)
                tables = kv.get_blocks(rid)
                # In place when its tables allow it and the blocks rewritten from ``start`` on
                # are its own (one another request holds would be recomputed by both, and
                # cached again for one of them only).
                resume = kv.can_resume(rid, start) and all(
                    b.ref_cnt == 1 for bs, blocks in zip(sizes, tables) for b in blocks[start // bs:])
                # Unwritten from here on: in place, all from ``start`` (rewritten); starting
                # over, what the step computed (its loaded blocks are right, failed ones aside).
                drop = start if resume else max(start, step_start.get(rid, start))
                bad.update(b.block_id for bs, blocks in zip(sizes, tables)
                           for b in blocks[drop // bs:] if not b.is_null)
                kv.uncache_blocks(req, drop)
                if resume:
                    req.num_computed_tokens = start
                else:
                    self.running.remove(req)
                    self._preempt(req)
        # The failed blocks themselves, whoever held them (a request aborted since its load).
        kv.evict_blocks(failed)
        return recomputing

    def _drop_loaded(self, req: Request, scheduled: list[ScheduledRequest]) -> bool:
        """Loaded requests waiting behind ``req`` hold blocks; while nothing runs nothing else
        would ever free one, so ``req`` could wait forever.  Then the newest of them loses its
        blocks (their KV stays in the prefix cache: it is re-admitted like a preempted request)
        and this returns True (retry ``req``); otherwise False."""
        if self.running or scheduled:
            return False  # running requests will finish or be preempted
        for victim in reversed(self.waiting):
            if victim is not req and victim.num_computed_tokens:
                self.kv.free(victim)
                victim.num_computed_tokens = 0
                victim.num_preemptions += 1
                self.stats.num_preemptions += 1
                return True
        return False
