"""A weak reference to a freed Request never dangles.

mypyc 2.4 gives a compiled class with a Python class among its bases a ``__weakref__`` slot
that its deallocator never clears; ``Request`` once had one (its base was the ``KVRequest``
protocol), and Hypothesis' weak references to drawn requests then crashed the compiled build at
a later garbage collection (BENCHMARKS.md, 2026-11-26, the stateful stress run).  Run in a fresh
interpreter, against whichever build is installed, so a crash is an exit status here."""

from __future__ import annotations

import os
import subprocess
import sys

CODE = """
import gc, weakref
import kvcore
from kvcore import Request
refs = []
for i in range(200):
    r = Request(f"r{i}", [1, 2, 3, i])
    try:
        refs.append(weakref.ref(r))
    except TypeError:  # not weakly referenceable: nothing can dangle
        pass
    del r
gc.collect()
assert all(w() is None for w in refs)
print("ok", kvcore.__compiled__, len(refs))
"""


def test_a_weak_reference_to_a_freed_request_never_dangles() -> None:
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("ok")
