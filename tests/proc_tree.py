"""Linux ``/proc`` helpers for tests of the processes kvcore starts: a process's descendants,
the TCP sockets they listen on, and waiting until all of them are gone."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import pytest

LINUX_ONLY = pytest.mark.skipif(sys.platform != "linux", reason="reads Linux's /proc")
Address = tuple[str, int]


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of ``pid``, or None when there is no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return fields[0], int(fields[1])


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    stat = _stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def descendants(root: int) -> set[int]:
    """Every living process under ``root`` (children, their children, ...)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None and stat[0] not in ("Z", "X"):
                parents[int(entry)] = stat[1]
    out: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - out
        out |= frontier
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _address(hex_address: str) -> Address:
    host, port = hex_address.split(":")
    # /proc/net/tcp{,6} print the address's memory as 32-bit words read in native byte order
    packed = b"".join(struct.pack("=I", int(host[i:i + 8], 16)) for i in range(0, len(host), 8))
    family = socket.AF_INET if len(packed) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, packed), int(port, 16)


def _listening_by_inode() -> dict[int, Address]:
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                out[int(fields[9])] = _address(fields[1])
    return out


def listening(pids: Iterable[int]) -> set[Address]:
    """The (address, port) pairs on which ``pids`` hold a listening TCP socket."""
    inodes = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    return {address for inode, address in _listening_by_inode().items() if inode in inodes}


def still_listening(addresses: Iterable[Address]) -> set[Address]:
    """Those of ``addresses`` that some process still listens on."""
    now = set(_listening_by_inode().values())
    return {a for a in addresses if a in now}


def wait_gone(pids: Iterable[int], addresses: Iterable[Address], timeout: float = 10.0) -> None:
    """Wait until none of ``pids`` runs and nothing listens on ``addresses``; else fail naming
    what is left."""
    pids, addresses = set(pids), set(addresses)
    deadline = time.monotonic() + timeout
    while True:
        left = {p for p in pids if alive(p)}
        ports = still_listening(addresses)
        if not left and not ports:
            return
        if time.monotonic() > deadline:
            names = {p: cmdline(p)[:120] for p in left}
            for pid in left:  # do not leave them behind for the rest of the suite
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"still running: {names}; still listening: {sorted(ports)}")
        time.sleep(0.05)


def kill_parent(proc: subprocess.Popen[str],
                signum: int) -> tuple[dict[int, str], set[Address]]:
    """Send ``signum`` to ``proc`` and reap it; returns its descendants (pid -> command line)
    and the addresses it and they listened on, as they were just before."""
    tree = {pid: cmdline(pid) for pid in descendants(proc.pid)}
    addresses = listening(set(tree) | {proc.pid})
    proc.send_signal(signum)
    proc.wait(30)
    return tree, addresses


def reap_tree(proc: subprocess.Popen[str]) -> None:
    """After a failed test: kill ``proc``, if it still runs, and every process under it, so
    nothing is left behind for the rest of the suite."""
    if proc.poll() is not None:
        return
    left = descendants(proc.pid)
    proc.kill()
    proc.wait()
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def lines_until(proc: subprocess.Popen[str], *prefixes: str) -> dict[str, str]:
    """The first line of ``proc``'s output starting with each prefix (word -> the rest)."""
    assert proc.stdout is not None
    got: dict[str, str] = {}
    while len(got) < len(prefixes):
        line = proc.stdout.readline()
        assert line, f"the parent ended early (status {proc.poll()}), having said {got}"
        word, _, rest = line.strip().partition(" ")
        if word in prefixes:
            got[word] = rest
    return got
