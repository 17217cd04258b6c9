"""The host-memory tier's bytes: copies between the runner's paged KV cache and host tensors.

:class:`HostKVTransfer` is the worker side of :class:`kvcore.connector.OffloadingConnector`
(a :class:`kvcore.connector.TransferHandler`).  Host memory mirrors the device layout: one tensor
per KV slot, ``[2, num_host_blocks, block_size, num_kv_heads, head_dim]`` (pinned when the cache
is on a GPU), so a block moves as one slice per slot.

* On a GPU, copies run on a side CUDA stream: a store waits for the compute stream's writes
  (an event recorded after the forward), a load overlaps whatever the compute stream runs next.
  ``poll`` reports a transfer once its event has completed (``event.query()``, no waiting).
  Before each forward (``before_forward``) the compute stream waits for the stores in flight, so
  a block the scheduler reuses is never overwritten while it is being copied out.
* On a CPU, copies are synchronous (``poll`` reports them at once).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcore.connector import TransferHandler, TransferSpec
from kvcore.errors import InvalidArgumentError


class HostKVTransfer(TransferHandler):
    """Copies blocks between ``device_caches`` (the runner's slot tensors) and a host tier of
    ``num_host_blocks`` blocks."""

    def __init__(self, device_caches: Sequence[torch.Tensor], num_host_blocks: int) -> None:
        if type(num_host_blocks) is not int or num_host_blocks < 1:
            raise InvalidArgumentError(
                f"num_host_blocks must be a positive int, got {num_host_blocks!r}")
        self.device_caches = list(device_caches)
        if not self.device_caches:
            raise InvalidArgumentError("no device KV caches to offload")
        dev = self.device_caches[0].device
        self.on_gpu = dev.type == "cuda"
        self.host_caches = [
            torch.empty((c.shape[0], num_host_blocks, *c.shape[2:]), dtype=c.dtype,
                        pin_memory=self.on_gpu)
            for c in self.device_caches]
        self.stream = torch.cuda.Stream(dev) if self.on_gpu else None
        self._stores: list[tuple[int, torch.cuda.Event | None]] = []
        self._loads: list[tuple[str, torch.cuda.Event | None]] = []
        self.bytes_copied = 0

    def _copy(self, dst: list[torch.Tensor], dst_ids: Sequence[int], src: list[torch.Tensor],
              src_ids: Sequence[int]) -> torch.cuda.Event | None:
        def run() -> None:
            for d, s in zip(dst, src, strict=True):
                for a, b in zip(dst_ids, src_ids, strict=True):
                    d[:, a].copy_(s[:, b], non_blocking=self.on_gpu)
                    self.bytes_copied += s[:, b].numel() * s.element_size()

        if self.stream is None:
            run()
            return None
        self.stream.wait_stream(torch.cuda.current_stream())  # the KV it reads is written
        with torch.cuda.stream(self.stream):
            run()
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def load(self, request_id: str, spec: TransferSpec) -> None:
        event = self._copy(self.device_caches, spec.device_block_ids, self.host_caches,
                           spec.host_slots)
        self._loads.append((request_id, event))

    def store(self, job_id: int, spec: TransferSpec) -> None:
        event = self._copy(self.host_caches, spec.host_slots, self.device_caches,
                           spec.device_block_ids)
        self._stores.append((job_id, event))

    def wait_loads(self, request_ids: Sequence[str]) -> None:
        """Synchronous loads: the compute stream waits for the side stream."""
        if self.stream is not None:
            torch.cuda.current_stream().wait_stream(self.stream)

    def before_forward(self) -> None:
        """The compute stream waits for the copies in flight (see the module docstring)."""
        if self.stream is not None and self._stores:
            torch.cuda.current_stream().wait_stream(self.stream)

    def poll(self) -> tuple[set[int], set[str], set[int]]:
        def done(e: torch.cuda.Event | None) -> bool:
            return e is None or e.query()

        stores = {j for j, e in self._stores if done(e)}
        loads = {r for r, e in self._loads if done(e)}
        self._stores = [(j, e) for j, e in self._stores if j not in stores]
        self._loads = [(r, e) for r, e in self._loads if r not in loads]
        return stores, loads, set()
