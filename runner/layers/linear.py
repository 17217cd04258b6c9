"""Linear layers split across tensor-parallel ranks (Megatron style).

Column-parallel layers split output features (no communication); row-parallel layers split input
features and all-reduce their output.  Attention shards heads (q, k and v heads together); the MLP
shards its intermediate size.  Each layer's ``load(full_weight, shard=...)`` copies this rank's
slice of a full checkpoint tensor, so checkpoints never need resharding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runner.distributed import NO_TP, TPGroup


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with ``W``'s output rows split across ranks; ``parts`` are the sizes of
    the fused matrices (e.g. gate and up) whose rows are split part by part."""

    def __init__(self, in_features: int, parts: list[int], bias: bool, tp: TPGroup = NO_TP) -> None:
        super().__init__()
        self.tp = tp
        self.full_parts = parts
        self.local_parts = [tp.shard(p, "output features") for p in parts]
        out = sum(self.local_parts)
        self.weight = nn.Parameter(torch.empty(out, in_features))
        self.bias = nn.Parameter(torch.zeros(out)) if bias else None
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def load(self, tensor: torch.Tensor, part: int = 0, is_bias: bool = False) -> None:
        """Copy this rank's rows of fused part ``part`` from the full ``tensor``."""
        target = self.bias if is_bias else self.weight
        if target is None:
            raise ValueError("this layer has no bias")
        local = self.local_parts[part]
        start = sum(self.local_parts[:part])
        rows = tensor.narrow(0, self.tp.rank * local, local)
        with torch.no_grad():
            target.narrow(0, start, local).copy_(rows)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection: this rank holds ``num_heads/tp`` query heads and
    ``num_kv_heads/tp`` key/value heads."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 tp: TPGroup = NO_TP) -> None:
        tp.shard(num_heads, "num_attention_heads")
        tp.shard(num_kv_heads, "num_key_value_heads")
        super().__init__(hidden, [num_heads * head_dim, num_kv_heads * head_dim,
                                  num_kv_heads * head_dim], bias, tp)


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with ``W``'s input columns split; partial sums are all-reduced and the
    bias is added once, after the reduction."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup = NO_TP) -> None:
        super().__init__()
        self.tp = tp
        self.local_in = tp.shard(in_features, "input features")
        self.weight = nn.Parameter(torch.empty(out_features, self.local_in))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y + self.bias if self.bias is not None else y

    def load(self, tensor: torch.Tensor, part: int = 0, is_bias: bool = False) -> None:
        with torch.no_grad():
            if is_bias:
                assert self.bias is not None
                self.bias.copy_(tensor)
            else:
                self.weight.copy_(tensor.narrow(1, self.tp.rank * self.local_in, self.local_in))
