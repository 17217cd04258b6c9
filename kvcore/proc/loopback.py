"""Run a Python program whose native library listens on every interface, on one address instead.

NVIDIA Dynamo's KV indexer (``python -m dynamo.indexer``, 1.6.1) serves HTTP on ``0.0.0.0`` and
has no option to choose another address: its Rust code binds ``("0.0.0.0", port)``.  Run in the
program's process before it starts, this script points the native library's references to the C
library's ``bind`` (its global offset table slots, found from its ELF relocations) at a function
that replaces a wildcard address (``0.0.0.0``, or ``::``) with ``HOST`` and calls the real
``bind``; any other address passes unchanged.  It then runs the program as ``python -m MODULE``
would.  The program's own log may still name the address it asked for.

    python loopback.py HOST NATIVE_MODULE MODULE [ARG...]
    e.g.   loopback.py 127.0.0.1 dynamo._core dynamo.indexer --port 8090

``HOST`` is an IPv4 address; a wildcard IPv6 bind goes to ``::1`` for a loopback ``HOST``, else
to ``HOST`` as an IPv4-mapped address.  Linux with 64-bit little-endian ELF (x86-64, aarch64)
only: anywhere else, or when the library's ``bind`` slots cannot be found and checked, the script
refuses to run the program (exit status :data:`REFUSED`, the reason on stderr) rather than let
it listen on every interface.
"""

from __future__ import annotations

import ctypes
import errno
import ipaddress
import mmap
import os
import runpy
import socket
import struct
import sys
from collections.abc import Sequence
from typing import Any

LAUNCHER = os.path.abspath(__file__)
"""This file, run as a script (module docstring)."""
REFUSED = 3
"""Exit status when the binds cannot be redirected (the program did not run)."""

_BIND = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_uint32,
                         use_errno=True)
_SHT_RELA = 4
_PT_LOAD = 1
# e_machine -> relocation types that store a symbol's address in an 8-byte slot
_SLOT_RELOCATIONS = {62: {1, 6, 7},  # x86-64: R_X86_64_64, GLOB_DAT, JUMP_SLOT
                     183: {257, 1025, 1026}}  # aarch64: R_AARCH64_ABS64, GLOB_DAT, JUMP_SLOT
_PROT_READ, _PROT_WRITE, _PROT_EXEC = 1, 2, 4


class RefusedError(Exception):
    """The library's binds cannot be redirected (the reason is the message)."""


def _read(f: Any, offset: int, size: int) -> bytes:
    f.seek(offset)
    data: bytes = f.read(size)
    if len(data) != size:
        raise RefusedError(f"{f.name} is truncated")
    return data


