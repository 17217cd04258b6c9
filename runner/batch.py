"""Turn one scheduler step into model inputs.

For the scheduled requests (each computing ``num_new_tokens`` tokens after
``num_computed_tokens``) this builds, without per-token Python loops:

    input_ids, positions          [num_tokens]            the new tokens, packed by sequence
    slot_mapping (per group)      [num_tokens]            block_id * block_size + offset
    block_tables (per group)      [num_seqs, max_blocks]  padded with 0 (the null block)
    cu_seqlens_q, seq_lens        [num_seqs + 1], [num_seqs]
    sample_indices                [num_sampling]          last token of each sampling sequence

Two ways in:

* :func:`prepare_batch` (stateless): reads each request's full block table from the KV-cache
  manager and makes fresh tensors.  For tests, tools and tensor-parallel broadcasts.
* :class:`BatchBuilder` (the engine's): keeps append-only block tables per request (kvcore's
  ``new_block_ids``, as vLLM's workers do), and on a GPU writes every array of the step into one
  pinned host buffer reused across steps (:class:`StagingBuffer`) that reaches the device in a
  single ``non_blocking`` copy.  No pageable copy, no host wait for the GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np
import torch

from kvcore.scheduler import ScheduledRequest, SchedulerOutput
from runner.attention.base import AttentionMetadata, GroupMetadata

_ALIGN = 64  # bytes: every staged array starts on a 64-byte boundary


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
    # Every token samples (a decode-only step): the hidden states need no gather.
    sample_all: bool = False

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


# -- host -> device staging ----------------------------------------------------------------------

class StagingBuffer:
    """Small per-step arrays, written on the host and sent to ``device`` in one copy.

    Reusing (the default on CUDA): a host byte buffer (pinned on CUDA) and a device byte buffer,
    both reused every step.  :meth:`begin` starts a step, :meth:`array` hands out numpy views
    into the host buffer (fill them in place), :meth:`upload` copies the used bytes at once
    (``non_blocking=True`` from pinned memory) and returns device views at the same offsets.
    Reuse is safe: :meth:`begin` first makes sure the previous upload's copy has completed (an
    event, normally long complete since the engine waits for the sampled tokens every step),
    and the device buffer is only overwritten by a copy queued after the kernels that read it,
    on the same stream.  The views are valid until the next :meth:`upload`.

    Not reusing (the default elsewhere): plain numpy arrays turned into tensors with
    ``torch.from_numpy(...).to(device)``; the tensors never alias a reused buffer.
    """

    def __init__(self, device: torch.device | str, nbytes: int = 1 << 16,
                 reuse: bool | None = None) -> None:
        self.device = torch.device(device)
        cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self.reuse = cuda if reuse is None else reuse
        self.pinned = self.reuse and cuda
        self._host: torch.Tensor | None = None
        self._host_np: np.ndarray | None = None
        self._dev: torch.Tensor | None = None
        self._event: Any = None
        self._pending = False
        self._used = 0
        self._views: list[tuple[int, tuple[int, ...], np.dtype[Any]]] = []
        self._plain: list[np.ndarray] = []
        if self.reuse:
            self._allocate(nbytes)

    @property
    def capacity(self) -> int:
        return 0 if self._host is None else int(self._host.numel())

    def _allocate(self, nbytes: int) -> None:
        nbytes = -(-max(nbytes, _ALIGN) // _ALIGN) * _ALIGN
        self._host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)
        self._host_np = self._host.numpy()
        self._dev = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._event = torch.cuda.Event() if self.pinned else None

    @staticmethod
    def nbytes_for(arrays: Iterable[np.ndarray]) -> int:
        """A :meth:`begin` bound for arrays like these."""
        return sum(a.nbytes + _ALIGN for a in arrays)

    def begin(self, nbytes: int = 0) -> None:
        """Start a step's arrays; ``nbytes``: an upper bound of what they need (the buffers
        grow to it; :meth:`array` can grow them too, but only for the step's first array)."""
        if self._pending:
            if not self._event.query():  # normally already complete: no wait
                self._event.synchronize()  # the previous copy must be done with the buffer
            self._pending = False
        self._used = 0
        self._views = []
        self._plain = []
        if self.reuse and nbytes > self.capacity:
            self._allocate(max(nbytes, 2 * self.capacity))

    def array(self, shape: int | tuple[int, ...], dtype: Any) -> np.ndarray:
        """An uninitialised host array for this step (``np.empty``'s contract)."""
        dt = np.dtype(dtype)
        shp = (shape,) if isinstance(shape, int) else tuple(shape)
        if not self.reuse:
            out = np.empty(shp, dtype=dt)
            self._plain.append(out)
            return out
        n = int(np.prod(shp, dtype=np.int64)) * dt.itemsize
        start = self._used
        end = start + -(-n // _ALIGN) * _ALIGN
        if end > self.capacity:
            if self._views:
                raise RuntimeError("StagingBuffer: begin() was given too small a bound")
            self._allocate(max(end, 2 * self.capacity))
        self._used = end
        self._views.append((start, shp, dt))
        assert self._host_np is not None
        return self._host_np[start:start + n].view(dt).reshape(shp)

    def upload(self) -> list[torch.Tensor]:
        """Device tensors of this step's arrays, in :meth:`array` order."""
        if not self.reuse:
            return [torch.from_numpy(a).to(self.device) for a in self._plain]
        assert self._host is not None and self._dev is not None
        used = self._used
        if used:
            self._dev[:used].copy_(self._host[:used], non_blocking=self.pinned)
            if self._event is not None:
                self._event.record()
                self._pending = True
        out = []
        for start, shp, dt in self._views:
            n = int(np.prod(shp, dtype=np.int64)) * dt.itemsize
            out.append(self._dev[start:start + n].view(_TORCH_DTYPES[dt]).view(shp))
        return out


_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32,
                 np.dtype(np.float32): torch.float32, np.dtype(np.bool_): torch.bool,
                 np.dtype(np.float64): torch.float64}


