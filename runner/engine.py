"""``LLM``: a paged-attention engine on kvcore, in the shape of nano-vllm.

    llm = LLM(model_dir_or_hf_config, backend="torch", block_size=16, ...)
    outputs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=32))

Each step: ``kvcore.scheduler.Scheduler`` picks requests and token counts (chunked prefill mixed
with decodes, prefix hits, recompute preemption), :mod:`runner.batch` turns that into model
inputs, the :class:`~runner.model_runner.ModelRunner` runs the model over paged KV memory, the
:class:`~runner.sampler.Sampler` picks tokens, and the scheduler applies stop conditions.

Tensor parallelism (:mod:`runner.ranks`): ranks 1..N-1 are spawned processes that build their
shard of the model and then run every forward whose inputs rank 0 (this process) broadcasts;
NCCL on GPU, gloo on CPU.  One tensor-parallel engine per process (torch.distributed's default
group is per process).  On the CPU the engine picks torch's thread count (:mod:`runner.threads`).

Host/device synchronisation (CUDA; one wait per step):

* The step's inputs are built in pinned host buffers (two, used in turn) and reach the GPU in
  one ``non_blocking`` copy (:class:`runner.batch.BatchBuilder`); block tables are append-only
  per request, so a decode step does not re-read the manager's tables.
* The forward never waits for the GPU (no ``.item()``/``.tolist()``/``.cpu()`` in the model,
  the attention backends' per-step schedules are built on the host from host lists).  Decode-only
  steps replay CUDA graphs (:mod:`runner.model_runner`).
* The sampler (:mod:`runner.sampler`) works on the device; its per-row parameters take one more
  small ``non_blocking`` copy (none when every request samples alike).  The sampled token ids
  come back in ONE device-to-host copy into a pinned buffer followed by ONE wait on that copy:
  the only sync of a step.
* Remaining, rarer waits: a top-p row whose 256 best tokens hold less than ``top_p`` of the mass
  is resampled exactly (a second copy and wait that step, before the next step is launched);
  a pinned input buffer is reused only once its copy two steps back has completed (an event;
  it always has in practice); the Triton prefill schedule is pinned per step by the backend.
  Tensor parallelism broadcasts each step's inputs as pickled CPU tensors (gloo/NCCL object
  broadcast) and copies them to the device on every rank.
* Async scheduling (``async_scheduling``, on by default where supported, as in vLLM): while
  the GPU runs step N the host schedules step N+1, builds its inputs and launches it, and only
  then waits for step N's tokens and applies them (stop conditions, freeing).  A position whose
  token step N is still sampling is a placeholder in kvcore's scheduler
  (``num_output_placeholders``); its id is copied on the device from step N's sampled tokens
  (:meth:`runner.batch.PreparedBatch.fill`), so the one wait per step overlaps the next
  step's GPU work.  A request that stops on EOS or a stop token has one extra step computed,
  whose token is dropped.  A step with a top-p row without top-k waits for its own tokens
  before the next one is launched (the exact fallback, above, needs them on the host).  Not
  with tensor parallelism (the workers' inputs are broadcast from the host) nor with the host
  KV tier: those run synchronously (schedule, run, wait, apply).

Failures: bad settings are refused before anything is built (:mod:`runner.config`); bad
prompts or sampling params are refused before anything is admitted; an exception
inside a step aborts that step's requests (``Scheduler.fail_step``: no never-written block stays
in the prefix cache) and ``generate`` aborts the rest of its batch before re-raising, so the
engine stays usable.  NaN or infinite logits fail only the requests they belong to
(:class:`~runner.errors.NonFiniteLogitsError`, marked by the sampler in its one copy: no extra
wait).  Tensor-parallel workers (:mod:`runner.ranks`) are not recovered: if a step fails while
they run its forward, or a worker dies, the engine shuts them down and raises
:class:`EngineDeadError` from then on.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from kvcore.errors import InvalidArgumentError
from kvcore.events.publisher import ZmqEventPublisher
from kvcore.manager import KVCacheManager
from kvcore.request import Request, RequestStatus
from kvcore.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvcore.settings import CacheSettings
from kvcore.specs import KVCacheConfig, config_dtype, kv_cache_config_from_hf
from runner.batch import BatchBuilder, ModelInputs
from runner.config import EngineConfig
from runner.distributed import TPGroup
from runner.errors import EngineDeadError, NonFiniteLogitsError
from runner.inputs import default_tokenizer, prompt_token_ids, sampling_params_list
from runner.models import load_config
from runner.ranks import RankSpec, Workers, init_distributed, store_listener
from runner.ranks import build_runner as _build_runner
from runner.sampler import NON_FINITE, SampledTokens, Sampler, SamplingParams
from runner.threads import apply_cpu_threads, resolve_cpu_threads

_log = logging.getLogger(__name__)

# generate() gives up (and aborts its batch) after this many consecutive steps that scheduled
# nothing and finished nothing: the scheduler is deterministic, so it would never progress.
_MAX_IDLE_STEPS = 64


@dataclass
class _Launched:
    """A step whose forward and sampling are queued on the device; its tokens are applied to
    the scheduler by ``LLM._complete``."""

    out: SchedulerOutput
    rows: dict[str, int]  # request id -> row of ``tokens``
    tokens: SampledTokens | None  # None: nothing sampled


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    num_cached_tokens: int  # prefix-cache hit at the last admission
    num_preemptions: int


class LLM:
    """Generate with a local model folder (safetensors + config.json) or a ``transformers``
    config (random weights from ``seed``)."""

    def __init__(self, model: str | Path | Any, *, tokenizer: Any = None, **kwargs: Any) -> None:
        c = EngineConfig(**kwargs)
        hf_config = load_config(model)
        max_len = c.max_model_len_for(hf_config)
        device = c.device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = c.dtype or (config_dtype(hf_config) if device.startswith("cuda") else torch.float32)
        groups = kv_cache_config_from_hf(hf_config, block_size=c.block_size, num_blocks=2,
                                         dtype=dtype).groups
        if c.tensor_parallel_size > 1 and device == "cuda":
            device = "cuda:0"
        threads = (resolve_cpu_threads(c.cpu_threads, c.tensor_parallel_size)
                   if device.startswith("cpu") else None)
        self.config = c
        self.hf_config = hf_config
        self.device = torch.device(device)
        self._workers = Workers()
        self.tp = TPGroup()
        self._dead: str | None = None  # why the engine can no longer run (tensor parallel)
        # Made first: a bad endpoint fails before the model is loaded.
        self._publisher = ZmqEventPublisher(c.kv_events) if c.kv_events is not None else None
        apply_cpu_threads(threads)
        # The tensor-parallel ranks' rendezvous: a socket on loopback, taken over by the store.
        listener = store_listener() if c.tensor_parallel_size > 1 else None
        spec = RankSpec(model if isinstance(model, (str, Path)) else hf_config, c, groups,
                        max_len, device, dtype, port=listener.getsockname()[1] if listener else 0,
                        cpu_threads=threads)
        try:
            if listener is not None:
                self._workers.start(spec)
                self.tp = init_distributed(0, c.tensor_parallel_size, spec.port, device,
                                           listener)
            self.runner = _build_runner(spec, self.tp)
        except BaseException:
            # The workers may be stuck in the rendezvous or in a broadcast: terminate them.
            self._dead = "the engine failed to start"
            self.close()
            raise
        finally:
            if listener is not None:
                listener.close()  # nothing left to close once the store took it over
        self.kv_config = KVCacheConfig(self.runner.num_blocks, groups)
        self.manager = KVCacheManager(
            self.kv_config, max_len, max_num_batched_tokens=c.max_num_batched_tokens,
            settings=CacheSettings(enable_caching=c.enable_prefix_caching,
                                   enable_events=self._publisher is not None))
        connector, self._offload = self._host_tier(c)
        self.async_scheduling = c.use_async_scheduling
        self.scheduler = Scheduler(self.manager, SchedulerConfig(
            max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens,
            async_scheduling=self.async_scheduling), connector)
        self.sampler = Sampler(c.seed, self.device)
        # Rank 0 with workers broadcasts plain CPU tensors (pickled); otherwise the step's
        # inputs are staged in pinned memory and copied to the device in one go.
        self._batcher = BatchBuilder(
            self.kv_config.num_groups, self.runner.layout.block_size,
            "cpu" if self._workers else self.device,
            max_num_batched_tokens=c.max_num_batched_tokens, max_num_seqs=c.max_num_seqs,
            max_model_len=max_len)
        self.tokenizer = tokenizer if tokenizer is not None else default_tokenizer(model, hf_config)
        self.max_model_len = max_len
        self.vocab_size = int(hf_config.vocab_size)
        self._next_id = 0
        self._in_flight: _Launched | None = None  # async scheduling: launched, not applied
        self._non_finite: list[str] = []  # requests aborted for NaN/inf logits, not reported yet

    @property
    def kv_events_endpoint(self) -> str | None:
        """Where the engine publishes its KV events (a bound wildcard port resolved), or None."""
        return self._publisher.endpoint if self._publisher is not None else None

    def _host_tier(self, c: EngineConfig) -> tuple[Any, Any]:
        """The offloading connector's two sides for ``host_kv_blocks`` (or ``(None, None)``):
        write-through stores of computed blocks, loads of host hits before recompute."""
        if not c.host_kv_blocks:
            return None, None
        from kvcore.connector import KVConnectorRole, OffloadingConnector
        from runner.offload import HostKVTransfer

        scheduler_side = OffloadingConnector(KVConnectorRole.SCHEDULER, self.kv_config,
                                             num_host_blocks=c.host_kv_blocks,
                                             eviction_policy=c.host_kv_policy)
        worker_side = OffloadingConnector(
            KVConnectorRole.WORKER, transfer=HostKVTransfer(self.runner.caches, c.host_kv_blocks))
        return scheduler_side, worker_side

    # -- generation ------------------------------------------------------------------------------
    def generate(self, prompts: str | Sequence[str | Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run all prompts to completion; outputs are in prompt order.

        Every prompt (a ``str``, tokenized here, or a list of int token ids in
        ``[0, vocab_size)``, non-empty and shorter than ``max_model_len``) and the sampling
        params are checked before anything is admitted; a bad one raises
        :class:`~kvcore.errors.InvalidArgumentError` naming it, and the engine is left as it was.
        The batch is admitted atomically (all prompts or none).

        If a step fails (an exception or ``KeyboardInterrupt`` in scheduling, the forward, the
        sampler, ...), the failed step's requests are dropped with ``Scheduler.fail_step``
        (their never-written blocks leave the prefix cache; with async scheduling the step in
        flight, whose forward was launched, is applied first), every other unfinished request
        of this batch is aborted, and the original exception propagates; the engine stays
        usable (single process).  Under tensor parallelism a failure while the workers were
        running a forward leaves them out of step, and a worker that dies shuts the others
        down: the engine then raises :class:`EngineDeadError` and refuses further work.

        A request whose logits hold a NaN or an infinity is aborted (its step's blocks leave the
        prefix cache), the others run to completion, and then
        :class:`~runner.errors.NonFiniteLogitsError` names the failed requests and carries
        every output (``.outputs``); the engine stays usable.
        """
        self._check_alive()
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise InvalidArgumentError(
                f"prompts must be a str or a list of prompts, got {type(prompts).__name__}")
        plist = sampling_params_list(sampling_params, len(prompts))
        token_lists = [prompt_token_ids(i, prompt, self.tokenizer, self.max_model_len,
                                        self.vocab_size) for i, prompt in enumerate(prompts)]
        eos = getattr(self.tokenizer, "eos_token_id", None)
        requests = [
            self.manager.make_request(str(self._next_id + i), ids, max_tokens=p.max_tokens,
                                      eos_token_id=eos, ignore_eos=p.ignore_eos,
                                      stop_token_ids=p.stop_token_ids, sampling_params=p)
            for i, (ids, p) in enumerate(zip(token_lists, plist))]
        self._next_id += len(requests)  # even if admission fails: ids are never reused
        self._non_finite = []
        self.scheduler.add_requests(requests)  # atomic: all of them or none
        bar: Any = None
        try:
            if use_tqdm and requests:
                bar = _progress(len(requests))
            idle_steps = 0
            while self.scheduler.has_unfinished_requests() or self._in_flight is not None:
                finished, num_scheduled = self._advance(keep_in_flight=self.async_scheduling)
                if bar is not None and finished:
                    bar.update(len(finished))
                idle_steps = 0 if num_scheduled or finished else idle_steps + 1
                if idle_steps >= _MAX_IDLE_STEPS:
                    raise RuntimeError(
                        f"the scheduler scheduled nothing for {idle_steps} steps with "
                        f"{self.scheduler.num_waiting} waiting and {self.scheduler.num_running} "
                        "running requests")
        except BaseException:
            step, self._in_flight = self._in_flight, None
            if step is not None:  # interrupted between two steps
                self._settle(step)
            self._abort(requests)
            raise
        finally:
            if bar is not None:
                bar.close()
        outputs = [self._output(r) for r in requests]
        failed, self._non_finite = self._non_finite, []
        if failed:
            raise NonFiniteLogitsError(failed, outputs)
        return outputs

    def step(self) -> list[Request]:
        """One scheduling step: schedule, run the model, sample, apply stop conditions
        (synchronously, also with async scheduling).

        If anything in the step raises, the step's requests are aborted with
        ``Scheduler.fail_step`` and the exception propagates; other requests are untouched.
        Requests with NaN or infinite logits are aborted and named by
        :class:`~runner.errors.NonFiniteLogitsError`, raised after the step is applied."""
        self._check_alive()
        self._non_finite = []
        finished = self._advance(keep_in_flight=False)[0]
        failed, self._non_finite = self._non_finite, []
        if failed:
            raise NonFiniteLogitsError(failed)
        return finished

    def _advance(self, keep_in_flight: bool) -> tuple[list[Request], int]:
        """Schedule and launch a step, then apply the step in flight (``self._in_flight``), if
        any, and unless ``keep_in_flight`` the new step too, which is otherwise left in flight.
        Returns the requests finished and the number of requests scheduled.

        If anything raises, the new step is failed (``Scheduler.fail_step``) and the previous
        one, whose forward was launched (so its KV is written), is applied, or failed if
        applying it is what raised."""
        prev, self._in_flight = self._in_flight, None
        out: SchedulerOutput | None = None
        pending = prev  # launched, not applied yet
        try:
            out = self.scheduler.schedule()
            launched = self._launch(out, prev)
            finished: list[Request] = []
            if prev is not None:
                pending = None
                finished = self._complete(prev)
            if keep_in_flight and launched.rows:
                self._in_flight = launched
            else:
                finished += self._complete(launched)
        except BaseException:
            if pending is not None:
                self._settle(pending)
            elif prev is not None:
                self._fail_step(prev.out)
            if out is not None:
                self._fail_step(out)
            raise
        return finished, len(out.scheduled)

    def _settle(self, step: _Launched) -> None:
        """Apply a launched step after a later failure (its KV is written); if that fails too,
        fail it (best effort, logged)."""
        try:
            self._complete(step)
        except BaseException:
            _log.exception("applying the step in flight after a failure failed; failing it")
            self._fail_step(step.out)

    def _complete(self, step: _Launched) -> list[Request]:
        """Wait for ``step``'s tokens and apply them (stop conditions, freeing); the requests
        that finished."""
        tokens = step.tokens.wait() if step.tokens is not None else []
        sampled = dict(zip(step.rows, tokens))
        if NON_FINITE in tokens:
            self._fail_non_finite(step.out, [r for r, t in sampled.items() if t == NON_FINITE])
        worker = self._offload
        connector_output = None
        if worker is not None:
            worker.wait_for_save()
            connector_output = worker.connector_output(set(step.out.finished_request_ids))
            worker.clear_connector_metadata()
        finished = self.scheduler.update_from_output(step.out, sampled, connector_output)
        if self._publisher is not None:  # the step's KV events, device and host tier
            self._publisher.publish(self.scheduler.take_events())
        for r in finished:
            self.sampler.forget(r.request_id)
        return finished

    def _launch(self, out: SchedulerOutput, prev: _Launched | None) -> _Launched:
        """Queue the model over the step's tokens and the sampling on the device.  Positions
        whose tokens ``prev`` (the step in flight) sampled read them there: no wait."""
        worker = self._offload
        if worker is not None:
            worker.bind_connector_metadata(out.kv_connector_metadata)
            worker.transfer.before_forward()
            worker.start_load_kv()
        if not out.scheduled:
            self._batcher.release_finished(out)
            return _Launched(out, {}, None)
        batch = self._batcher.prepare(out, prev.rows if prev is not None else None)
        batch.fill(prev.tokens.device if prev is not None and prev.tokens is not None else None)
        inputs = batch.inputs
        if self._workers:
            hidden = self._forward_with_workers(inputs)
        else:
            hidden = self.runner.forward(inputs)
        if not batch.sampling:
            return _Launched(out, {}, None)
        if not batch.sample_all:
            hidden = hidden[batch.sample_indices.to(hidden.device)]
        logits = self.runner.logits(hidden)
        params = [cast(SamplingParams, s.request.sampling_params) for s in batch.sampling]
        rids = [s.request_id for s in batch.sampling]
        tokens = self.sampler.sample_async(logits, params, rids)  # no wait
        return _Launched(out, {rid: i for i, rid in enumerate(rids)}, tokens)

    def _fail_non_finite(self, out: SchedulerOutput, request_ids: list[str]) -> None:
        """Abort the requests of ``out`` whose logits were not finite; the blocks their step
        wrote (its KV is suspect too) leave the prefix cache first."""
        failed = set(request_ids)
        for s in out.scheduled:
            if s.request_id in failed and s.request.status is RequestStatus.RUNNING:
                _log.warning("request %r: NaN or infinite logits; aborting it", s.request_id)
                self._abort_one(s.request, s.num_computed_tokens)
                self.sampler.forget(s.request_id)
        self._non_finite.extend(request_ids)

    def _forward_with_workers(self, inputs: ModelInputs) -> torch.Tensor:
        """Broadcast the step's inputs and run rank 0's share of the forward.  A dead worker
        (before or during the step) shuts the others down: :class:`EngineDeadError`."""
        # From the broadcast until rank 0's forward returns, the workers are in this step's
        # collectives: a failure in between leaves them out of step for good.
        self._dead = ("a tensor-parallel step failed while the workers were running it, "
                      "leaving them out of step: close this engine and build a new one")
        try:
            self._workers.broadcast(inputs)
            hidden = self.runner.forward(inputs.to(self.device))
        except EngineDeadError as exc:
            self._dead = str(exc)
            raise
        except BaseException as exc:
            why = self._workers.dead()
            if why is None:
                raise
            self._dead = f"{why} during a step: the tensor-parallel engine is shut down"
            self._workers.stop(clean=False)
            raise EngineDeadError(self._dead) from exc
        self._dead = None
        return hidden

    def _fail_step(self, out: SchedulerOutput) -> None:
        """Drop a step that raised: its blocks leave the prefix cache, its requests are aborted
        (best effort: a second error here is logged, the original one is what propagates)."""
        try:
            self.scheduler.fail_step(out)
        except Exception:
            _log.exception("dropping the failed step's requests failed; aborting them one by one")
            for s in out.scheduled:
                if s.request.status is RequestStatus.RUNNING:
                    self._abort_one(s.request, s.num_computed_tokens)
        for s in out.scheduled:
            if s.request.status.is_finished:
                self.sampler.forget(s.request_id)

    def _abort(self, requests: list[Request]) -> None:
        """Abort the unfinished ones of ``requests`` after a failure (best effort, logged)."""
        for r in requests:
            if not r.status.is_finished and r.request_id in self.scheduler.requests:
                # A failure inside ``schedule`` may have cached blocks for tokens past the
                # computed ones (allocation caches them ahead of the forward): uncache them.
                self._abort_one(r, r.num_computed_tokens)
            self.sampler.forget(r.request_id)

    def _abort_one(self, r: Request, num_written: int) -> None:
        """Abort ``r``, first dropping from the prefix cache its blocks past ``num_written``
        tokens if it holds blocks (best effort: errors are logged)."""
        try:
            if r.status is RequestStatus.RUNNING:
                self.manager.uncache_blocks(r, num_written)
            self.scheduler.abort_request(r.request_id)
        except Exception:
            _log.exception("aborting request %r after a failed step failed", r.request_id)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    def _output(self, r: Request) -> RequestOutput:
        out = r.output_token_ids
        decode = getattr(self.tokenizer, "decode", None)
        return RequestOutput(r.request_id, r.prompt_token_ids, out,
                             decode(out) if decode is not None else None, r.status.value,
                             r.num_cached_tokens, r.num_preemptions)

    # -- lifecycle -------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop tensor-parallel workers (idempotent).  Workers left out of step by a failed
        forward are terminated instead of asked to stop."""
        if self._workers:
            self._workers.stop(clean=self._dead is None)
            self._dead = self._dead or "the tensor-parallel engine is closed"
        publisher = getattr(self, "_publisher", None)  # None if __init__ failed before it
        if publisher is not None:
            self._publisher = None
            publisher.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown: nothing sensible to do
            self.close()


def _progress(total: int) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="req", desc="generate")


__all__ = ["LLM", "EngineConfig", "EngineDeadError", "ModelInputs", "RequestOutput",
           "SamplingParams"]
