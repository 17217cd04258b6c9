"""The loopback launcher (:mod:`kvcore.proc.loopback`): a native module's binds to every
interface go to the address it is given, other binds are untouched, and a failing bind still
fails with its own error; what it cannot redirect it refuses to run.

Python's own ``_socket`` extension stands in for Dynamo's library (the indexer itself is in
``tests/test_dynamo_interop.py``): a program run under the launcher binds through it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvcore.proc import loopback
from tests.proc_tree import LINUX_ONLY

pytestmark = LINUX_ONLY

PROGRAM = """
import errno, json, socket, sys

def bound(family, address):
    with socket.socket(family) as s:
        s.bind(address)
        return s.getsockname()[0]

out = {"v4": bound(socket.AF_INET, ("0.0.0.0", 0)),
       "named": bound(socket.AF_INET, ("127.0.0.2", 0)),
       "argv": sys.argv[1:]}
if socket.has_ipv6:
    try:
        out["v6"] = bound(socket.AF_INET6, ("::", 0))
    except OSError as exc:  # no IPv6 on this machine
        out["v6"] = exc.errno
taken = socket.socket()
taken.bind(("127.0.0.1", 0))
taken.listen()
try:
    bound(socket.AF_INET, ("0.0.0.0", taken.getsockname()[1]))
except OSError as exc:
    out["in_use"] = exc.errno == errno.EADDRINUSE
print(json.dumps(out))
"""


def _launch(tmp_path: Path, host: str, native: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "bindcheck.py").write_text(PROGRAM)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    return subprocess.run([sys.executable, loopback.LAUNCHER, host, native, "bindcheck", "a1"],
                          capture_output=True, text=True, env=env, timeout=60)


def test_wildcard_binds_go_to_the_host_and_nothing_else_changes(tmp_path: Path) -> None:
    import _socket

    if not getattr(_socket, "__file__", None):
        pytest.skip("_socket is built into this interpreter: no library to redirect")
    done = _launch(tmp_path, "127.0.0.1", "_socket")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["v4"] == "127.0.0.1" and out["named"] == "127.0.0.2" and out["argv"] == ["a1"]
    assert out["in_use"] is True  # the real bind's error, errno included
    if isinstance(out.get("v6"), str):
        assert out["v6"] == "::1"
    assert "bindcheck binds 127.0.0.1 where it asks for every interface" in done.stderr


@pytest.mark.parametrize(("host", "native", "why"), [
    ("127.0.0.1", "json", "not a 64-bit little-endian ELF file"),  # pure Python
    ("127.0.0.1", "math", "no reference to bind()"),
    ("localhost", "_socket", "HOST must be an IPv4 address"),
    ("127.0.0.1", "no_such_module_here", "No module named"),
])
def test_what_cannot_be_redirected_is_not_run(tmp_path: Path, host: str, native: str,
                                              why: str) -> None:
    done = _launch(tmp_path, host, native)
    assert done.returncode == loopback.REFUSED and done.stdout == ""  # the program never ran
    assert why in done.stderr and "not running bindcheck" in done.stderr


def test_bind_slots_finds_the_c_librarys_bind_in_an_extension() -> None:
    import _socket

    if not getattr(_socket, "__file__", None):
        pytest.skip("_socket is built into this interpreter")
    slots, _ = loopback.bind_slots(_socket.__file__)
    assert slots and all(s % 8 == 0 for s in slots)
    with socket.socket() as s:  # this process is untouched: reading the file patches nothing
        s.bind(("0.0.0.0", 0))
        assert s.getsockname()[0] == "0.0.0.0"
