"""Ctrl-C as a request to stop: a long replay ends at its next step and reports what it did.

    stop = SigintStop()
    with stop:                                   # the first Ctrl-C only sets stop.requested
        result = replay(requests, cfg, should_stop=stop)
    if stop.requested: ...                       # result holds the steps run so far

Inside the ``with`` block the first SIGINT is recorded instead of raising
:class:`KeyboardInterrupt`; a second one raises it as usual (a stuck run can still be killed).
Outside the block, in threads other than the main one (where Python cannot install signal
handlers) and where SIGINT is ignored (a background job of a shell), nothing changes.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Mapping
from types import FrameType
from typing import Any


class SigintStop:
    """A stop flag set by the first Ctrl-C inside ``with``; call it (``stop()``) to read it."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None
        self._installed = False

    def __call__(self) -> bool:
        return self.requested

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True
        signal.signal(signal.SIGINT, self._previous)  # the next Ctrl-C interrupts at once

    def __enter__(self) -> SigintStop:
        if threading.current_thread() is threading.main_thread() and not self.requested:
            self._previous = signal.getsignal(signal.SIGINT)
            if self._previous is not signal.SIG_IGN:  # an ignored Ctrl-C stays ignored
                signal.signal(signal.SIGINT, self._on_sigint)
                self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            if signal.getsignal(signal.SIGINT) == self._on_sigint:
                signal.signal(signal.SIGINT, self._previous)
            self._installed = False


INTERRUPTED = 130
"""The exit status of a command stopped by Ctrl-C (128 + SIGINT), partial results printed."""


def partial_note(out: Mapping[str, Any], policies: object, plot: object) -> str:
    """The one line ``kvcore replay`` prints on stderr when Ctrl-C cut it short: how far the
    replay got, and which requested comparisons (``--policy``, ``--plot``) did not run."""
    replay = out["replay"]
    done = (f"the replay stopped after {replay['num_finished']:,} of {out['requests']:,} "
            "requests finished" if replay.get("interrupted") else "the replay was complete")
    missing = [flag for flag, asked, key in (("--policy", policies, "policies"),
                                            ("--plot", plot, "curves"))
               if asked and key not in out]
    return (f"kvcore: interrupted: partial results ({done}"
            + (f"; {' and '.join(missing)} not run)" if missing else ")"))
