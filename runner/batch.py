"""Turn one scheduler step into model inputs.

For the scheduled requests (each computing ``num_new_tokens`` tokens after
``num_computed_tokens``) this builds, without per-token Python loops:

    input_ids, positions          [num_tokens]            the new tokens, packed by sequence
    slot_mapping (per group)      [num_tokens]            block_id * block_size + offset
    block_tables (per group)      [num_seqs, max_blocks]  padded with 0 (the null block)
    cu_seqlens_q, seq_lens        [num_seqs + 1], [num_seqs]
    sample_indices                [num_sampling]          last token of each sampling sequence
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvcore.scheduler import ScheduledRequest
from runner.attention.base import AttentionMetadata, GroupMetadata


@dataclass
class ModelInputs:
    """What every tensor-parallel rank needs for one forward (picklable, broadcast by rank 0)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata

    def to(self, device: torch.device | str) -> ModelInputs:
        groups = [GroupMetadata(g.slot_mapping.to(device), g.block_tables.to(device))
                  for g in self.meta.groups]
        m = self.meta
        meta = AttentionMetadata(m.cu_seqlens_q.to(device), m.seq_lens.to(device),
                                 m.max_seqlen_q, m.max_seqlen_k, groups, m.seq_lens_cpu,
                                 m.query_lens_cpu)
        return ModelInputs(self.input_ids.to(device), self.positions.to(device), meta)


@dataclass
class PreparedBatch:
    inputs: ModelInputs
    sample_indices: torch.Tensor
    sampling: list[ScheduledRequest]  # the sequences that sample, in sample_indices order

    @property
    def input_ids(self) -> torch.Tensor:
        return self.inputs.input_ids

    @property
    def positions(self) -> torch.Tensor:
        return self.inputs.positions

    @property
    def meta(self) -> AttentionMetadata:
        return self.inputs.meta

    @property
    def num_tokens(self) -> int:
        return int(self.inputs.input_ids.shape[0])


def _tables(rows: Sequence[Sequence[int]]) -> np.ndarray:
    width = max((len(r) for r in rows), default=0) or 1
    out = np.zeros((len(rows), width), dtype=np.int32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


def prepare_batch(scheduled: Sequence[ScheduledRequest], num_groups: int, block_size: int,
                  device: torch.device | str = "cpu") -> PreparedBatch:
    num_seqs = len(scheduled)
    q_lens = np.fromiter((s.num_new_tokens for s in scheduled), dtype=np.int64, count=num_seqs)
    starts = np.fromiter((s.num_computed_tokens for s in scheduled), dtype=np.int64,
                         count=num_seqs)
    cu_q = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu_q[1:])
    seq_lens = starts + q_lens
    num_tokens = int(cu_q[-1])

    ids = np.empty(num_tokens, dtype=np.int64)
    for s, lo, hi in zip(scheduled, cu_q[:-1], cu_q[1:]):
        ids[lo:hi] = s.token_ids
    seq_idx = np.repeat(np.arange(num_seqs), q_lens)
    positions = np.arange(num_tokens, dtype=np.int64) - cu_q[:-1][seq_idx] + starts[seq_idx]

    groups = []
    block_of = positions // block_size
    offset = positions % block_size
    all_tables = [s.block_ids for s in scheduled]
    for g in range(num_groups):
        tables = _tables([t[g] for t in all_tables])
        slots = tables[seq_idx, block_of].astype(np.int64) * block_size + offset
        groups.append(GroupMetadata(slot_mapping=torch.from_numpy(slots).to(device),
                                    block_tables=torch.from_numpy(tables).to(device)))

    sampling = [s for s in scheduled if s.samples]
    sample_idx = np.fromiter((cu_q[i + 1] - 1 for i, s in enumerate(scheduled) if s.samples),
                             dtype=np.int64, count=len(sampling))
    meta = AttentionMetadata(
        cu_seqlens_q=torch.from_numpy(cu_q.astype(np.int32)).to(device),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device),
        max_seqlen_q=int(q_lens.max()) if num_seqs else 0,
        max_seqlen_k=int(seq_lens.max()) if num_seqs else 0,
        groups=groups, seq_lens_cpu=seq_lens.tolist(), query_lens_cpu=q_lens.tolist())
    inputs = ModelInputs(torch.from_numpy(ids).to(device), torch.from_numpy(positions).to(device),
                         meta)
    return PreparedBatch(inputs, torch.from_numpy(sample_idx).to(device), sampling)
