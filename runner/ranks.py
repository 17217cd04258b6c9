"""Ranks of an engine: building a rank's model runner, and the tensor-parallel worker processes.

Rank 0 is the engine's own process; ranks 1..N-1 are spawned processes (:func:`worker_main`)
that build their shard of the model and then run every forward whose inputs rank 0 broadcasts;
NCCL on GPU, gloo on CPU.  :class:`Workers` is rank 0's side of them: it starts them, sends each
step's inputs, notices a worker that died (then it shuts the others down, so a dead rank never
leaves the engine waiting in a collective for ever) and stops them.  A worker ends with rank 0's
process however that ends, SIGKILL included (:func:`kvcore.proc.lifeline.die_with_parent`).

Every rank runs on this machine, so what they listen on is loopback: rank 0's rendezvous store
(:class:`torch.distributed.TCPStore`) serves on a socket rank 0 bound to 127.0.0.1
(:func:`store_listener`), and gloo's connections use the loopback interface unless
``GLOO_SOCKET_IFNAME`` says otherwise.  NCCL (GPU) chooses its own bootstrap interface
(``NCCL_SOCKET_IFNAME``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvcore.proc.lifeline import die_with_parent
from kvcore.specs import KVCacheConfig
from runner.attention import get_backend
from runner.config import EngineConfig
from runner.distributed import TPGroup
from runner.errors import EngineDeadError
from runner.kv_cache import KVCacheLayout
from runner.model_runner import ModelRunner
from runner.models import build_model, load_config
from runner.models.weights import iter_safetensors
from runner.sampler import Sampler, SamplingParams
from runner.threads import apply_cpu_threads

_log = logging.getLogger(__name__)

@dataclass
class RankSpec:
    """Everything a rank needs to build its model shard (picklable)."""

    model: Any  # a local path or a transformers config
    config: EngineConfig
    kv_groups: Any
    max_model_len: int
    device: str
    dtype: torch.dtype
    port: int = 0
    cpu_threads: int | None = None  # torch's intra-op threads on a CPU rank (None: as it is)


def build_runner(spec: RankSpec, tp: TPGroup) -> ModelRunner:
    """This rank's model shard over its KV memory (profiled on GPU), with decode graphs."""
    cfg = load_config(spec.model)
    device = torch.device(spec.device)
    kv_config = KVCacheConfig(2, spec.kv_groups)
    layout = KVCacheLayout.from_config(kv_config, cfg.num_hidden_layers)
    weights = iter_safetensors(spec.model) if isinstance(spec.model, (str, Path)) else None
    model = build_model(cfg, tp=tp, dtype=spec.dtype, device=device,
                        layer_to_kv_group=list(layout.layer_to_group),
                        max_positions=spec.max_model_len, weights=weights, seed=spec.config.seed)
    runner = ModelRunner(model, layout, len(spec.kv_groups), get_backend(spec.config.backend),
                         device=device, dtype=spec.dtype, tp=tp)
    c = spec.config
    if c.num_blocks is not None:
        num_blocks = c.num_blocks
    elif device.type == "cuda":
        num_blocks = runner.profile_num_blocks(c.max_num_batched_tokens, spec.max_model_len,
                                               c.max_num_seqs, c.gpu_memory_utilization,
                                               sample=_profile_sampling(device))
    else:
        num_blocks = c.kv_cache_memory_bytes // runner.block_bytes()
        if num_blocks < 2:
            raise ValueError(f"kv_cache_memory_bytes={c.kv_cache_memory_bytes} holds no blocks "
                             f"({runner.block_bytes()} bytes each)")
    runner.allocate(num_blocks)
    if device.type == "cuda" and not c.enforce_eager:
        try:
            runner.capture_decode_graphs(c.max_num_seqs, spec.max_model_len,
                                         c.max_graph_batch_size)
        except Exception as exc:  # keep serving, eagerly, and say why
            runner.drop_graphs()
            _log.warning("CUDA-graph capture failed (%s: %s); decoding eagerly",
                         type(exc).__name__, exc)
    return runner


def _profile_sampling(device: torch.device) -> Any:
    """Sampling as a step does it (full-vocabulary noise for every row), for memory profiling."""
    def sample(logits: torch.Tensor) -> None:
        n = logits.shape[0]
        Sampler(0, device)(logits, [SamplingParams(temperature=1.0)] * n,
                           [str(i) for i in range(n)])
    return sample


LOOPBACK = "127.0.0.1"


