"""Turn one scheduler step into model inputs.

For the scheduled requests (each computing ``num_new_tokens`` tokens after
``num_computed_tokens``) this builds, without per-token Python loops:

    input_ids, positions          [num_tokens]            the new tokens, packed by sequence
    slot_mapping (per group)      [num_tokens]            block_id * block_size + offset
    block_tables (per group)      [num_seqs, max_blocks]  padded with 0 (the null block)
    cu_seqlens_q, seq_lens        [num_seqs + 1], [num_seqs]
    sample_indices                [num_sampling]          last token of each sampling sequence
    fill_dst, fill_src            [num_placeholders]      async scheduling (below)

Two ways in:

* :func:`prepare_batch` (stateless): reads each request's full block table from the KV-cache
  manager and makes fresh tensors.  For tests, tools and tensor-parallel broadcasts.
* :class:`BatchBuilder` (the engine's): keeps append-only block tables per request (kvcore's
  ``new_block_ids``, as vLLM's workers do), and on a GPU writes every array of the step into one
  pinned host buffer reused across steps (:class:`StagingBuffer`) that reaches the device in a
  single ``non_blocking`` copy.  No pageable copy, no host wait for the GPU.

Async scheduling: a position whose token is still in flight (sampled by the previous step, not
reported yet; see :mod:`kvcore.scheduler`) is staged as -1 and listed in ``fill_dst``, with the
row of the previous step's sampled tokens in ``fill_src``; :meth:`PreparedBatch.fill` copies
them on the device before the forward.  ``in_flight`` (request id -> that row) says which rows
the previous step sampled; a placeholder it does not cover is an error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
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
    # Placeholder positions (async scheduling): input_ids[fill_dst] = previous[fill_src].
    fill_dst: torch.Tensor | None = None
    fill_src: torch.Tensor | None = None

    def fill(self, previous: torch.Tensor | None) -> None:
        """Write the in-flight tokens into ``input_ids`` (on the device, no wait):
        ``previous`` is the previous step's sampled tokens (device)."""
        if self.fill_dst is None:
            return
        if previous is None:
            raise RuntimeError("this step has placeholder tokens but no step is in flight")
        dst, src = self.fill_dst, self.fill_src
        assert src is not None
        self.inputs.input_ids.index_copy_(0, dst, previous.index_select(0, src))

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

class _Buffers:
    """One host (pinned on CUDA) and one device byte buffer, and the event of the last copy
    between them."""

    __slots__ = ("dev", "event", "host", "host_np", "pending")

    def __init__(self, nbytes: int, device: torch.device, pinned: bool) -> None:
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        self.host_np: np.ndarray = self.host.numpy()
        self.dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.event: Any = torch.cuda.Event() if pinned else None
        self.pending = False  # a copy from ``host`` may still be running

    def wait(self) -> None:
        """Return once the last copy out of ``host`` has completed (normally it has)."""
        if self.pending:
            if not self.event.query():
                self.event.synchronize()
            self.pending = False


