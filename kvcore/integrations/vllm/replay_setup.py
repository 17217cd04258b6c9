"""The vLLM replay's scheduler: vLLM's ``Scheduler`` (or ``AsyncScheduler``) configured as a
run of :mod:`kvcore.integrations.vllm.replay` asks (:class:`ReplaySetup`), with vLLM's
KV-cache manager or kvcore's (:func:`make_scheduler`), over a model directory holding only a
tiny config (the scheduler never loads weights).  The replay re-exports both (tests import
them from there).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from kvcore.integrations.vllm.replay_engine import Engine
from kvcore.sim.clock import StepCost

VOCAB = 32_000
"""The tiny model's vocabulary: fabricated tokens are below it."""


def _model_dir() -> str:
    """A model directory with only a tiny config.json (the scheduler never loads weights)."""
    from transformers import LlamaConfig

    path = os.path.join(tempfile.gettempdir(), "kvcore-vllm-replay-model")
    if not os.path.exists(os.path.join(path, "config.json")):
        LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=32, max_position_embeddings=1 << 20).save_pretrained(path)
    return path


@dataclass(frozen=True)
class ReplaySetup:
    """The scheduler configuration shared by every engine of a run."""

    block_size: int = 16
    num_blocks: int = 1024
    max_model_len: int = 8192
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_caching: bool = True
    async_scheduling: bool = False
    kv_cache_groups: Callable[[], list[Any]] | None = None  # default: one full-attention group
    # vLLM's CacheConfig.prefix_cache_retention_interval (sliding-window groups: kvcore needs
    # None, every block cached; vLLM's default 0 keeps only replay-boundary tails).
    prefix_cache_retention_interval: int | None = 0
    kv_transfer_config: dict[str, Any] | None = None  # a KV connector (vLLM's KVTransferConfig)
    # vLLM's KVCacheTensors (default none): a connector that sizes a tier from them needs them.
    kv_cache_tensors: Callable[[], list[Any]] | None = None
    # vLLM's deferred block frees, as a P/D decode instance (KV consumer) or CPU offloading has
    # them with overlapped steps; vLLM's CPU build turns async scheduling off with a connector,
    # so they are forced on here, as vLLM's own tests do.
    defer_block_free: bool = False
    # Requests end on a stop token at their trace length instead of reaching max_tokens, which
    # the scheduler cannot foresee: with overlapped steps a finished request was already
    # scheduled once more (what deferred frees exist for).
    stop_by_token: bool = False
    # vLLM's SchedulerConfig.watermark (admissions keep that fraction of the blocks free).
    watermark: float = 0.0
    # vLLM's ObservabilityConfig.kv_cache_metrics, every block sampled (recorded per step).
    kv_cache_metrics: bool = False
    # Requests carry prompt embeddings (each position's embedding its token) instead of tokens.
    prompt_embeds: bool = False
    # A hybrid model's groups instead of one full-attention group: a Mamba2-style state group
    # in vLLM's "align" mode (with its prefill checkpoint block) and a full-attention group,
    # both at ``block_size``, as vLLM configures Granite 4 / Nemotron-H under prefix caching.
    hybrid: bool = False
    # vLLM's SchedulerConfig.policy: "fcfs" or "priority".
    scheduling_policy: str = "fcfs"
    # The simulated clock (kvcore's own replay's cost model; time_scale 0: all queued at once).
    step_cost: StepCost = field(default_factory=StepCost)


