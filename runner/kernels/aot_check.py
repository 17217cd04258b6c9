"""Compile the attention kernels for an H100 (sm_90a) on a machine without a GPU.

``python -m runner.kernels.aot_check [--quick]`` lowers each kernel variant the Triton backend
launches (dtype x head_dim x GQA, including ratios that are not powers of two, and logit
soft-capping) through Triton's real NVIDIA pipeline and its bundled ``ptxas``, with a stand-in
driver that reports an sm_90 target so nothing is launched.  It prints shared memory,
registers, spilled bytes and the MMA instructions used, and exits 1 if a variant fails to
compile, spills registers or needs more shared memory than an H100 block may use
(2: ``TRITON_INTERPRET`` is set; 3: this Triton lacks the internals used).  Head dims that are
multiples of 16 (80, 96) compile to the same kernel as the next power of two (head_dim is a
runtime argument; the tile is ``next_power_of_2(head_dim)`` wide).

It checks what the CPU interpreter cannot (compile-time constraints, register pressure), not
speed or numerics.  It relies on Triton internals (``driver.set_active``,
``JITFunction.warmup``, ``get_ptxas``).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from kvcore.proc.lifeline import guarded

H100_MAX_SHARED_BYTES = 227 * 1024
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class _Sm90Driver:
    """Just enough of a Triton driver for ``JITFunction.warmup`` to compile for sm_90."""

    def __init__(self) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", 90, 32)

    def get_current_target(self) -> Any:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def is_active(self) -> bool:
        return True


def _ptxas_stats(ptx: str) -> tuple[int, int]:
    """(registers, spill-store bytes) that Triton's sm_90 ptxas reports for ``ptx``."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        proc = subprocess.run(guarded([get_ptxas(90).path, "-arch=sm_90a", "-v", f.name, "-o",
                                       os.devnull]), capture_output=True, text=True, check=True)
    finally:
        os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", proc.stderr)
    spills = re.search(r"(\d+) bytes spill stores", proc.stderr)
    return int(regs.group(1)) if regs else -1, int(spills.group(1)) if spills else -1