def store_listener() -> socket.socket:
    """Rank 0's listening socket for the rendezvous store: loopback, a port the OS chose (the
    ranks' :attr:`RankSpec.port`)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((LOOPBACK, 0))
        sock.listen()
    except BaseException:
        sock.close()
        raise
    return sock


@contextlib.contextmanager
def _loopback_gloo() -> Iterator[None]:
    """``GLOO_SOCKET_IFNAME`` set to the loopback interface while gloo starts, unless the user
    set it (gloo otherwise listens on the address the host name resolves to)."""
    names = {name for _, name in socket.if_nameindex()} if hasattr(socket, "if_nameindex") \
        else set()
    loopback = next((n for n in ("lo", "lo0") if n in names), None)
    if "GLOO_SOCKET_IFNAME" in os.environ or loopback is None:
        yield
        return
    os.environ["GLOO_SOCKET_IFNAME"] = loopback
    try:
        yield
    finally:
        os.environ.pop("GLOO_SOCKET_IFNAME", None)


def init_distributed(rank: int, world: int, port: int, device: str,
                     listener: socket.socket | None = None) -> TPGroup:
    """Join the tensor-parallel group: rank 0 serves the rendezvous store on ``listener`` (from
    :func:`store_listener`; the store takes it over), the other ranks reach it on
    127.0.0.1:``port``."""
    if (rank == 0) != (listener is not None):
        raise ValueError("rank 0, and only rank 0, serves the store on its listener")
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if device.startswith("cuda"):
        torch.cuda.set_device(rank)
    store = dist.TCPStore(LOOPBACK, port, world, is_master=rank == 0,
                          master_listen_fd=listener.detach() if listener is not None else None)
    with _loopback_gloo() if backend == "gloo" else contextlib.nullcontext():
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    return TPGroup(rank, world, None)


def worker_main(rank: int, spec: RankSpec, parent_pid: int | None = None,
                from_main_thread: bool = True) -> None:
    """Ranks >= 1: build the shard, then run each forward rank 0 broadcasts (None: stop).
    With ``parent_pid`` (rank 0's process, which started it), the worker ends when it ends."""
    if parent_pid is not None:
        die_with_parent(parent_pid, from_main_thread)
    device = f"cuda:{rank}" if spec.device.startswith("cuda") else "cpu"
    spec = replace(spec, device=device)
    if device == "cpu":
        apply_cpu_threads(spec.cpu_threads)
    tp = init_distributed(rank, spec.config.tensor_parallel_size, spec.port, device)
    try:
        runner = build_runner(spec, tp)
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0)
            if box[0] is None:
                break
            runner.forward(box[0].to(runner.device))
    finally:
        dist.destroy_process_group()
    # Stopped cleanly: skip interpreter finalisation, whose C++ static destructors (c10d / gloo
    # threads) can abort a spawn child at exit with "terminate called without an active
    # exception" after all its work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class Workers:
    """Rank 0's handle on the spawned ranks 1..N-1 (empty without tensor parallelism)."""

    def __init__(self) -> None:
        self.procs: list[Any] = []

    def __bool__(self) -> bool:
        return bool(self.procs)

    def start(self, spec: RankSpec) -> None:
        ctx = mp.get_context("spawn")
        from_main_thread = threading.current_thread() is threading.main_thread()
        for rank in range(1, spec.config.tensor_parallel_size):
            proc = ctx.Process(target=worker_main,
                               args=(rank, spec, os.getpid(), from_main_thread), daemon=True)
            proc.start()
            self.procs.append(proc)

    def dead(self) -> str | None:
        """Which worker exited (``None``: all are running)."""
        for rank, proc in enumerate(self.procs, start=1):
            if not proc.is_alive():
                return f"tensor-parallel worker rank {rank} exited (exit code {proc.exitcode})"
        return None

    def check_alive(self) -> None:
        """Raise :class:`EngineDeadError`, after shutting the others down, if a worker died."""
        why = self.dead()
        if why is not None:
            self.stop(clean=False)
            raise EngineDeadError(f"{why}: the tensor-parallel engine is shut down; close it "
                                  "and build a new one")

    def broadcast(self, obj: Any) -> None:
        """Send ``obj`` to every worker (a step's inputs), after checking they are alive."""
        self.check_alive()
        dist.broadcast_object_list([obj], src=0)

    def stop(self, clean: bool) -> None:
        """Stop the workers (idempotent): ask them to (``clean``: they are in step), then
        terminate whichever still runs, and leave the process group."""
        procs, self.procs = self.procs, []
        if not procs:
            return
        if clean and all(p.is_alive() for p in procs):
            dist.broadcast_object_list([None], src=0)
            for proc in procs:
                proc.join(timeout=60)
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=10)
        if dist.is_initialized():
            dist.destroy_process_group()