# -- block tables ---------------------------------------------------------------------------------

class BlockTables:
    """Append-only block tables per request for one KV-cache group.

    A request's row is (re)built from its full table when it is new to this builder (admitted,
    resumed after preemption, or unknown), then extended with each step's ``new_block_ids``.
    Sliding-window positions that the manager nulled keep their stale ids here; attention never
    reads positions left of a window.  A row whose length disagrees with the step's token count
    (``ceil(seq_len / block_size)`` blocks) is rebuilt from the manager, so a missed step can
    never leave a wrong table behind."""

    def __init__(self, max_blocks: int, rows: int = 64) -> None:
        self.width = max(1, max_blocks)
        self.table = np.zeros((max(1, rows), self.width), dtype=np.int32)
        self.lengths = np.zeros(max(1, rows), dtype=np.int64)
        self.row_of: dict[str, int] = {}
        self._free = list(range(self.table.shape[0] - 1, -1, -1))

    def release(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            row = self.row_of.pop(rid, None)
            if row is not None:
                self._free.append(row)

    def _new_row(self, rid: str) -> int:
        if not self._free:
            old = self.table.shape[0]
            self.table = np.concatenate([self.table, np.zeros_like(self.table)])
            self.lengths = np.concatenate([self.lengths, np.zeros_like(self.lengths)])
            self._free = list(range(2 * old - 1, old - 1, -1))
        row = self._free.pop()
        self.row_of[rid] = row
        return row

    def _set(self, row: int, ids: Sequence[int]) -> None:
        n = len(ids)
        if n > self.width:
            self._widen(n)
        self.table[row, :n] = ids
        self.table[row, n:] = 0  # a reused row: no stale ids past the end
        self.lengths[row] = n

    def _widen(self, n: int) -> None:
        wide = np.zeros((self.table.shape[0], max(n, 2 * self.width)), dtype=np.int32)
        wide[:, :self.width] = self.table
        self.table, self.width = wide, wide.shape[1]

    def update(self, s: ScheduledRequest, group: int, num_blocks: int,
               full: dict[str, tuple[list[int], ...]]) -> int:
        """Bring ``s``'s row up to date (``num_blocks``: what it must hold now); its row.
        ``full`` memoises the manager's full tables within a step (shared by the groups)."""
        rid = s.request_id
        row = self.row_of.get(rid)
        if row is None or s.is_new:
            if row is None:
                row = self._new_row(rid)
            self._set(row, _full_table(s, full)[group])
        else:
            new = s.new_block_ids[group]
            if new:
                n = int(self.lengths[row])
                end = n + len(new)
                if end > self.width:
                    self._widen(end)
                self.table[row, n:end] = new
                self.lengths[row] = end
        if self.lengths[row] != num_blocks:  # out of step with the manager: rebuild
            self._set(row, _full_table(s, full)[group])
        return row


def _full_table(s: ScheduledRequest, memo: dict[str, tuple[list[int], ...]]
                ) -> tuple[list[int], ...]:
    ids = memo.get(s.request_id)
    if ids is None:
        ids = memo[s.request_id] = s.block_ids
    return ids


# -- building a step -------------------------------------------------------------------------------

def _staged_bytes(num_tokens: int, num_seqs: int, num_sampling: int, num_groups: int,
                  width: int) -> int:
    """An upper bound of what :func:`_build` stages (each array rounded up to the alignment)."""
    pad = _ALIGN
    per_step = 2 * (8 * num_tokens + pad) + 2 * (4 * (num_seqs + 1) + pad) + 8 * num_sampling + pad
    return per_step + num_groups * (8 * num_tokens + 4 * num_seqs * width + 2 * pad)


def _build(scheduled: Sequence[ScheduledRequest], num_groups: int, block_size: int,
           staging: StagingBuffer, tables_for: Callable[[int, np.ndarray], np.ndarray]
           ) -> PreparedBatch:
    """Every array of the step, written into ``staging`` and uploaded at once.
    ``tables_for(group, seq_lens)`` gives the step's [num_seqs, width] block table of a group."""
    num_seqs = len(scheduled)
    q_lens = np.fromiter((s.num_new_tokens for s in scheduled), dtype=np.int64, count=num_seqs)
    starts = np.fromiter((s.num_computed_tokens for s in scheduled), dtype=np.int64,
                         count=num_seqs)
    seq_lens = starts + q_lens
    num_tokens = int(q_lens.sum())
    decode_only = num_tokens == num_seqs  # every sequence computes exactly one token
    tables = [tables_for(g, seq_lens) for g in range(num_groups)]
    sampling = [s for s in scheduled if s.samples]
    width = max((t.shape[1] for t in tables), default=1)
    staging.begin(_staged_bytes(num_tokens, num_seqs, len(sampling), num_groups, width))

    cu_q = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu_q[1:])
    ids = staging.array(num_tokens, np.int64)
    positions = staging.array(num_tokens, np.int64)
    if decode_only:
        ids[:] = [s.request.all_token_ids[s.num_computed_tokens] for s in scheduled]
        positions[:] = starts
        seq_idx = None
    else:
        ids[:] = list(chain.from_iterable(s.token_ids for s in scheduled))
        seq_idx = np.repeat(np.arange(num_seqs), q_lens)
        np.add(np.arange(num_tokens, dtype=np.int64), (starts - cu_q[:-1])[seq_idx],
               out=positions)
    block_of = positions // block_size
    offset = positions % block_size
    slot_arrays = []
    table_arrays = []
    for g in range(num_groups):
        t = tables[g]
        staged_t = staging.array(t.shape, np.int32)
        staged_t[...] = t
        rows = np.arange(num_seqs) if seq_idx is None else seq_idx
        slots = staging.array(num_tokens, np.int64)
        np.multiply(t[rows, block_of], block_size, out=slots, dtype=np.int64)
        slots += offset
        slot_arrays.append(slots)
        table_arrays.append(staged_t)
    cu32 = staging.array(num_seqs + 1, np.int32)
    cu32[:] = cu_q
    lens32 = staging.array(num_seqs, np.int32)
    lens32[:] = seq_lens
    sample_idx = staging.array(len(sampling), np.int64)
    if len(sampling) == num_seqs:
        sample_idx[:] = cu_q[1:] - 1
    else:
        sample_idx[:] = [cu_q[i + 1] - 1 for i, s in enumerate(scheduled) if s.samples]

    dev = staging.upload()
    d_ids, d_pos = dev[0], dev[1]
    groups = [GroupMetadata(slot_mapping=dev[3 + 2 * g], block_tables=dev[2 + 2 * g])
              for g in range(num_groups)]
    d_cu, d_lens, d_sample = dev[2 + 2 * num_groups:5 + 2 * num_groups]
    meta = AttentionMetadata(
        cu_seqlens_q=d_cu, seq_lens=d_lens,
        max_seqlen_q=int(q_lens.max()) if num_seqs else 0,
        max_seqlen_k=int(seq_lens.max()) if num_seqs else 0,
        groups=groups, seq_lens_cpu=seq_lens.tolist(), query_lens_cpu=q_lens.tolist())
    return PreparedBatch(ModelInputs(d_ids, d_pos, meta), d_sample, sampling,
                         sample_all=decode_only and len(sampling) == num_seqs)


