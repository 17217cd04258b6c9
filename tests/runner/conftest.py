"""Set-up of the runner's tests: one torch thread count for the whole run, whatever the load.

A CPU engine picks torch's intra-op thread count from the 1-minute load average when it is
built (``runner/threads.py``) and sets it for the whole process, so every numerical comparison
made later in that process would sum in an order that depends on the load at the time some
earlier test built an engine (a precision test failed so under load).  With ``OMP_NUM_THREADS``
set, an engine leaves torch's count alone, and tensor-parallel ranks inherit it; one thread, the
engine's own choice on a busy machine.  ``test_threads.py`` unsets it where it tests that
choice.  (Set at collection, before any test builds an engine: a run that collects the runner's
tests has it in every test; ``tests/test_bad_inputs.py`` builds an engine too.)
"""

from __future__ import annotations

import os

import torch

if not os.environ.get("OMP_NUM_THREADS", "").strip():
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
