"""The attention-backend interface every runner backend implements.

One forward step runs a batch of sequences, each contributing ``q_len`` new tokens (a prefill
chunk, possibly after a cached prefix, or one decode token).  The new tokens of all sequences are
packed along dimension 0 (``num_tokens``), ordered by sequence.  Per step the engine builds one
:class:`AttentionMetadata`; per layer it calls ``backend.forward`` with the layer's q/k/v, the
layer's paged KV tensor and the layer's KV-cache group.

Paged KV layout (one tensor per layer slot, shared by the layers of different groups):

    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]     (0 = K, 1 = V)

Token ``t`` of a sequence lives in block ``block_table[t // block_size]`` at offset
``t % block_size``.  ``slot_mapping[i] = block_id * block_size + offset`` for new token ``i`` (or
-1 for a padding token, whose K/V must not be stored).  Block 0 is the null block: block tables are
padded with 0 and sliding-window groups hold 0 where blocks left the window.

For sequence ``s``: its queries are the last ``q_len_s = cu_seqlens_q[s+1] - cu_seqlens_q[s]``
positions of its ``seq_len_s = seq_lens[s]`` tokens, i.e. query ``j`` sits at absolute position
``seq_len_s - q_len_s + j`` and attends causally to keys ``[max(0, p - window + 1), p]``
(``window=None``: all of ``[0, p]``).

Scores are ``scale * q.k``; with ``softcap`` (logit soft-capping, Gemma-2) they become
``softcap * tanh(scale * q.k / softcap)`` before masking and softmax (``None``: no capping).
Any GQA ratio ``num_heads / num_kv_heads`` (an integer) and any head_dim are accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass
class GroupMetadata:
    """Per KV-cache group: where new tokens are stored and where each sequence's pages are."""

    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 for padding
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0


@dataclass
class AttentionMetadata:
    """Everything a backend needs for one step (shared by all layers)."""

    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32: offsets of each sequence's new tokens
    seq_lens: torch.Tensor  # [num_seqs] int32: tokens of each sequence incl. the new ones
    max_seqlen_q: int
    max_seqlen_k: int
    groups: list[GroupMetadata]
    # Host copies, for backends and kernels that need Python ints (launch grids, reference loops).
    seq_lens_cpu: list[int]
    query_lens_cpu: list[int]
    # Values a backend derives once per step and every layer reuses (e.g. the Triton prefill
    # kernel's tile schedule), so layers do not each rebuild them or copy them to the device.
    scratch: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_seqlen_q == 1

    @property
    def cu_seqlens_k(self) -> torch.Tensor:
        """[num_seqs + 1] int32 offsets of each sequence's full KV (cached + new)."""
        out = torch.zeros(len(self.seq_lens_cpu) + 1, dtype=torch.int32,
                          device=self.seq_lens.device)
        out[1:] = torch.cumsum(self.seq_lens, 0)
        return out


class AttentionBackend(Protocol):
    """Stores the step's new K/V into the paged cache, then attends."""

    name: str

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        group_id: int,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...
