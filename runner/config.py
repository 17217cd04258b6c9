"""``EngineConfig``: the engine's settings, checked when they are made.

Every field is checked in ``__post_init__`` (type and range); a bad one raises
:class:`~kvcore.errors.InvalidArgumentError` naming the field and the value, before ``LLM``
builds anything (no model, no KV memory, no tensor-parallel worker).  What can only be checked
against the model (``max_model_len`` against its positions, tensor-parallel divisibility of its
heads and widths) is :meth:`EngineConfig.max_model_len_for`, also called before anything is
built.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

import torch

from kvcore.errors import InvalidArgumentError
from kvcore.events.publisher import check_endpoint
from kvcore.eviction import parse_policy

BACKENDS = ("torch", "triton", "flash_attn")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DEVICE_TYPES = ("cpu", "cuda")
DEFAULT_MAX_MODEL_LEN = 8192  # cap of the default max_model_len (the model's positions beyond)


def _int(name: str, value: object, *, low: int = 1, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not (isinstance(value, numbers.Integral) and not isinstance(value, bool)
            and int(value) >= low):
        what = "a positive int" if low == 1 else f"an int >= {low}"
        raise InvalidArgumentError(
            f"{name} must be {what}{' or None' if optional else ''}, got {value!r}")


def _bool(name: str, value: object, *, optional: bool = False) -> None:
    if not (isinstance(value, bool) or (optional and value is None)):
        raise InvalidArgumentError(
            f"{name} must be a bool{' or None' if optional else ''}, got {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    backend: str = "torch"
    block_size: int = 16
    num_blocks: int | None = None  # default: GPU profile, or kv_cache_memory_bytes on CPU
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int = 256 << 20  # CPU budget per rank
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192  # per step; longer prompts are prefilled in chunks
    max_model_len: int | None = None  # default: min(max_position_embeddings, 8192)
    enable_prefix_caching: bool = True
    tensor_parallel_size: int = 1
    dtype: torch.dtype | None = None  # default: the config's on GPU, float32 on CPU
    device: str | None = None
    seed: int = 0
    enforce_eager: bool = False  # no CUDA graphs
    max_graph_batch_size: int = 512  # decode graphs up to min(this, max_num_seqs)
    host_kv_blocks: int = 0  # a host-memory KV tier of this many blocks (0 = none)
    host_kv_policy: str = "lru"  # its eviction policy (kvcore.eviction names)
    # Schedule step N+1 while step N runs (None: wherever supported: one rank, no host tier).
    async_scheduling: bool | None = None
    # torch's CPU threads per rank (None: OMP_NUM_THREADS if set, else the idle cores' share;
    # see runner.threads).
    cpu_threads: int | None = None
    # Publish the KV cache's events (device and host tier) after every step over ZeroMQ, as
    # vLLM does (its wire format): a PUB endpoint, e.g. tcp://*:5557 (binds) or
    # tcp://host:5557 (connects); None = no events.
    kv_events: str | None = None

    def __post_init__(self) -> None:
        if self.kv_events is not None:
            check_endpoint("kv_events", self.kv_events)
        if self.backend not in BACKENDS:
            raise InvalidArgumentError(
                f"unknown attention backend {self.backend!r}; choose one of {', '.join(BACKENDS)}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens",
                     "kv_cache_memory_bytes", "tensor_parallel_size", "max_graph_batch_size"):
            _int(name, getattr(self, name))
        _int("num_blocks", self.num_blocks, low=2, optional=True)  # block 0 is the null block
        _int("max_model_len", self.max_model_len, optional=True)
        _int("seed", self.seed, low=0)
        _int("host_kv_blocks", self.host_kv_blocks, low=0)
        _int("cpu_threads", self.cpu_threads, optional=True)
        u = self.gpu_memory_utilization
        if not isinstance(u, numbers.Real) or isinstance(u, bool) or not 0.0 < float(u) <= 1.0:
            raise InvalidArgumentError(
                f"gpu_memory_utilization must be a number in (0, 1], got {u!r}")
        _bool("enable_prefix_caching", self.enable_prefix_caching)
        _bool("enforce_eager", self.enforce_eager)
        _bool("async_scheduling", self.async_scheduling, optional=True)
        if self.dtype is not None and self.dtype not in DTYPES:
            raise InvalidArgumentError(
                f"dtype must be None or one of {', '.join(map(str, DTYPES))}, got {self.dtype!r}")
        if self.device is not None:
            self._check_device(self.device)
        parse_policy(self.host_kv_policy)  # raises InvalidArgumentError naming a bad policy
        if self.async_scheduling and not self.async_scheduling_supported:
            raise InvalidArgumentError(
                "async_scheduling=True needs tensor_parallel_size=1 and no host KV tier "
                f"(got tensor_parallel_size={self.tensor_parallel_size}, "
                f"host_kv_blocks={self.host_kv_blocks})")
        if self.host_kv_blocks and self.tensor_parallel_size > 1:
            raise InvalidArgumentError("host_kv_blocks is not supported with tensor parallelism "
                                       f"(tensor_parallel_size={self.tensor_parallel_size})")

    @staticmethod
    def _check_device(device: object) -> None:
        try:
            kind = torch.device(device).type if isinstance(device, str) else None
        except RuntimeError:
            kind = None
        if kind not in DEVICE_TYPES:
            raise InvalidArgumentError(
                f"device must be None or a {' or '.join(DEVICE_TYPES)} device, got {device!r}")

    @property
    def async_scheduling_supported(self) -> bool:
        """One rank and no host tier (the workers' inputs, the tier's copies, go by the host)."""
        return self.tensor_parallel_size == 1 and not self.host_kv_blocks

    @property
    def use_async_scheduling(self) -> bool:
        """``async_scheduling`` resolved: None means on wherever it is supported."""
        if self.async_scheduling is None:
            return self.async_scheduling_supported
        return self.async_scheduling

    def max_model_len_for(self, hf_config: Any) -> int:
        """The model length to serve ``hf_config`` with, after the checks that need the model:
        ``max_model_len`` within its ``max_position_embeddings`` (as vLLM refuses a longer one),
        and ``tensor_parallel_size`` dividing its heads and MLP width."""
        tp = self.tensor_parallel_size
        if tp > 1:
            for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
                size = getattr(hf_config, name, None)
                if isinstance(size, int) and size % tp:
                    raise InvalidArgumentError(
                        f"{name}={size} is not divisible by tensor_parallel_size={tp}")
        positions = getattr(hf_config, "max_position_embeddings", None)
        if self.max_model_len is None:
            return min(int(positions or DEFAULT_MAX_MODEL_LEN), DEFAULT_MAX_MODEL_LEN)
        if positions and self.max_model_len > int(positions):
            raise InvalidArgumentError(
                f"max_model_len={self.max_model_len} is longer than the model's "
                f"max_position_embeddings={positions}")
        return self.max_model_len