def _hybrid_groups(block_size: int) -> list[Any]:
    """A Mamba2 layer's state group ("align", one prefill checkpoint block) and a full-attention
    group, as vLLM builds them for a hybrid model (page sizes are irrelevant without a model)."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec

    return [KVCacheGroupSpec(["layer.0"], MambaSpec(
                block_size=block_size, shapes=((4, 64), (8, 32, 16)),
                dtypes=(torch.float32, torch.float32), mamba_cache_mode="align",
                num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=1)),
            KVCacheGroupSpec(["layer.1"], FullAttentionSpec(
                block_size=block_size, num_kv_heads=1, head_size=32, dtype=torch.float32))]


def make_scheduler(setup: ReplaySetup, engine: Engine, scheduler_cls: type | None = None,
                   additional_config: dict[str, Any] | None = None) -> Any:
    """vLLM's Scheduler (or AsyncScheduler) for ``setup``, with vLLM's manager or kvcore's
    (``scheduler_cls``: this class instead, e.g. the general plugin's; ``additional_config``:
    vLLM's, instead of the engine's settings)."""
    import torch
    from vllm.config import (
        CacheConfig,
        KVEventsConfig,
        KVTransferConfig,
        ModelConfig,
        ObservabilityConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    model_config = ModelConfig(model=_model_dir(), skip_tokenizer_init=True, dtype="float16",
                               max_model_len=setup.max_model_len, seed=0,
                               enable_prompt_embeds=setup.prompt_embeds)
    scheduler_config = SchedulerConfig(
        max_num_seqs=setup.max_num_seqs, max_num_batched_tokens=setup.max_num_batched_tokens,
        max_model_len=setup.max_model_len, is_encoder_decoder=False,
        enable_chunked_prefill=True, async_scheduling=setup.async_scheduling,
        watermark=setup.watermark, policy=setup.scheduling_policy)
    cache_config = CacheConfig(
        block_size=setup.block_size, enable_prefix_caching=setup.enable_caching,
        prefix_cache_retention_interval=setup.prefix_cache_retention_interval,
        **({"mamba_cache_mode": "align", "mamba_block_size": setup.block_size}
           if setup.hybrid else {}))
    additional = ({} if engine.settings is None else {"kvcore": asdict(engine.settings)}
                  ) if additional_config is None else additional_config
    transfer = (None if setup.kv_transfer_config is None
                else KVTransferConfig(**setup.kv_transfer_config))
    vllm_config = VllmConfig(
        model_config=model_config, scheduler_config=scheduler_config, cache_config=cache_config,
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
        kv_transfer_config=transfer, additional_config=additional,
        observability_config=ObservabilityConfig(kv_cache_metrics=setup.kv_cache_metrics,
                                                 kv_cache_metrics_sample=1.0))
    cache_config.num_gpu_blocks = setup.num_blocks
    groups = (setup.kv_cache_groups() if setup.kv_cache_groups is not None else
              _hybrid_groups(setup.block_size) if setup.hybrid else
              [KVCacheGroupSpec(["layer.0"], FullAttentionSpec(
                  block_size=setup.block_size, num_kv_heads=1, head_size=32,
                  dtype=torch.float16))])
    kv_cache_config = KVCacheConfig(
        num_blocks=setup.num_blocks, kv_cache_groups=groups,
        kv_cache_tensors=setup.kv_cache_tensors() if setup.kv_cache_tensors is not None else [],
        prefix_cache_retention_interval=cache_config.prefix_cache_retention_interval)
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvcore.integrations.vllm import scheduler as kvcore_scheduler
    from kvcore.integrations.vllm.replay_oracle import bound_scheduler_cls

    if scheduler_cls is not None:
        cls: type = scheduler_cls
    elif engine.settings is None:
        cls = AsyncScheduler if setup.async_scheduling else Scheduler
    else:
        cls = (kvcore_scheduler.AsyncScheduler if setup.async_scheduling
               else kvcore_scheduler.Scheduler)
        if engine.oracle is not None:  # the offline bound in the adapter's pool (replay only)
            cls = bound_scheduler_cls(cls, engine.oracle)

    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    sched = cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                structured_output_manager=StructuredOutputManager(vllm_config),
                block_size=block_size, hash_block_size=hash_block_size, log_stats=True)
    if setup.defer_block_free:
        sched.defer_block_free = True
    return sched
