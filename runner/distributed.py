"""Tensor-parallel state, passed explicitly (no module-global process group)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    """This process's place in a tensor-parallel group; ``world_size == 1`` means no TP."""

    rank: int = 0
    world_size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup (None: the default group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def shard(self, size: int, what: str) -> int:
        """``size // world_size``, raising a clear error when it does not divide."""
        if size % self.world_size:
            raise ValueError(f"{what}={size} is not divisible by tensor_parallel_size="
                             f"{self.world_size}")
        return size // self.world_size


NO_TP = TPGroup()
