"""The lifeline (:mod:`kvcore.proc.lifeline`): a child started through it ends with its parent,
however the parent ends (SIGTERM, SIGHUP, SIGKILL), in both modes: ``exec`` (Linux, started from
the main thread) and ``watch`` (started from a thread that ends before the child does).  kvcore's
own children are in ``tests/test_child_processes.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvcore.proc import lifeline
from tests.proc_tree import (
    LINUX_ONLY,
    alive,
    cmdline,
    descendants,
    kill_parent,
    lines_until,
    reap_tree,
    wait_gone,
)

pytestmark = LINUX_ONLY

# A child that listens on loopback and says where, then waits for ever.
LISTENER = ("import socket, time\n"
            "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
            "print('port', s.getsockname()[1], flush=True)\n"
            "time.sleep(600)\n")

# A parent that starts LISTENER through the lifeline (loaded by path: no kvcore import, fast),
# from its main thread or from a thread that then ends, and says so.
# SIGHUP gets its default action back: a suite run under nohup hands its processes SIGHUP
# ignored, and the parent must be one that a closed terminal ends.
PARENT = f"""
import importlib.util, signal, subprocess, sys, threading, time
signal.signal(signal.SIGHUP, signal.SIG_DFL)
spec = importlib.util.spec_from_file_location("lifeline", {lifeline.LIFELINE!r})
lifeline = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lifeline)

def start():
    cmd = lifeline.guarded([sys.executable, "-c", {LISTENER!r}])
    print("mode", cmd[cmd.index("--") - 1], flush=True)
    subprocess.Popen(cmd)

if sys.argv[1] == "thread":
    t = threading.Thread(target=start)
    t.start()
    t.join()
else:
    start()
print("started", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGKILL],
                         ids=["SIGTERM", "SIGHUP", "SIGKILL"])
@pytest.mark.parametrize(("started_from", "mode"), [("main", "exec"), ("thread", "watch")])
def test_a_guarded_child_ends_with_its_parent(started_from: str, mode: str,
                                              signum: int) -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, started_from],
                              stdout=subprocess.PIPE, text=True)
    try:
        said = lines_until(parent, "mode", "started", "port")
        assert said["mode"] == mode
        (listener,) = [p for p in descendants(parent.pid) if "s.listen()" in cmdline(p)
                       and lifeline.LIFELINE not in cmdline(p)]  # not a watching lifeline
        time.sleep(3 * lifeline.POLL_S)  # the thread that started it has ended: no matter
        assert alive(listener)
        tree, addresses = kill_parent(parent, signum)
        assert listener in tree and ("127.0.0.1", int(said["port"])) in addresses
        wait_gone(tree, addresses)
    finally:
        reap_tree(parent)


# A Python child that binds itself to its parent (as a multiprocessing worker does), then
# listens as LISTENER does; its parent says when it started it.
SELF_BOUND = f"""
import importlib.util, os, sys
spec = importlib.util.spec_from_file_location("lifeline", {lifeline.LIFELINE!r})
lifeline = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lifeline)
lifeline.die_with_parent(os.getppid(), from_main_thread=sys.argv[1] == "main")
exec({LISTENER!r})
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
@pytest.mark.parametrize("started_from", ["main", "thread"])
def test_a_child_bound_from_inside_ends_with_its_parent(started_from: str, signum: int) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen([sys.executable, "
         f"'-c', {SELF_BOUND!r}, {started_from!r}]); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True)
    try:
        port = int(lines_until(parent, "port")["port"])
        tree, addresses = kill_parent(parent, signum)
        assert len(tree) == 1 and addresses == {("127.0.0.1", port)}
        wait_gone(tree, addresses)
    finally:
        reap_tree(parent)


def test_a_watching_lifeline_passes_signals_and_the_status_through(tmp_path: Path) -> None:
    watch = [sys.executable, lifeline.LIFELINE, str(os.getpid()), "watch", "--"]
    done = subprocess.run([*watch, sys.executable, "-c", "raise SystemExit(7)"], timeout=30)
    assert done.returncode == 7
    proc = subprocess.Popen([*watch, sys.executable, "-c", LISTENER], stdout=subprocess.PIPE,
                            text=True)
    lines_until(proc, "port")
    (child,) = descendants(proc.pid)
    proc.terminate()  # forwarded: the command ends by SIGTERM, and so does the lifeline
    assert proc.wait(30) == -signal.SIGTERM
    wait_gone({child}, set())


def test_a_lifeline_whose_parent_is_gone_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    for mode in ("exec", "watch"):  # this process is not the lifeline's parent: gone already
        assert lifeline.main([str(os.getpid()), mode, "--", "touch", str(marker)]) == \
            lifeline.ORPHANED
    assert not marker.exists()
    # die_with_parent, from inside: a parent that is not the caller's is gone already
    for main_thread in (True, False):
        code = (f"import importlib.util, time; spec = importlib.util.spec_from_file_location("
                f"'l', {lifeline.LIFELINE!r}); l = importlib.util.module_from_spec(spec); "
                f"spec.loader.exec_module(l); l.die_with_parent(1, {main_thread}); "
                f"open({str(marker)!r}, 'w')")
        done = subprocess.run([sys.executable, "-c", code], timeout=30)
        assert done.returncode == lifeline.ORPHANED and not marker.exists()


def test_guarded_refuses_a_program_that_does_not_exist(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="missing"):
        lifeline.guarded([str(tmp_path / "missing")])
    with pytest.raises(FileNotFoundError):
        lifeline.guarded([])
