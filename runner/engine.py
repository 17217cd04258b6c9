"""``LLM``: a paged-attention engine on kvcore, in the shape of nano-vllm.

    llm = LLM(model_dir_or_hf_config, backend="torch", block_size=16, ...)
    outputs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=32))

Each step: ``kvcore.scheduler.Scheduler`` picks requests and token counts (chunked prefill mixed
with decodes, prefix hits, recompute preemption), :mod:`runner.batch` turns that into model
inputs, the :class:`~runner.model_runner.ModelRunner` runs the model over paged KV memory, the
:class:`~runner.sampler.Sampler` picks tokens, and the scheduler applies stop conditions.

Tensor parallelism: ranks 1..N-1 are spawned processes that build their shard of the model and
then run every forward whose inputs rank 0 (this process) broadcasts; NCCL on GPU, gloo on CPU.
One tensor-parallel engine per process (torch.distributed's default group is per process).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvcore.manager import KVCacheManager
from kvcore.request import Request
from kvcore.scheduler import Scheduler, SchedulerConfig
from kvcore.specs import KVCacheConfig, config_dtype, kv_cache_config_from_hf
from runner.attention import get_backend
from runner.batch import ModelInputs, prepare_batch
from runner.distributed import TPGroup
from runner.kv_cache import KVCacheLayout
from runner.model_runner import ModelRunner
from runner.models import build_model, load_config
from runner.models.weights import iter_safetensors
from runner.sampler import Sampler, SamplingParams
from runner.tokenizer import ByteTokenizer


@dataclass(frozen=True)
class EngineConfig:
    backend: str = "torch"
    block_size: int = 16
    num_blocks: int | None = None  # default: GPU profile, or kv_cache_memory_bytes on CPU
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int = 256 << 20  # CPU budget per rank
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # default: min(max_position_embeddings, 8192)
    enable_prefix_caching: bool = True
    tensor_parallel_size: int = 1
    dtype: torch.dtype | None = None  # default: the config's on GPU, float32 on CPU
    device: str | None = None
    seed: int = 0
    enforce_eager: bool = False  # no CUDA graphs


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    num_cached_tokens: int  # prefix-cache hit at the last admission
    num_preemptions: int


@dataclass
class _RankSpec:
    """Everything a rank needs to build its model shard (picklable)."""

    model: Any  # a local path or a transformers config
    config: EngineConfig
    kv_groups: Any
    max_model_len: int
    device: str
    dtype: torch.dtype
    port: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def _build_runner(spec: _RankSpec, tp: TPGroup) -> ModelRunner:
    cfg = load_config(spec.model)
    device = torch.device(spec.device)
    kv_config = KVCacheConfig(2, spec.kv_groups)
    layout = KVCacheLayout.from_config(kv_config, cfg.num_hidden_layers)
    weights = iter_safetensors(spec.model) if isinstance(spec.model, (str, Path)) else None
    model = build_model(cfg, tp=tp, dtype=spec.dtype, device=device,
                        layer_to_kv_group=list(layout.layer_to_group),
                        max_positions=spec.max_model_len, weights=weights, seed=spec.config.seed)
    runner = ModelRunner(model, layout, len(spec.kv_groups), get_backend(spec.config.backend),
                         device=device, dtype=spec.dtype, tp=tp)
    c = spec.config
    if c.num_blocks is not None:
        num_blocks = c.num_blocks
    elif device.type == "cuda":
        num_blocks = runner.profile_num_blocks(c.max_num_batched_tokens, spec.max_model_len,
                                               c.max_num_seqs, c.gpu_memory_utilization)
    else:
        num_blocks = c.kv_cache_memory_bytes // runner.block_bytes()
        if num_blocks < 2:
            raise ValueError(f"kv_cache_memory_bytes={c.kv_cache_memory_bytes} holds no blocks "
                             f"({runner.block_bytes()} bytes each)")
    runner.allocate(num_blocks)
    if device.type == "cuda" and not c.enforce_eager:
        try:
            runner.capture_decode_graphs(c.max_num_seqs, spec.max_model_len)
        except Exception as exc:  # keep serving, eagerly, and say why
            runner.drop_graphs()
            logging.getLogger(__name__).warning(
                "CUDA-graph capture failed (%s: %s); decoding eagerly", type(exc).__name__, exc)
    return runner


def _init_distributed(rank: int, world: int, port: int, device: str) -> TPGroup:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if device.startswith("cuda"):
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    return TPGroup(rank, world, None)


def _worker_main(rank: int, spec: _RankSpec) -> None:
    """Ranks >= 1: build the shard, then run each forward rank 0 broadcasts (None: stop)."""
    device = f"cuda:{rank}" if spec.device.startswith("cuda") else "cpu"
    spec = replace(spec, device=device)
    tp = _init_distributed(rank, spec.config.tensor_parallel_size, spec.port, device)
    try:
        runner = _build_runner(spec, tp)
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0)
            if box[0] is None:
                break
            runner.forward(box[0].to(runner.device))
    finally:
        dist.destroy_process_group()


class LLM:
    """Generate with a local model folder (safetensors + config.json) or a ``transformers``
    config (random weights from ``seed``)."""

    def __init__(self, model: str | Path | Any, *, tokenizer: Any = None, **kwargs: Any) -> None:
        c = EngineConfig(**kwargs)
        hf_config = load_config(model)
        device = c.device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = c.dtype or (config_dtype(hf_config) if device.startswith("cuda") else torch.float32)
        max_len = c.max_model_len or min(int(hf_config.max_position_embeddings), 8192)
        groups = kv_cache_config_from_hf(hf_config, block_size=c.block_size, num_blocks=2,
                                         dtype=dtype).groups
        if c.tensor_parallel_size > 1 and device == "cuda":
            device = "cuda:0"
        spec = _RankSpec(model if isinstance(model, (str, Path)) else hf_config, c, groups,
                         max_len, device, dtype, port=_free_port())
        self.config = c
        self.hf_config = hf_config
        self.device = torch.device(device)
        self._workers: list[Any] = []
        self.tp = TPGroup()
        if c.tensor_parallel_size > 1:
            ctx = mp.get_context("spawn")
            for rank in range(1, c.tensor_parallel_size):
                proc = ctx.Process(target=_worker_main, args=(rank, spec), daemon=True)
                proc.start()
                self._workers.append(proc)
            self.tp = _init_distributed(0, c.tensor_parallel_size, spec.port, device)
        self.runner = _build_runner(spec, self.tp)
        self.kv_config = KVCacheConfig(self.runner.num_blocks, groups)
        self.manager = KVCacheManager(self.kv_config, max_len,
                                      enable_caching=c.enable_prefix_caching,
                                      max_num_batched_tokens=c.max_num_batched_tokens)
        self.scheduler = Scheduler(self.manager, SchedulerConfig(
            max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens))
        self.sampler = Sampler(c.seed, self.device)
        self.tokenizer = tokenizer if tokenizer is not None else _default_tokenizer(model, hf_config)
        self.max_model_len = max_len
        self._next_id = 0

    # -- generation ------------------------------------------------------------------------------
    def generate(self, prompts: list[str] | list[list[int]] | str,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run all prompts to completion; outputs are in prompt order."""
        if isinstance(prompts, str):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} sampling params for {len(prompts)} prompts")
        eos = getattr(self.tokenizer, "eos_token_id", None)
        requests: list[Request] = []
        for prompt, p in zip(prompts, plist):
            ids: list[int] = (self.tokenizer.encode(prompt) if isinstance(prompt, str)
                              else list(cast(list[int], prompt)))
            rid = str(self._next_id)
            self._next_id += 1
            req = self.manager.make_request(rid, ids, max_tokens=p.max_tokens, eos_token_id=eos,
                                            ignore_eos=p.ignore_eos,
                                            stop_token_ids=p.stop_token_ids, sampling_params=p)
            self.scheduler.add_request(req)
            requests.append(req)
        bar = _progress(len(requests)) if use_tqdm else None
        while self.scheduler.has_unfinished_requests():
            finished = self.step()
            if bar is not None and finished:
                bar.update(len(finished))
        if bar is not None:
            bar.close()
        return [self._output(r) for r in requests]

    def step(self) -> list[Request]:
        """One scheduling step: schedule, run the model, sample, apply stop conditions."""
        out = self.scheduler.schedule()
        sampled: dict[str, int] = {}
        if out.scheduled:
            batch = prepare_batch(out.scheduled, self.kv_config.num_groups, self.runner.layout.block_size,
                                  "cpu" if self._workers else self.device)
            inputs = batch.inputs
            if self._workers:
                dist.broadcast_object_list([inputs], src=0)
                inputs = inputs.to(self.device)
            hidden = self.runner.forward(inputs)
            if batch.sampling:
                logits = self.runner.logits(hidden[batch.sample_indices.to(hidden.device)])
                params = [cast(SamplingParams, s.request.sampling_params)
                          for s in batch.sampling]
                rids = [s.request_id for s in batch.sampling]
                tokens = self.sampler(logits, params, rids).tolist()
                sampled = dict(zip(rids, tokens))
        finished = self.scheduler.update_from_output(out, sampled)
        for r in finished:
            self.sampler.forget(r.request_id)
        return finished

    def _output(self, r: Request) -> RequestOutput:
        out = r.output_token_ids
        decode = getattr(self.tokenizer, "decode", None)
        return RequestOutput(r.request_id, r.prompt_token_ids, out,
                             decode(out) if decode is not None else None, r.status.value,
                             r.num_cached_tokens, r.num_preemptions)

    # -- lifecycle -------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop tensor-parallel workers (idempotent)."""
        if self._workers:
            dist.broadcast_object_list([None], src=0)
            for proc in self._workers:
                proc.join(timeout=60)
            self._workers = []
            dist.destroy_process_group()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown: nothing sensible to do
            self.close()


def _default_tokenizer(model: Any, cfg: Any) -> Any:
    if isinstance(model, (str, Path)):
        try:
            import transformers

            return transformers.AutoTokenizer.from_pretrained(str(model), local_files_only=True)
        except Exception:  # no tokenizer files in the folder: fall back to bytes
            pass
    if cfg.vocab_size < ByteTokenizer().vocab_size:
        raise ValueError(f"vocab_size {cfg.vocab_size} is too small for the byte tokenizer (259)")
    return ByteTokenizer()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _progress(total: int) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="req", desc="generate")


__all__ = ["LLM", "EngineConfig", "ModelInputs", "RequestOutput", "SamplingParams"]