def bind_slots(path: str) -> tuple[list[int], int]:
    """The offsets (from the load address) of ``path``'s slots holding ``bind``'s address, and
    the address its first loadable segment asks for (to find the load address)."""
    with open(path, "rb") as f:
        head = _read(f, 0, 64)
        if head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
            raise RefusedError(f"{path} is not a 64-bit little-endian ELF file")
        (machine,) = struct.unpack_from("<H", head, 18)
        if machine not in _SLOT_RELOCATIONS:
            raise RefusedError(f"{path} is for machine {machine}, not x86-64 or aarch64")
        phoff, shoff = struct.unpack_from("<QQ", head, 32)
        phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", head, 54)
        first_vaddr = None
        for i in range(phnum):
            p_type, _, p_offset, p_vaddr = struct.unpack_from(
                "<IIQQ", _read(f, phoff + i * phentsize, 24))
            if p_type == _PT_LOAD and p_offset == 0:
                first_vaddr = p_vaddr
        if first_vaddr is None:
            raise RefusedError(f"{path} has no loadable segment at offset 0")
        sections = [struct.unpack_from("<IIQQQQIIQQ", _read(f, shoff + i * shentsize, 64))
                    for i in range(shnum)]
        slots = []
        for _, sh_type, _, _, offset, size, link, _, _, entsize in sections:
            if sh_type != _SHT_RELA or not entsize:
                continue
            symtab, strtab = sections[link], sections[sections[link][6]]
            symbols = _read(f, symtab[4], symtab[5])
            names = _read(f, strtab[4], strtab[5])
            relocations = _read(f, offset, size)
            for k in range(size // entsize):
                r_offset, r_info, r_addend = struct.unpack_from("<QQq", relocations, k * entsize)
                sym = r_info >> 32
                if not sym or (r_info & 0xFFFF_FFFF) not in _SLOT_RELOCATIONS[machine]:
                    continue
                (name_at,) = struct.unpack_from("<I", symbols, sym * symtab[9])
                if names[name_at:names.index(b"\0", name_at)] == b"bind" and r_addend == 0:
                    slots.append(r_offset)
    if not slots:
        raise RefusedError(f"{path} has no reference to bind() to redirect")
    return slots, first_vaddr


def _mappings(path: str) -> list[tuple[int, int, str, int]]:
    """``(start, end, permissions, file offset)`` of each mapping of ``path`` in this process."""
    real = os.path.realpath(path)
    out = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip() == real:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                out.append((start, end, fields[1], int(fields[2], 16)))
    return out


def _wildcard_to(host: str) -> tuple[bytes, bytes]:
    """The 4-byte and 16-byte addresses that replace ``0.0.0.0`` and ``::``."""
    try:
        ip = ipaddress.IPv4Address(host)
    except ValueError:
        raise RefusedError(f"HOST must be an IPv4 address, got {host!r}") from None
    v6 = ipaddress.IPv6Address("::1") if ip.is_loopback else ipaddress.IPv6Address(
        f"::ffff:{ip}")
    return ip.packed, v6.packed


def redirect_wildcard_binds(native_module: str, host: str) -> object:
    """Import ``native_module`` (an extension module) and send its wildcard binds to ``host``;
    returns the replacement function, which must be kept alive as long as the library runs."""
    if sys.platform != "linux":
        raise RefusedError(f"redirecting binds needs Linux, not {sys.platform}")
    to4, to6 = _wildcard_to(host)
    module = __import__(native_module, fromlist=["_"])
    path = getattr(module, "__file__", None)
    if not path:
        raise RefusedError(f"{native_module} has no file")
    slots, first_vaddr = bind_slots(path)
    mappings = _mappings(path)
    first = [m for m in mappings if m[3] == 0]
    if not first:
        raise RefusedError(f"{path} is not mapped in this process")
    base = first[0][0] - (first_vaddr & ~(mmap.PAGESIZE - 1))
    libc = ctypes.CDLL(None, use_errno=True)
    real = _BIND(("bind", libc))
    real_address = ctypes.cast(real, ctypes.c_void_p).value

    def redirected(fd: int, addr: int | None, length: int) -> int:
        try:
            if addr and length >= 2:
                family = ctypes.c_ushort.from_address(addr).value
                at, size, to = ((4, 4, to4) if family == socket.AF_INET and length >= 16 else
                                (8, 16, to6) if family == socket.AF_INET6 and length >= 28 else
                                (0, 0, b""))
                if size and not any(ctypes.string_at(addr + at, size)):
                    moved = ctypes.create_string_buffer(ctypes.string_at(addr, length), length)
                    ctypes.memmove(ctypes.addressof(moved) + at, to, size)
                    return int(real(fd, ctypes.addressof(moved), length))
            return int(real(fd, addr, length))
        except BaseException:  # never let bind() "succeed" without binding
            ctypes.set_errno(errno.EACCES)
            return -1

    replacement = _BIND(redirected)
    new_address = ctypes.cast(replacement, ctypes.c_void_p).value
    mprotect = libc.mprotect
    mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for slot in slots:
        address = base + slot
        where = [m for m in mappings if m[0] <= address < m[1]]
        if not where:
            raise RefusedError(f"bind() slot {slot:#x} of {path} is not mapped")
        current = ctypes.c_void_p.from_address(address).value
        if current != real_address:
            raise RefusedError(f"bind() slot {slot:#x} of {path} holds {current!r}, not the C "
                               "library's bind()")
        perms = where[0][2]
        prot = ((_PROT_READ if "r" in perms else 0) | (_PROT_WRITE if "w" in perms else 0)
                | (_PROT_EXEC if "x" in perms else 0))
        page = address & ~(mmap.PAGESIZE - 1)
        if mprotect(page, mmap.PAGESIZE, prot | _PROT_WRITE) != 0:
            raise RefusedError(f"cannot write bind() slot {slot:#x} of {path}: "
                               f"{os.strerror(ctypes.get_errno())}")
        ctypes.c_void_p.from_address(address).value = new_address
        mprotect(page, mmap.PAGESIZE, prot)
    return replacement


def main(argv: Sequence[str]) -> int:
    """``HOST NATIVE_MODULE MODULE [ARG...]``: see the module docstring."""
    if len(argv) < 3:
        print(f"usage: {os.path.basename(__file__)} HOST NATIVE_MODULE MODULE [ARG...]",
              file=sys.stderr)
        return 2
    host, native_module, module, args = argv[0], argv[1], argv[2], list(argv[3:])
    try:
        keep = redirect_wildcard_binds(native_module, host)
    except (RefusedError, ImportError, OSError) as exc:
        print(f"kvcore: not running {module}: its binds to every interface cannot be moved to "
              f"{host} ({exc})", file=sys.stderr)
        return REFUSED
    print(f"kvcore: {module} binds {host} where it asks for every interface", file=sys.stderr)
    sys.argv = [module, *args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        del keep
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
