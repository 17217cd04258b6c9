"""Child processes that end with the kvcore process that started them.

A process kvcore starts (the Dynamo indexer, a benchmark worker, a tensor-parallel rank) must
not outlive it, however kvcore ends: an exception unwinds through ``stop``/``__exit__``, but
SIGTERM, SIGHUP (a closed terminal) or SIGKILL run no Python code in kvcore at all.

:func:`guarded` wraps a command line: this file runs first, as a script (it imports nothing from
kvcore: a few milliseconds), and

* on Linux, when the caller is its process's main thread, asks the kernel to SIGKILL it when its
  parent dies (``prctl(PR_SET_PDEATHSIG)``), checks that its parent is still the process that
  started it (that process may have died before the request took effect), and replaces itself
  with the command (``exec``: the request survives it, and ``Popen.pid`` is the command's pid);
* otherwise (another OS, or a caller on another thread: Linux sends the signal when the *thread*
  that started the child ends) stays as the command's parent, *watching*: it forwards SIGTERM and
  SIGHUP to the command, checks every :data:`POLL_S` seconds that its own parent is alive, kills
  the command when it is not, and exits with the command's status.  A terminal's Ctrl-C reaches
  the command directly (same process group), so the lifeline ignores SIGINT.  On Linux the
  command also gets ``PR_SET_PDEATHSIG`` from the watching lifeline (single-threaded), so a
  SIGKILL of the lifeline ends it too; elsewhere, kill the lifeline's process group.

A Python child that kvcore starts with :mod:`multiprocessing` calls :func:`die_with_parent` first
thing instead (same rule, from inside: the signal, or a watching thread).

Windows has neither signal nor ``getppid`` semantics to build on: :func:`guarded` returns the
command unchanged there, and a child ends only when kvcore stops it.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from types import FrameType

LIFELINE = os.path.abspath(__file__)
"""This file: ``python -I -S LIFELINE PARENT_PID exec|watch -- COMMAND...``."""

POLL_S = 0.2
"""How often a watching lifeline (or thread) checks that the parent is alive."""

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
ORPHANED = 1
"""The lifeline's exit status when the parent was gone before the command started."""


def guarded(cmd: Sequence[str], python: str | None = None) -> list[str]:
    """``cmd`` run through the lifeline, so that it ends when this process ends (module
    docstring); ``python`` runs the lifeline (default: this interpreter).  Start it on the
    thread that called this (the mode depends on the thread).  Raises
    :class:`FileNotFoundError`, as ``subprocess.Popen`` would, when ``cmd``'s program is not
    found (else the lifeline would start and then fail to run it)."""
    if not cmd or shutil.which(cmd[0]) is None:
        program = cmd[0] if cmd else ""
        raise FileNotFoundError(errno.ENOENT, "no such executable", program)
    if os.name != "posix":
        return list(cmd)
    mode = "exec" if _pdeathsig_usable() else "watch"
    # -I -S: the standard library only, whatever PYTHONPATH or site-packages hold (and faster)
    return [python or sys.executable, "-I", "-S", LIFELINE, str(os.getpid()), mode, "--", *cmd]


def die_with_parent(parent_pid: int, from_main_thread: bool = True) -> None:
    """Make this process end when ``parent_pid``, its parent, ends: called first thing by a
    child kvcore starts with :mod:`multiprocessing`.  ``from_main_thread``: whether the parent
    started it from its main thread (else the kernel's signal would come when that thread ends,
    and a watching daemon thread is used instead).  Exits at once if the parent is gone
    already."""
    if from_main_thread and _set_pdeathsig():
        if os.getppid() != parent_pid:
            os._exit(ORPHANED)
        return
    if os.getppid() != parent_pid:
        os._exit(ORPHANED)
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="kvcore-lifeline",
                     daemon=True).start()


def _pdeathsig_usable() -> bool:
    """Whether a child started now can rely on ``PR_SET_PDEATHSIG``: Linux, main thread."""
    return sys.platform == "linux" and threading.current_thread() is threading.main_thread()


def _set_pdeathsig() -> bool:
    """Ask Linux to SIGKILL this process when its parent (thread) dies; False where it cannot."""
    if sys.platform != "linux":
        return False
    import ctypes  # only here: the lifeline's own start stays cheap elsewhere

    libc = ctypes.CDLL(None, use_errno=True)
    return bool(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0)


def _watch_parent(parent_pid: int) -> None:
    """A daemon thread's loop: SIGKILL this process once ``parent_pid`` is no longer its
    parent (it died: the process was handed to another)."""
    while os.getppid() == parent_pid:
        time.sleep(POLL_S)
    os.kill(os.getpid(), signal.SIGKILL)


def _watch(parent_pid: int, cmd: Sequence[str]) -> int:
    """The watching lifeline: run ``cmd`` as a child and follow it (module docstring); returns
    the exit status to end with (after re-raising a signal that ended the command)."""
    preexec = _set_pdeathsig if sys.platform == "linux" else None
    # close_fds=False: the command inherits exactly what the lifeline did (pipes, passed fds).
    # preexec_fn is safe here: the lifeline has no other thread.
    try:
        child = subprocess.Popen(list(cmd), close_fds=False, preexec_fn=preexec)
    except OSError as exc:
        print(f"cannot run {cmd[0]}: {exc}", file=sys.stderr)
        return 127

    def forward(signum: int, frame: FrameType | None) -> None:
        child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGHUP, forward)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            code = child.wait(timeout=POLL_S)
            break
        except subprocess.TimeoutExpired:
            pass
        if os.getppid() != parent_pid:
            child.kill()
            child.wait()
            return ORPHANED
    if code < 0:  # ended by a signal: end the same way, so the parent reads the same status
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code if code >= 0 else 128 - code


def main(argv: Sequence[str]) -> int:
    """``PARENT_PID exec|watch -- COMMAND...`` (what :func:`guarded` writes)."""
    if len(argv) < 4 or argv[1] not in ("exec", "watch") or argv[2] != "--":
        print(f"usage: {os.path.basename(LIFELINE)} PARENT_PID exec|watch -- COMMAND...",
              file=sys.stderr)
        return 2
    parent_pid, mode, cmd = int(argv[0]), argv[1], list(argv[3:])
    if os.getppid() != parent_pid:
        return ORPHANED
    if mode == "exec" and _set_pdeathsig():
        if os.getppid() != parent_pid:  # died before the request took effect
            return ORPHANED
        try:
            os.execvp(cmd[0], cmd)
        except OSError as exc:
            print(f"cannot run {cmd[0]}: {exc}", file=sys.stderr)
            return 127
    return _watch(parent_pid, cmd)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
