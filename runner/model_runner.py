"""ModelRunner: one tensor-parallel rank's model, KV-cache tensors and attention backend.

It runs forwards on :class:`~runner.batch.ModelInputs`.  On a GPU it sizes the KV cache from
the memory left after a warm-up forward at the full token budget (as nano-vllm does), and, for
backends whose decode path is graph-safe, replays captured CUDA graphs for decode-only steps
(batch sizes padded up to the nearest captured size; padding rows write nowhere: slot -1).

Decode graphs are captured for batch sizes 1, 2, 4, 8, multiples of 8 up to 64 and of 16 up to
512 (and ``max_num_seqs`` itself), at most ``max_num_seqs``; all of them read one set of static
input buffers (slices of the largest) and share one memory pool, so 40 graphs cost about what
the largest one does.  A forward never waits for the GPU: no ``.item()``/``.tolist()``, and the
step's inputs are already on the device (see :mod:`runner.batch`).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from runner.attention.base import AttentionBackend, AttentionMetadata, GroupMetadata
from runner.batch import ModelInputs
from runner.distributed import TPGroup
from runner.kv_cache import (
    KVCacheLayout,
    allocate_kv_caches,
    bytes_per_block,
    layer_caches,
    num_blocks_for_gpu,
)
from runner.models import DecoderForCausalLM


def warmup_inputs(num_tokens: int, max_model_len: int, block_size: int, num_groups: int,
                  device: torch.device) -> tuple[ModelInputs, int]:
    """A prefill of ``num_tokens`` tokens packed into sequences of at most ``max_model_len``
    (so positions stay within what the model was built for), each on its own blocks, and the
    number of blocks it needs (block 0 is left as the null block)."""
    lens = [max_model_len] * (num_tokens // max_model_len)
    if num_tokens % max_model_len:
        lens.append(num_tokens % max_model_len)
    blocks_per_seq = -(-max(lens) // block_size)
    tables = (1 + torch.arange(len(lens) * blocks_per_seq, dtype=torch.int32, device=device)
              ).view(len(lens), blocks_per_seq)
    lens_t = torch.tensor(lens, device=device)
    positions = torch.cat([torch.arange(length, device=device) for length in lens])
    seq_of = torch.repeat_interleave(torch.arange(len(lens), device=device), lens_t)
    slots = tables[seq_of, positions // block_size].long() * block_size + positions % block_size
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32, device=device)
    cu[1:] = lens_t.cumsum(0)
    meta = AttentionMetadata(cu, lens_t.to(torch.int32), max(lens), max(lens),
                             [GroupMetadata(slots, tables) for _ in range(num_groups)],
                             lens, lens)
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    return ModelInputs(ids, positions, meta), 1 + len(lens) * blocks_per_seq


def _int_class(n: int) -> str:
    """How Triton specializes an integer kernel argument: 1, a multiple of 16, or other."""
    return "1" if n == 1 else "16k" if n % 16 == 0 else "n"


def eager_step_shape(meta: AttentionMetadata) -> tuple[Any, ...]:
    """What decides which compiled kernel variants an eager step runs: prefill or decode, and
    per KV-cache group the block table's width as Triton specializes it (the only integer
    kernel argument that changes from step to step; grids and tensor sizes need no compile)."""
    return ("eager", "decode" if meta.is_decode_only else "prefill",
            tuple(_int_class(g.block_tables.shape[1]) for g in meta.groups))


def decode_graph_sizes(max_batch: int, limit: int = 512) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, multiples of 8 to 64 and of 16 to ``limit``, capped
    by ``max_batch`` (included itself when it is below ``limit``)."""
    top = min(max_batch, limit)
    sizes = {s for s in (1, 2, 4, 8) if s <= top}
    sizes |= set(range(16, min(top, 64) + 1, 8)) | set(range(80, top + 1, 16))
    if top >= 1:
        sizes.add(top)
    return sorted(sizes)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: ModelInputs  # static buffers the graph reads (slices of the shared ones)
    hidden: torch.Tensor  # static output


