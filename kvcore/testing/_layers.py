"""Per-manager layers: how :func:`~kvcore.testing.checked` and the fault injection of
:mod:`kvcore.testing.faults` change what one manager's public calls do, in place.

A layer is a mixin class (``__slots__ = ()``, not itself a KVCacheManager subclass) whose methods
run around the manager's own, reaching them with ``super()``.  :func:`add_layer` gives the
manager a class of its own, ``(mixin, previous class)``, that also carries the layer's state as
class attributes, and assigns it to ``manager.__class__``: the manager keeps its identity (a
scheduler that holds it sees the change) and is still an instance of its class.  Nothing is
added to the manager's instances or to kvcore's classes, and unlayered managers pay nothing.

The same code serves both builds: a compiled KVCacheManager has no ``__dict__`` and its methods
cannot be replaced, but it allows interpreted subclasses, and ``__class__`` may move between
classes of the same layout (which ``__slots__ = ()`` keeps).  Internal calls of compiled code do
not go through the layer; the public calls a scheduler makes do.
"""

from __future__ import annotations

from typing import Any

from kvcore.manager import KVCacheManager

_BELOW = "_kvcore_below"  # class attribute of a layer class: the class it was put on
_MIXIN = "_kvcore_mixin"  # ... and the mixin it adds


def add_layer(manager: KVCacheManager, mixin: type, **state: Any) -> None:
    """Put ``mixin`` on top of ``manager``'s class, with ``state`` as class attributes."""
    below = type(manager)
    manager.__class__ = _layer_class(mixin, below, state)


def remove_layer(manager: KVCacheManager, mixin: type) -> bool:
    """Take ``mixin``'s layer off ``manager`` (layers above it stay, in order); returns whether
    there was one."""
    above: list[type] = []
    cls = type(manager)
    while _BELOW in cls.__dict__:
        if cls.__dict__[_MIXIN] is mixin:
            rebuilt = cls.__dict__[_BELOW]
            for layer in reversed(above):
                rebuilt = _layer_class(layer.__dict__[_MIXIN], rebuilt, _state_of(layer))
            manager.__class__ = rebuilt
            return True
        above.append(cls)
        cls = cls.__dict__[_BELOW]
    return False


def _layer_class(mixin: type, below: type, state: dict[str, Any]) -> type:
    namespace: dict[str, Any] = {"__slots__": (), "__module__": mixin.__module__, _BELOW: below,
                                 _MIXIN: mixin, **state}
    return type(f"{mixin.__name__}[{below.__name__}]", (mixin, below), namespace)


def _state_of(layer: type) -> dict[str, Any]:
    return {k: v for k, v in layer.__dict__.items()
            if k.startswith("_kvcore_") and k not in (_BELOW, _MIXIN)}
