"""KV-cache memory for the runner, laid out from a :class:`~kvcore.specs.KVCacheConfig`.

Groups have equal layer counts, so layer ``j`` of *every* group shares slot ``j``'s tensor::

    slot j: [2, num_blocks, block_size, num_kv_heads, head_dim]     (0 = K, 1 = V)

Block ids are disjoint across groups (one pool hands them out), so sharing is safe and the
memory is ``num_slots`` tensors rather than one per layer.  ``num_blocks`` comes from a byte
budget (CPU) or from profiled free GPU memory.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from kvcore.specs import KVCacheConfig

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


@dataclass(frozen=True)
class KVCacheLayout:
    """Which group and which shared slot each model layer uses."""

    layer_to_group: tuple[int, ...]
    layer_to_slot: tuple[int, ...]
    num_slots: int
    block_size: int

    @classmethod
    def from_config(cls, config: KVCacheConfig, num_layers: int) -> KVCacheLayout:
        group_of: dict[int, int] = {}
        slot_of: dict[int, int] = {}
        block_sizes = set()
        for g, group in enumerate(config.groups):
            block_sizes.add(group.spec.block_size)
            for j, name in enumerate(group.layer_names):
                m = _LAYER.search(name)
                if m is None:
                    raise ValueError(f"cannot find a layer index in KV-cache layer name {name!r}")
                i = int(m.group(1))
                if i in group_of:
                    raise ValueError(f"layer {i} appears in two KV-cache groups")
                group_of[i], slot_of[i] = g, j
        missing = sorted(set(range(num_layers)) - set(group_of))
        if missing or len(group_of) != num_layers:
            raise ValueError(f"KV-cache groups do not cover the model's {num_layers} layers "
                             f"(missing {missing[:8]})")
        if len(block_sizes) != 1:
            raise ValueError(f"the runner needs one block size for all groups, got {block_sizes}")
        return cls(tuple(group_of[i] for i in range(num_layers)),
                   tuple(slot_of[i] for i in range(num_layers)),
                   max(len(g.layer_names) for g in config.groups), block_sizes.pop())


def bytes_per_block(layout: KVCacheLayout, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype) -> int:
    """Memory one block id costs across all slots (K and V)."""
    item = torch.empty((), dtype=dtype).element_size()
    return layout.num_slots * 2 * layout.block_size * num_kv_heads * head_dim * item


def allocate_kv_caches(layout: KVCacheLayout, num_blocks: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype, device: torch.device | str) -> list[torch.Tensor]:
    """One zeroed tensor per slot.  Zeros matter: attention may read (and mask out) blocks that
    were never written, and 0 * NaN would poison the output."""
    return [torch.zeros(2, num_blocks, layout.block_size, num_kv_heads, head_dim, dtype=dtype,
                        device=device) for _ in range(layout.num_slots)]


def layer_caches(caches: list[torch.Tensor], layout: KVCacheLayout) -> list[torch.Tensor]:
    """The tensor each model layer reads and writes."""
    return [caches[s] for s in layout.layer_to_slot]


def num_blocks_for_gpu(layout: KVCacheLayout, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                       utilization: float, peak_bytes: int, device: torch.device) -> int:
    """Blocks that fit in ``utilization`` of the GPU next to the weights and peak activations
    (``peak_bytes``: torch's peak allocated memory after a warm-up forward)."""
    free, total = torch.cuda.mem_get_info(device)
    used_by_others = total - free - torch.cuda.memory_reserved(device)
    budget = int(total * utilization) - used_by_others - peak_bytes
    n = budget // bytes_per_block(layout, num_kv_heads, head_dim, dtype)
    if n < 2:
        raise RuntimeError(f"no room for a KV cache: {budget / 2**30:.2f} GiB left at "
                           f"gpu_memory_utilization={utilization}")
    return int(n)