def _variants(quick: bool) -> list[tuple[str, Callable[[], Any]]]:
    import triton

    from runner.kernels import attention as A

    def args(dt: torch.dtype, gqa: int, head_dim: int) -> tuple[torch.Tensor, ...]:
        q = torch.empty(64, 8 * gqa, head_dim, dtype=dt)
        cache = torch.empty(2, 10, 16, 8, head_dim, dtype=dt)
        return q, cache, torch.empty(4, 8, dtype=torch.int32), torch.empty(8, dtype=torch.int32)

    def prefill(dt: torch.dtype, head_dim: int, gqa: int, softcap: float | None = None) -> Any:
        q, cache, bt, i32 = args(dt, gqa, head_dim)
        tiles = A._tile_sizes(head_dim, gqa, dt)
        scale_log2, softcap_log2 = A._score_scales(0.1, softcap)
        return A._prefill_kernel.warmup(
            q, cache, bt, i32, i32, i32, i32, q, q.stride(0), q.stride(1), q.stride(0),
            q.stride(1), cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3),
            bt.stride(0), scale_log2, 16, 8, head_dim, G=gqa, BLOCK_M=tiles.block_m,
            ROWS=tiles.rows, BLOCK_N=tiles.block_n, BLOCK_D=tiles.block_d,
            IEEE=dt == torch.float32, SOFTCAP_LOG2=softcap_log2, grid=(1,))

    def decode(dt: torch.dtype, head_dim: int, gqa: int, softcap: float | None = None,
               split: bool = True) -> Any:
        q, cache, bt, i32 = args(dt, gqa, head_dim)
        f32 = torch.empty(64, dtype=torch.float32)
        bd = max(16, triton.next_power_of_2(head_dim))
        scale_log2, softcap_log2 = A._score_scales(0.1, softcap)
        return A._decode_kernel.warmup(
            q, cache, bt, i32, f32, f32, q.stride(0), q.stride(1), cache.stride(0),
            cache.stride(1), cache.stride(2), cache.stride(3), bt.stride(0), 64, 64, 1, 64, 8,
            scale_log2, 16, 8, head_dim, 8 * gqa, G=gqa,
            BLOCK_H=max(16, triton.next_power_of_2(gqa)), BLOCK_N=A._decode_block_n(bd, dt),
            BLOCK_D=bd, IEEE=dt == torch.float32, SOFTCAP_LOG2=softcap_log2, SPLIT=split,
            grid=(1,))

    def combine(head_dim: int) -> Any:
        f32 = torch.empty(64, dtype=torch.float32)
        out = torch.empty(4, 8, head_dim, dtype=torch.bfloat16)
        return A._combine_kernel.warmup(f32, f32, out, 64, 64, 1, 64, 8, out.stride(0),
                                        out.stride(1), head_dim, NUM_SPLITS=8, BLOCK_S=8,
                                        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
                                        grid=(1,))

    def store(dt: torch.dtype, head_dim: int) -> Any:
        src = torch.empty(64, 8 * head_dim, dtype=dt)
        cache = torch.empty(2, 10, 16, 8, head_dim, dtype=dt)
        return A._store_kv_kernel.warmup(src, src, cache, torch.empty(64, dtype=torch.int64),
                                         src.stride(0), src.stride(0), cache.stride(0),
                                         cache.stride(1), cache.stride(2), 16, HD=8 * head_dim,
                                         BLOCK_HD=triton.next_power_of_2(8 * head_dim),
                                         grid=(1,))

    out: list[tuple[str, Callable[[], Any]]] = []
    for name in (["bf16", "fp32"] if quick else ["bf16", "fp16", "fp32"]):
        # GQA 3, 7, 12: tiles padded to a power of two (the prefill kernel's padding rows).
        for hd in ([128] if quick else [64, 80, 128, 256]):
            for gqa in ([1, 3, 8] if quick else [1, 3, 4, 7, 8, 12]):
                out.append((f"prefill {name} d{hd} gqa{gqa}", partial(prefill, DTYPES[name], hd, gqa)))
                out.append((f"decode {name} d{hd} gqa{gqa}", partial(decode, DTYPES[name], hd, gqa)))
            # One split: the kernel writes the output itself (no partials).
            out.append((f"decode {name} d{hd} gqa2 1split",
                        partial(decode, DTYPES[name], hd, 2, None, False)))
        # Logit soft-capping (Gemma-2: head_dim 256, GQA 2), the largest tiles.
        for hd in ([256] if quick else [128, 256]):
            for kind, build in (("prefill", prefill), ("decode", decode)):
                out.append((f"{kind} {name} d{hd} gqa2 softcap",
                            partial(build, DTYPES[name], hd, 2, 50.0)))
    for hd in ([128] if quick else [64, 80, 128, 256]):
        out.append((f"combine d{hd}", partial(combine, hd)))
        out.append((f"store_kv bf16 d{hd}", partial(store, torch.bfloat16, hd)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m runner.kernels.aot_check")
    ap.add_argument("--quick", action="store_true", help="a representative subset")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("aot_check: unset TRITON_INTERPRET (kernels must be compiled, not interpreted)",
              file=sys.stderr)
        return 2
    try:
        from triton.backends.nvidia.compiler import get_ptxas  # noqa: F401
        from triton.runtime import driver

        driver.set_active(_Sm90Driver())  # for the rest of this process
    except (ImportError, AttributeError) as exc:
        print(f"aot_check: this Triton lacks the internals the check uses ({exc})",
              file=sys.stderr)
        return 3
    failures = 0
    print(f"{'variant':30s} {'shared B':>9s} {'regs':>5s} {'spill B':>8s}  mma")
    for name, build in _variants(args.quick):
        try:
            kernel = build()
        except Exception as exc:  # report every failing variant, then fail
            failures += 1
            print(f"{name:30s} COMPILE FAILED: {type(exc).__name__}: {exc}")
            continue
        ptx = kernel.asm["ptx"]
        regs, spills = _ptxas_stats(ptx)
        shared = kernel.metadata.shared
        mma = "wgmma" if "wgmma" in ptx else "mma.sync" if "mma.sync" in ptx else "-"
        bad = spills != 0 or shared > H100_MAX_SHARED_BYTES
        failures += bad
        print(f"{name:30s} {shared:9d} {regs:5d} {spills:8d}  {mma}{'  <-- FAIL' if bad else ''}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