class ModelRunner:
    def __init__(self, model: DecoderForCausalLM, layout: KVCacheLayout, num_groups: int,
                 backend: AttentionBackend, *, device: torch.device, dtype: torch.dtype,
                 tp: TPGroup) -> None:
        self.model = model
        self.layout = layout
        self.num_groups = num_groups
        self.backend = backend
        self.device = device
        self.dtype = dtype
        self.tp = tp
        self.caches: list[torch.Tensor] = []
        self.layer_caches: list[torch.Tensor] = []
        self.num_blocks = 0
        self._graphs: dict[int, _Graph] = {}
        self._graph_sizes: list[int] = []  # sorted keys of _graphs
        self._static: ModelInputs | None = None  # the largest graph's input buffers
        # When a set: each forward adds the shape key of what it ran (eager_step_shape, or
        # ("graph", size)), so a benchmark can check that its warm-up ran every kernel variant
        # its timed run needs.
        self.shape_log: set[tuple[Any, ...]] | None = None

    # -- KV memory ------------------------------------------------------------------------------
    def block_bytes(self) -> int:
        return bytes_per_block(self.layout, self.model.num_kv_heads_per_rank, self.model.head_dim,
                               self.dtype)

    def profile_num_blocks(self, max_num_batched_tokens: int, max_model_len: int,
                           max_num_seqs: int, utilization: float,
                           sample: Callable[[torch.Tensor], Any] | None = None) -> int:
        """GPU: blocks that fit after a warm-up forward at the full token budget (a collective
        under tensor parallelism: every rank takes the minimum).

        The warm-up packs ``max_num_batched_tokens`` tokens into sequences of at most
        ``max_model_len`` (positions never exceed what the model was built for) and computes
        logits for up to ``max_num_seqs`` of them, the most a step samples; ``sample`` (the
        engine's sampler) then runs on those logits, so its scratch memory counts too."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        dev = self.device
        n = max_num_batched_tokens
        inputs, num_blocks = warmup_inputs(n, max_model_len, self.layout.block_size,
                                           self.num_groups, dev)
        scratch = allocate_kv_caches(self.layout, num_blocks, self.model.num_kv_heads_per_rank,
                                     self.model.head_dim, self.dtype, dev)
        with torch.inference_mode():
            hidden = self.model(inputs.input_ids, inputs.positions,
                                layer_caches(scratch, self.layout), inputs.meta, self.backend)
            logits = self.logits(hidden[-min(n, max_num_seqs):])  # as a step computes them
            if sample is not None:
                sample(logits)
            del logits
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev)
        del scratch, hidden
        torch.cuda.empty_cache()
        num = num_blocks_for_gpu(self.layout, self.model.num_kv_heads_per_rank,
                                 self.model.head_dim, self.dtype, utilization, peak, dev)
        if self.tp.world_size > 1:
            t = torch.tensor([num], device=dev)
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.tp.group)
            num = int(t.item())
        return num

    def allocate(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.caches = allocate_kv_caches(self.layout, num_blocks, self.model.num_kv_heads_per_rank,
                                         self.model.head_dim, self.dtype, self.device)
        self.layer_caches = layer_caches(self.caches, self.layout)

    # -- forward --------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        """Hidden states of every new token ([num_tokens, hidden])."""
        if self._graphs and inputs.meta.is_decode_only:
            i = bisect.bisect_left(self._graph_sizes, inputs.meta.num_seqs)
            if i < len(self._graph_sizes):
                if self.shape_log is not None:
                    self.shape_log.add(("graph", self._graph_sizes[i]))
                return self._replay(self._graphs[self._graph_sizes[i]], inputs)
        if self.shape_log is not None:
            self.shape_log.add(eager_step_shape(inputs.meta))
        return self.model(inputs.input_ids, inputs.positions, self.layer_caches, inputs.meta,
                          self.backend)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden).float()

    # -- CUDA graphs (decode) -------------------------------------------------------------------
    def capture_decode_graphs(self, max_batch: int, max_model_len: int,
                              limit: int = 512) -> list[int]:
        """Capture decode forwards for :func:`decode_graph_sizes` (``max_batch``, ``limit``).
        Needs a backend whose decode path reads only tensors (``supports_cuda_graphs``)."""
        if not getattr(self.backend, "supports_cuda_graphs", False):
            return []
        sizes = decode_graph_sizes(max_batch, limit)
        if not sizes:
            return []
        max_blocks = -(-max_model_len // self.layout.block_size)
        self._static = self._static_decode_inputs(sizes[-1], max_blocks, max_model_len)
        pool = None
        for size in reversed(sizes):  # largest first: the smaller ones reuse its pool memory
            inputs = self._static_slice(size, max_model_len)
            self.model(inputs.input_ids, inputs.positions, self.layer_caches, inputs.meta,
                       self.backend)  # warm up (compiles kernels) outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self.model(inputs.input_ids, inputs.positions, self.layer_caches,
                                    inputs.meta, self.backend)
            pool = graph.pool()
            self._graphs[size] = _Graph(graph, inputs, hidden)
        self._graph_sizes = sorted(self._graphs)
        torch.cuda.synchronize(self.device)
        return list(self._graph_sizes)

    def drop_graphs(self) -> None:
        self._graphs.clear()
        self._graph_sizes = []
        self._static = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    @property
    def graph_sizes(self) -> list[int]:
        return list(self._graph_sizes)

    def _static_decode_inputs(self, size: int, max_blocks: int, max_model_len: int) -> ModelInputs:
        dev = self.device
        groups = [GroupMetadata(torch.full((size,), -1, dtype=torch.long, device=dev),
                                torch.zeros(size, max_blocks, dtype=torch.int32, device=dev))
                  for _ in range(self.num_groups)]
        meta = AttentionMetadata(torch.arange(size + 1, dtype=torch.int32, device=dev),
                                 torch.ones(size, dtype=torch.int32, device=dev), 1,
                                 max_model_len, groups, [max_model_len] * size, [1] * size)
        return ModelInputs(torch.zeros(size, dtype=torch.long, device=dev),
                           torch.zeros(size, dtype=torch.long, device=dev), meta)

    def _static_slice(self, size: int, max_model_len: int) -> ModelInputs:
        """The first ``size`` rows of the shared static buffers, as one graph's inputs."""
        s = self._static
        assert s is not None
        groups = [GroupMetadata(g.slot_mapping[:size], g.block_tables[:size])
                  for g in s.meta.groups]
        meta = AttentionMetadata(s.meta.cu_seqlens_q[:size + 1], s.meta.seq_lens[:size], 1,
                                 max_model_len, groups, [max_model_len] * size, [1] * size)
        return ModelInputs(s.input_ids[:size], s.positions[:size], meta)

    def _replay(self, g: _Graph, inputs: ModelInputs) -> torch.Tensor:
        """Copy the live inputs into the graph's static buffers (device to device; rows past
        ``n`` become padding: length 1, slot -1, the null block) and replay."""
        n = inputs.meta.num_seqs
        s = g.inputs
        s.input_ids[:n].copy_(inputs.input_ids)
        s.positions[:n].copy_(inputs.positions)
        s.meta.seq_lens[:n].copy_(inputs.meta.seq_lens)
        padded = s.input_ids.shape[0] > n
        if padded:
            s.meta.seq_lens[n:].fill_(1)
        for static, live in zip(s.meta.groups, inputs.meta.groups):
            static.slot_mapping[:n].copy_(live.slot_mapping)
            width = live.block_tables.shape[1]
            static.block_tables[:n, :width].copy_(live.block_tables)
            if padded:
                static.slot_mapping[n:].fill_(-1)
                static.block_tables[n:, :1].zero_()  # padding reads position 0 only
        g.graph.replay()
        return g.hidden[:n]
