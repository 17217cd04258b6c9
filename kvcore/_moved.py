"""Import paths that moved in kvcore 0.x's restructuring, kept working for one release.

Importing an old path gives a module that reads each name from its new home on first use, after a
:class:`DeprecationWarning` naming that home.  A finder serves these paths (rather than a dozen
shim files) so that the package's tree shows only the modules that hold code; the cost is that a
type checker does not see the old paths.

What an old module serves:

* every public name it defined (:data:`FORMER_PUBLIC`, read from the module as it was before it
  moved), by attribute, by ``from ... import name`` and by ``from ... import *`` (its
  ``__all__``); names it only imported from elsewhere (``Any``, an error class) are read from the
  new home when that has them, but ``import *`` does not bind them;
* a class that was merged into another (``ManagerChecks`` into ``KVCacheManager``,
  ``PoolChecks`` into ``BlockPool``, ``ConnectorSteps`` into ``Scheduler``) as the class it was
  merged into, with a :class:`DeprecationWarning` of its own naming it: what it did is done by
  that class now, and an ``isinstance`` check against the old name still holds for the objects
  that have the old behaviour.

Names that left a module which still exists are served by that module's ``__getattr__``
(:func:`former_names`, with a warning on each use): modules ``import kvcore`` loads anyway are
given one by :func:`install` (:data:`MOVED_NAMES`; the compiled ones cannot define one in their
source), others (``kvcore.cli``, ``kvcore.invariants``) define their own, so that serving an old
name costs no import.  Such a module's ``import *`` gives its current names only: listing the
deprecated ones in its ``__all__`` would make every ``import *`` of it warn.

A new home is a module (the name is the same there) or ``module:name`` (the name changed).
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
                                                 "check_counts": "kvcore.validation",
                                                 "ManagerChecks": "kvcore.manager:KVCacheManager"}),
    "kvcore.pool.checks": ("kvcore.block_pool", {"check_count": "kvcore.validation",
                                                 "check_hashes": "kvcore.validation",
                                                 "PoolChecks": "kvcore.block_pool:BlockPool"}),
    "kvcore.scheduling": ("kvcore.scheduler.types",
                          {"KVConnectorMetadata": "kvcore.connector.base"}),
    "kvcore.schedule_policy": "kvcore.scheduler.admission",
    "kvcore.scheduler_connector": ("kvcore.scheduler.core",
                                   {"ConnectorSteps": "kvcore.scheduler.core:Scheduler"}),
    "kvcore.publisher": "kvcore.events.publisher",
    "kvcore.offload": "kvcore.connector.host_tier",
    "kvcore.offload.manager": "kvcore.connector.host_tier",
    "kvcore.compat": "kvcore.integrations",
    "kvcore.compat.nanovllm": "kvcore.integrations.nanovllm",
}

# old module -> the public names it defined (its __all__ where it had one), as it was before it
# moved (git: f5434a4^ and adf3f2d^): what `from old import *` binds.
FORMER_PUBLIC: dict[str, tuple[str, ...]] = {
    "kvcore.blocks": ("BlockHash", "PrefixNode", "KVCacheBlock", "NullBlock"),
    "kvcore.cache_blocks": ("KVCacheBlocks", "LookupHit"),
    "kvcore.kv_request": ("MultiModalItem", "KVRequest"),
    "kvcore.stats": ("PrefixCacheStats",),
    "kvcore.manager_checks": ("evictions_since_lookup", "check_counts", "ManagerChecks"),
    "kvcore.pool.checks": ("check_count", "check_hashes", "PoolChecks"),
    "kvcore.scheduling": ("KVConnectorMetadata", "RequestRejectedError", "SchedulerConfig",
                          "ScheduledRequest", "SchedulerOutput", "SchedulerStats"),
    "kvcore.schedule_policy": ("FCFS", "LPM", "DFS_WEIGHT", "POLICIES", "RECOMMENDED_NAME",
                               "RECOMMENDED", "DFS_MAX_DEPTH", "resolve", "OrderConfig",
                               "Orderable", "R", "WaitingOrder", "dfs_weight_order"),
    "kvcore.scheduler_connector": ("ConnectorSteps",),
    "kvcore.publisher": ("logger", "END_SEQ", "ENCODINGS", "PEER_WAIT_MS",
                         "PublisherClosedError", "external_hash", "to_external", "as_array",
                         "encode_payload", "check_endpoint", "ZmqEventPublisher"),
    "kvcore.offload": ("MEDIUM_CPU", "HostLoadStoreSpec", "HostOffloadingManager", "OffloadKey",
                       "OffloadingManager", "PrepareStoreOutput"),
    "kvcore.offload.manager": ("OffloadKey", "StoreSource", "HostLoadStoreSpec",
                               "PrepareStoreOutput", "OffloadingManager",
                               "HostOffloadingManager"),
    "kvcore.compat": (),
    "kvcore.compat.nanovllm": ("Sequence", "BlockManager"),
}

# Names that left a module which still exists and that `import kvcore` loads anyway (install()
# gives each its __getattr__): module -> {name: its new home}.
MOVED_NAMES: dict[str, dict[str, str]] = {
    "kvcore.hashing": {"RequestBlockHasher": "kvcore.request"},
    "kvcore.errors": {"check_flag": "kvcore.validation"},
    # the policy classes are imported from their modules since the eviction package's face was
    # narrowed to the registry and the bases
    "kvcore.eviction": {"ARCPolicy": "kvcore.eviction.arc", "LRUPolicy": "kvcore.eviction.lru",
                        "S3FIFOPolicy": "kvcore.eviction.s3fifo",
                        "SLRUPolicy": "kvcore.eviction.slru",
                        **dict.fromkeys(("PolicyInfo", "PolicyRegistry", "Recommendation"),
                                        "kvcore.eviction.registry")},
}


def new_home(old: str, name: str) -> str:
    """Where ``name`` of the old module ``old`` lives now: a module, or ``module:name``."""
    target = MOVED[old]
    if isinstance(target, str):
        return target
    default, per_name = target
    return per_name.get(name, default)


def _read(home: str, name: str) -> object:
    """``name`` read from ``home`` (a module, or ``module:new_name``)."""
    module, _, renamed = home.partition(":")
    return getattr(importlib.import_module(module), renamed or name)


def _merged_into(home: str) -> str:
    module, _, renamed = home.partition(":")
    return f"{module}.{renamed}"


class _Forward(types.ModuleType):
    """An old module: its names are read from their new homes."""

    def __getattr__(self, name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(name)
        home = new_home(self.__name__, name)
        if ":" in home:  # a class merged into another: say which
            warnings.warn(f"{self.__name__}.{name} is deprecated: it was merged into "
                          f"{_merged_into(home)}, import that instead",
                          DeprecationWarning, stacklevel=2)
        return _read(home, name)

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *FORMER_PUBLIC[self.__name__]})


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
        # `from old import *` reads __all__ from the module's dict, then each name through
        # _Forward.__getattr__.
        vars(module)["__all__"] = list(FORMER_PUBLIC[module.__name__])
        warnings.warn(f"{module.__name__} is deprecated: import from {home} instead",
                      DeprecationWarning, stacklevel=2)


def former_names(module: str, names: dict[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` serving the names that left ``module`` (``names``: name -> its
    new home, a module or ``module:new_name``), each with a :class:`DeprecationWarning`."""

    def __getattr__(name: str) -> object:
        home = names.get(name)
        if home is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        advice = (f"use {_merged_into(home)}" if ":" in home else f"import it from {home}")
        warnings.warn(f"{module}.{name} is deprecated: {advice}", DeprecationWarning,
                      stacklevel=2)
        return _read(home, name)

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