def _pad_rows(rows: Sequence[Sequence[int]], num_blocks: np.ndarray) -> np.ndarray:
    width = max(int(num_blocks.max()) if len(rows) else 0, 1)
    out = np.zeros((len(rows), width), dtype=np.int32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


def prepare_batch(scheduled: Sequence[ScheduledRequest], num_groups: int, block_size: int,
                  device: torch.device | str = "cpu") -> PreparedBatch:
    """Model inputs for ``scheduled``, from each request's full block table (stateless; fresh
    tensors that alias nothing)."""
    full = [s.block_ids for s in scheduled]

    def tables_for(g: int, seq_lens: np.ndarray) -> np.ndarray:
        return _pad_rows([f[g] for f in full], np.array([len(f[g]) for f in full] or [1]))

    return _build(scheduled, num_groups, block_size, StagingBuffer(device, reuse=False),
                  tables_for)


class BatchBuilder:
    """The engine's :func:`prepare_batch`: append-only block tables kept across steps, and (on
    CUDA) the step's arrays staged in a reused pinned buffer sent in one ``non_blocking`` copy.

    ``max_num_batched_tokens``, ``max_num_seqs`` and ``max_model_len`` size the buffers once
    (they grow if a step ever needs more).  ``reuse``: see :class:`StagingBuffer`; when reusing,
    a step's tensors are valid until the next :meth:`prepare`."""

    def __init__(self, num_groups: int, block_size: int, device: torch.device | str, *,
                 max_num_batched_tokens: int = 2048, max_num_seqs: int = 64,
                 max_model_len: int = 2048, reuse: bool | None = None) -> None:
        self.num_groups = num_groups
        self.block_size = block_size
        self.device = torch.device(device)
        max_blocks = -(-max_model_len // block_size)
        self.tables = [BlockTables(max_blocks, rows=2 * max_num_seqs) for _ in range(num_groups)]
        self.max_rows = 4 * max_num_seqs
        nbytes = _staged_bytes(max_num_batched_tokens, max_num_seqs, max_num_seqs, num_groups,
                               max_blocks)
        self.staging = StagingBuffer(self.device, nbytes, reuse=reuse)

    def release(self, request_ids: Iterable[str]) -> None:
        """Forget requests (finished, aborted or preempted): their rows are reused."""
        ids = list(request_ids)
        for t in self.tables:
            t.release(ids)

    def release_finished(self, out: SchedulerOutput) -> None:
        """Forget the requests ``out`` reports finished, aborted or preempted (done by
        :meth:`prepare`; call it for a step that is not prepared)."""
        self.release(chain(out.finished_request_ids, out.preempted_request_ids))

    def prepare(self, out: SchedulerOutput) -> PreparedBatch:
        self.release_finished(out)
        scheduled = out.scheduled
        for t in self.tables:  # requests never reported finished (cannot happen): bound memory
            if len(t.row_of) > self.max_rows:
                live = {s.request_id for s in scheduled}
                t.release([rid for rid in list(t.row_of) if rid not in live])
        bs = self.block_size
        memo: dict[str, tuple[list[int], ...]] = {}

        def tables_for(g: int, seq_lens: np.ndarray) -> np.ndarray:
            t = self.tables[g]
            need = (seq_lens + bs - 1) // bs
            update = t.update
            rows = np.fromiter((update(s, g, n, memo) for s, n in zip(scheduled, need.tolist())),
                               dtype=np.int64, count=len(scheduled))
            width = max(int(need.max()) if len(need) else 0, 1)
            return t.table[rows, :width]

        return _build(scheduled, self.num_groups, bs, self.staging, tables_for)


__all__ = ["BatchBuilder", "BlockTables", "ModelInputs", "PreparedBatch", "StagingBuffer",
           "prepare_batch"]
