"""A weak reference to a freed kvcore object never dangles.

mypyc 2.4 gives a compiled class with a Python class among its bases a ``__weakref__`` slot
that its deallocator never clears (docs/mypyc_weakref_bug.md).  ``Request`` once had one (its
base was the ``KVRequest`` protocol), and Hypothesis' weak references to drawn requests then
crashed the compiled build at a later garbage collection (BENCHMARKS.md, 2026-11-26, the stateful
stress run); ``BlockHashView`` and the verify mode's ``_Chain`` had one too (their base was
``collections.abc.Sequence``).  None of them names a Python base now.  Each case runs in a fresh
interpreter, against whichever build is installed, so a crash is an exit status here."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CODE = """
import gc, weakref
import kvcore
{setup}
refs = []
for i in range(200):
    obj = {make}
    assert type(obj).__name__ == {name!r}, type(obj)
    try:
        refs.append(weakref.ref(obj))
    except TypeError:  # not weakly referenceable: nothing can dangle
        pass
    del obj
gc.collect()
junk = [bytearray(64) for _ in range(10_000)]  # reuse the freed memory
assert all(w() is None for w in refs)
print("ok", kvcore.__compiled__, len(refs))
"""

CASES = {
    "Request": ("from kvcore import Request", "Request(f'r{i}', [1, 2, 3, i])"),
    "BlockHashView": ("from kvcore.hashing import hashes_at",
                      "hashes_at([bytes([i])] * 4, 16, 32)"),
    "_Chain": ("from kvcore import Request\n"
               "from kvcore.verify import PrefixChains\n"
               "def make_chain(i):\n"
               "    chains = PrefixChains()\n"
               "    return chains.nodes(Request(f'r{i}', [1, 2, 3, 4, i]), 2, 2)",
               "make_chain(i)"),
}


@pytest.mark.parametrize("name", CASES)
def test_a_weak_reference_to_a_freed_object_never_dangles(name: str) -> None:
    setup, make = CASES[name]
    code = CODE.format(setup=setup, make=make, name=name)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("ok")
