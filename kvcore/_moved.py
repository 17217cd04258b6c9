"""Import paths that moved in kvcore 0.x's restructuring, kept working for one release.

Importing an old path gives a module that reads each name from its new home on first use, after a
:class:`DeprecationWarning` naming that home.  A finder serves these paths (rather than a dozen
shim files) so that the package's tree shows only the modules that hold code; the cost is that a
type checker does not see the old paths.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Callable, Sequence

# old module -> its new home, or (the default new home, {name: the new home of that name})
MOVED: dict[str, str | tuple[str, dict[str, str]]] = {
    "kvcore.blocks": "kvcore.types",
    "kvcore.cache_blocks": "kvcore.types",
    "kvcore.kv_request": "kvcore.types",
    "kvcore.stats": "kvcore.manager",
    "kvcore.manager_checks": ("kvcore.manager", {"check_count": "kvcore.validation",
                                                 "check_counts": "kvcore.validation"}),
    "kvcore.pool.checks": ("kvcore.block_pool", {"check_count": "kvcore.validation",
                                                 "check_hashes": "kvcore.validation"}),
    "kvcore.scheduling": ("kvcore.scheduler.types",
                          {"KVConnectorMetadata": "kvcore.connector.base"}),
    "kvcore.schedule_policy": "kvcore.scheduler.admission",
    "kvcore.scheduler_connector": "kvcore.scheduler.core",
    "kvcore.publisher": "kvcore.events.publisher",
    "kvcore.offload": "kvcore.connector.host_tier",
    "kvcore.offload.manager": "kvcore.connector.host_tier",
    "kvcore.compat": "kvcore.integrations",
    "kvcore.compat.nanovllm": "kvcore.integrations.nanovllm",
}

# Names that left a module which still exists: module -> {name: its new home}.
MOVED_NAMES: dict[str, dict[str, str]] = {
    "kvcore.hashing": {"RequestBlockHasher": "kvcore.request"},
}


def new_home(old: str, name: str) -> str:
    """The module that now holds ``name`` of the old module ``old``."""
    target = MOVED[old]
    if isinstance(target, str):
        return target
    default, per_name = target
    return per_name.get(name, default)


class _Forward(types.ModuleType):
    """An old module: its names are read from their new homes."""

    def __getattr__(self, name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(importlib.import_module(new_home(self.__name__, name)), name)


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds and loads the old paths of :data:`MOVED` (and nothing else)."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        is_package = any(key.startswith(fullname + ".") for key in MOVED)
        return importlib.machinery.ModuleSpec(fullname, self, is_package=is_package)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        # Never the new module itself: importlib would overwrite its __spec__.
        return _Forward(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        target = MOVED[module.__name__]
        home = target if isinstance(target, str) else target[0]
        warnings.warn(f"{module.__name__} is deprecated: import from {home} instead",
                      DeprecationWarning, stacklevel=2)


def former_names(module: str, names: dict[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` serving the names that left ``module`` (``names``: name -> its
    new home), each with a :class:`DeprecationWarning`."""

    def __getattr__(name: str) -> object:
        home = names.get(name)
        if home is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(f"{module}.{name} is deprecated: import it from {home}",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(home), name)

    return __getattr__


def install() -> None:
    """Serve the old paths and names from now on (idempotent; ``import kvcore`` calls it)."""
    if not any(isinstance(finder, _OldPaths) for finder in sys.meta_path):
        sys.meta_path.append(_OldPaths())
    for module, names in MOVED_NAMES.items():
        # A module's own __getattr__ (PEP 562) answers names it does not hold; the compiled
        # build's extension modules honour it too.
        namespace: dict[str, object] = vars(importlib.import_module(module))
        namespace["__getattr__"] = former_names(module, names)