class StagingBuffer:
    """Small per-step arrays, written on the host and sent to ``device`` in one copy.

    Reusing (the default on CUDA): two pairs of byte buffers, host (pinned on CUDA) and device,
    used in turn.  :meth:`begin` starts a step on the next pair, :meth:`array` hands out numpy
    views into its host buffer (fill them in place), :meth:`upload` copies the used bytes at
    once (``non_blocking=True`` from pinned memory) and returns device views at the same
    offsets.  Reuse is safe: :meth:`begin` first makes sure the copy out of that host buffer two
    steps back has completed (an event; it has, unless the device is two steps behind), so
    staging step N+1 never waits for step N's copy (async scheduling stages it while step N
    runs); a device buffer is only overwritten by a copy queued after the kernels that read
    it, on the same stream.  The views are valid until the next :meth:`upload` but one.

    Not reusing (the default elsewhere): plain numpy arrays turned into tensors with
    ``torch.from_numpy(...).to(device)``; the tensors never alias a reused buffer.
    """

    def __init__(self, device: torch.device | str, nbytes: int = 1 << 16,
                 reuse: bool | None = None) -> None:
        self.device = torch.device(device)
        cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self.reuse = cuda if reuse is None else reuse
        self.pinned = self.reuse and cuda
        self._pairs: list[_Buffers | None] = [None, None]
        self._turn = 0
        self._used = 0
        self._views: list[tuple[int, tuple[int, ...], np.dtype[Any]]] = []
        self._plain: list[np.ndarray] = []
        if self.reuse:
            for turn in (1, 0):
                self._turn = turn
                self._allocate(nbytes)

    @property
    def capacity(self) -> int:
        pair = self._pairs[self._turn]
        return 0 if pair is None else int(pair.host.numel())

    def _allocate(self, nbytes: int) -> None:
        """(Re)allocate the current pair of buffers."""
        nbytes = -(-max(nbytes, _ALIGN) // _ALIGN) * _ALIGN
        old = self._pairs[self._turn]
        if old is not None:
            old.wait()  # its last copy must not read freed memory
        self._pairs[self._turn] = _Buffers(nbytes, self.device, self.pinned)

    @staticmethod
    def nbytes_for(arrays: Iterable[np.ndarray]) -> int:
        """A :meth:`begin` bound for arrays like these."""
        return sum(a.nbytes + _ALIGN for a in arrays)

    def begin(self, nbytes: int = 0) -> None:
        """Start a step's arrays; ``nbytes``: an upper bound of what they need (the buffers
        grow to it; :meth:`array` can grow them too, but only for the step's first array)."""
        self._used = 0
        self._views = []
        self._plain = []
        if not self.reuse:
            return
        self._turn ^= 1
        pair = self._pairs[self._turn]
        assert pair is not None
        pair.wait()  # the copy two steps back must be done with this host buffer
        if nbytes > self.capacity:
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
        pair = self._pairs[self._turn]
        assert pair is not None
        return pair.host_np[start:start + n].view(dt).reshape(shp)

    def upload(self) -> list[torch.Tensor]:
        """Device tensors of this step's arrays, in :meth:`array` order."""
        if not self.reuse:
            return [torch.from_numpy(a).to(self.device) for a in self._plain]
        pair = self._pairs[self._turn]
        assert pair is not None
        used = self._used
        if used:
            pair.dev[:used].copy_(pair.host[:used], non_blocking=self.pinned)
            if pair.event is not None:
                pair.event.record()
                pair.pending = True
        out = []
        for start, shp, dt in self._views:
            n = int(np.prod(shp, dtype=np.int64)) * dt.itemsize
            out.append(pair.dev[start:start + n].view(_TORCH_DTYPES[dt]).view(shp))
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
    """An upper bound of what :func:`_build` stages (each array rounded up to the alignment;
    at most one placeholder per sequence)."""
    pad = _ALIGN
    per_step = (2 * (8 * num_tokens + pad) + 2 * (4 * (num_seqs + 1) + pad)
                + 8 * num_sampling + pad + 2 * (8 * num_seqs + pad))
    return per_step + num_groups * (8 * num_tokens + 4 * num_seqs * width + 2 * pad)


def _token_ids(s: ScheduledRequest) -> list[int]:
    """``s``'s token ids, -1 where one is still in flight (async scheduling)."""
    ids = s.token_ids
    missing = s.num_new_tokens - len(ids)
    return ids + [-1] * missing if missing else ids


def _build(scheduled: Sequence[ScheduledRequest], num_groups: int, block_size: int,
           staging: StagingBuffer, tables_for: Callable[[int, np.ndarray], np.ndarray],
           in_flight: Mapping[str, int] | None = None) -> PreparedBatch:
    """Every array of the step, written into ``staging`` and uploaded at once.
    ``tables_for(group, seq_lens)`` gives the step's [num_seqs, width] block table of a group;
    ``in_flight``: see the module docstring."""
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
        ids[:] = [t[n] if n < len(t) else -1 for t, n in
                  ((s.request.all_token_ids, s.num_computed_tokens) for s in scheduled)]
        positions[:] = starts
        seq_idx = None
    else:
        ids[:] = list(chain.from_iterable(_token_ids(s) for s in scheduled))
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
    holes = np.flatnonzero(ids < 0)
    if len(holes):
        seqs = holes if seq_idx is None else seq_idx[holes]
        rids = [scheduled[i].request_id for i in seqs.tolist()]
        src = [-1 if in_flight is None else in_flight.get(rid, -1) for rid in rids]
        if -1 in src:
            rid = rids[src.index(-1)]
            raise RuntimeError(f"request {rid!r} has a token in flight that no in-flight step "
                               "sampled")
        ids[holes] = 0  # (overwritten by fill before the forward)
        staging.array(len(holes), np.int64)[:] = holes
        staging.array(len(holes), np.int64)[:] = src

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
    fill = dev[5 + 2 * num_groups:] if len(holes) else (None, None)
    return PreparedBatch(ModelInputs(d_ids, d_pos, meta), d_sample, sampling,
                         sample_all=decode_only and len(sampling) == num_seqs,
                         fill_dst=fill[0], fill_src=fill[1])


def _pad_rows(rows: Sequence[Sequence[int]], num_blocks: np.ndarray) -> np.ndarray:
    width = max(int(num_blocks.max()) if len(rows) else 0, 1)
    out = np.zeros((len(rows), width), dtype=np.int32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


def prepare_batch(scheduled: Sequence[ScheduledRequest], num_groups: int, block_size: int,
                  device: torch.device | str = "cpu",
                  in_flight: Mapping[str, int] | None = None) -> PreparedBatch:
    """Model inputs for ``scheduled``, from each request's full block table (stateless; fresh
    tensors that alias nothing)."""
    full = [s.block_ids for s in scheduled]

    def tables_for(g: int, seq_lens: np.ndarray) -> np.ndarray:
        return _pad_rows([f[g] for f in full], np.array([len(f[g]) for f in full] or [1]))

    return _build(scheduled, num_groups, block_size, StagingBuffer(device, reuse=False),
                  tables_for, in_flight)


class BatchBuilder:
    """The engine's :func:`prepare_batch`: append-only block tables kept across steps, and (on
    CUDA) the step's arrays staged in a reused pinned buffer sent in one ``non_blocking`` copy.

    ``max_num_batched_tokens``, ``max_num_seqs`` and ``max_model_len`` size the buffers once
    (they grow if a step ever needs more).  ``reuse``: see :class:`StagingBuffer`; when reusing,
    a step's tensors are valid until the next :meth:`prepare` but one."""

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

    def prepare(self, out: SchedulerOutput, in_flight: Mapping[str, int] | None = None
                ) -> PreparedBatch:
        """The step's inputs (``in_flight``: see the module docstring)."""
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

        return _build(scheduled, self.num_groups, bs, self.staging, tables_for, in_flight)


__all__ = ["BatchBuilder", "BlockTables", "ModelInputs", "PreparedBatch", "StagingBuffer",
           "prepare_batch"]
