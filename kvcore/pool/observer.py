"""Pool observers: a caller's callbacks on block residency, made where the pool acts.

An observer set on a :class:`~kvcore.block_pool.BlockPool` (``set_observer``) is told, with the
block, each time

* ``on_block_allocated``: ``get_new_blocks`` hands the block out (once per block, in the order
  handed out).  With prefix caching on, ``on_block_evicted`` for the same block comes first —
  for every block handed out, whether it still cached a prefix or not — as vLLM's pool does;
* ``on_block_accessed``: a prefix hit takes a reference on the block (``touch``, and the hits the
  managers adopt; null blocks are not reported: they are never handed out).  ``pin`` (a holder
  that only copies the block) is not reported;
* ``on_block_evicted``: ``evict_blocks`` drops the block from the prefix cache — every block id
  listed, cached or not, in the order listed;
* ``reset``: ``reset_prefix_cache`` succeeded.

These are the names and the moments at which vLLM's ``BlockPool`` calls its
``KVCacheMetricsCollector`` (KV-cache residency metrics), so such a collector is an observer as
it is.  An observer must not call back into the pool.  Without one, the pool pays one attribute
test per call of the methods above.
"""

from __future__ import annotations

from typing import Protocol, cast

from kvcore.errors import InvalidArgumentError
from kvcore.types import KVCacheBlock

OBSERVER_METHODS = ("on_block_allocated", "on_block_accessed", "on_block_evicted", "reset")
"""The callbacks a :class:`PoolObserver` has."""


class PoolObserver(Protocol):
    """What a pool tells its observer (see the module docstring)."""

    def on_block_allocated(self, block: KVCacheBlock) -> None: ...

    def on_block_accessed(self, block: KVCacheBlock) -> None: ...

    def on_block_evicted(self, block: KVCacheBlock) -> None: ...

    def reset(self) -> None: ...


def check_observer(observer: object) -> PoolObserver | None:
    """``observer`` if it has every callback (``None`` clears); otherwise
    :class:`~kvcore.errors.InvalidArgumentError` naming the first one missing."""
    if observer is None:
        return None
    for name in OBSERVER_METHODS:
        if not callable(getattr(observer, name, None)):
            raise InvalidArgumentError(
                f"a pool observer needs a callable {name}(), got {observer!r:.80}")
    return cast(PoolObserver, observer)  # checked above, structurally
