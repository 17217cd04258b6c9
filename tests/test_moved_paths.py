"""Import paths that moved in the restructuring keep working for one release: each warns with a
DeprecationWarning naming the new home and hands back the very objects the new home holds, for
every public name the old module had, ``import *`` included."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

import kvcore
from kvcore import _moved

# (old module, name, new module)
CASES = [
    ("kvcore.blocks", "KVCacheBlock", "kvcore.types"),
    ("kvcore.blocks", "NullBlock", "kvcore.types"),
    ("kvcore.cache_blocks", "KVCacheBlocks", "kvcore.types"),
    ("kvcore.cache_blocks", "LookupHit", "kvcore.types"),
    ("kvcore.kv_request", "KVRequest", "kvcore.types"),
    ("kvcore.kv_request", "MultiModalItem", "kvcore.types"),
    ("kvcore.stats", "PrefixCacheStats", "kvcore.manager"),
    ("kvcore.manager_checks", "evictions_since_lookup", "kvcore.manager"),
    ("kvcore.manager_checks", "check_counts", "kvcore.validation"),
    ("kvcore.pool.checks", "check_count", "kvcore.validation"),
    ("kvcore.pool.checks", "check_hashes", "kvcore.validation"),
    ("kvcore.scheduling", "SchedulerConfig", "kvcore.scheduler.types"),
    ("kvcore.scheduling", "KVConnectorMetadata", "kvcore.connector.base"),
    ("kvcore.schedule_policy", "WaitingOrder", "kvcore.scheduler.admission"),
    ("kvcore.scheduler_connector", "Scheduler", "kvcore.scheduler.core"),
    ("kvcore.publisher", "ZmqEventPublisher", "kvcore.events.publisher"),
    ("kvcore.offload", "HostOffloadingManager", "kvcore.connector.host_tier"),
    ("kvcore.offload.manager", "OffloadKey", "kvcore.connector.host_tier"),
    ("kvcore.compat.nanovllm", "BlockManager", "kvcore.integrations.nanovllm"),
]

# Every public name each old module defined before it moved (read from git: `git show
# f5434a4^:kvcore/blocks.py`, ..., `git show adf3f2d^:kvcore/scheduling.py`; kvcore/offload's
# __all__), which `from old import *` must bind.
OLD_PUBLIC = {
    "kvcore.blocks": ["BlockHash", "PrefixNode", "KVCacheBlock", "NullBlock"],
    "kvcore.cache_blocks": ["KVCacheBlocks", "LookupHit"],
    "kvcore.kv_request": ["MultiModalItem", "KVRequest"],
    "kvcore.stats": ["PrefixCacheStats"],
    "kvcore.manager_checks": ["evictions_since_lookup", "check_counts", "ManagerChecks"],
    "kvcore.pool.checks": ["check_count", "check_hashes", "PoolChecks"],
    "kvcore.publisher": ["logger", "END_SEQ", "ENCODINGS", "PEER_WAIT_MS", "PublisherClosedError",
                         "external_hash", "to_external", "as_array", "encode_payload",
                         "check_endpoint", "ZmqEventPublisher"],
    "kvcore.scheduling": ["KVConnectorMetadata", "RequestRejectedError", "SchedulerConfig",
                          "ScheduledRequest", "SchedulerOutput", "SchedulerStats"],
    "kvcore.schedule_policy": ["FCFS", "LPM", "DFS_WEIGHT", "POLICIES", "RECOMMENDED_NAME",
                               "RECOMMENDED", "DFS_MAX_DEPTH", "resolve", "OrderConfig",
                               "Orderable", "R", "WaitingOrder", "dfs_weight_order"],
    "kvcore.scheduler_connector": ["ConnectorSteps"],
    "kvcore.offload": ["MEDIUM_CPU", "HostLoadStoreSpec", "HostOffloadingManager", "OffloadKey",
                       "OffloadingManager", "PrepareStoreOutput"],
    "kvcore.offload.manager": ["OffloadKey", "StoreSource", "HostLoadStoreSpec",
                               "PrepareStoreOutput", "OffloadingManager", "HostOffloadingManager"],
    "kvcore.compat": [],
    "kvcore.compat.nanovllm": ["Sequence", "BlockManager"],
}

# Classes that were merged into another: the old name resolves to the class that took its code.
MERGED = {
    ("kvcore.manager_checks", "ManagerChecks"): ("kvcore.manager", "KVCacheManager"),
    ("kvcore.pool.checks", "PoolChecks"): ("kvcore.block_pool", "BlockPool"),
    ("kvcore.scheduler_connector", "ConnectorSteps"): ("kvcore.scheduler.core", "Scheduler"),
}

# Names that left a module which still exists: (module, name) -> (its home, its name there).
LEFT = {
    ("kvcore.hashing", "RequestBlockHasher"): ("kvcore.request", "RequestBlockHasher"),
    ("kvcore.errors", "check_flag"): ("kvcore.validation", "check_flag"),
    ("kvcore.invariants", "BlockLists"): ("kvcore.invariants", "OwnerBlocks"),
    ("kvcore.cli", "DEFAULT_MAX_MODEL_LEN"): ("kvcore.cli.app", "DEFAULT_MAX_MODEL_LEN"),
    ("kvcore.cli", "MAIN_EPILOG"): ("kvcore.cli.app", "MAIN_EPILOG"),
    ("kvcore.cli", "cmd_replay"): ("kvcore.cli.replay", "cmd_replay"),
    **{("kvcore.eviction", name): (f"kvcore.eviction.{module}", name) for name, module in [
        ("ARCPolicy", "arc"), ("LRUPolicy", "lru"), ("S3FIFOPolicy", "s3fifo"),
        ("SLRUPolicy", "slru"), ("PolicyInfo", "registry"), ("PolicyRegistry", "registry"),
        ("Recommendation", "registry")]},
}

# Modules that became packages at the same path (kvcore/cli.py, kvcore/scheduler.py): their
# public names that stayed at the path, with no warning.
STAYED = {"kvcore.cli": ["version", "build_parser", "main"],
          "kvcore.scheduler": ["holds_place", "Scheduler"]}


def _fresh_import(old: str) -> tuple[object, list[warnings.WarningMessage]]:
    """Import ``old`` anew (it and the old paths beside it dropped from sys.modules), recording
    the warnings."""
    for loaded in [m for m in sys.modules if m == old or (m.startswith(old.rpartition(".")[0] + ".")
                   and m in _moved.MOVED)]:
        del sys.modules[loaded]  # (a parent old path, kvcore.compat, warns on its own)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    return module, caught


@pytest.mark.parametrize("old", sorted(OLD_PUBLIC))
def test_every_former_public_name_of_an_old_module_is_served(old: str) -> None:
    module, caught = _fresh_import(old)
    assert any(w.category is DeprecationWarning and f"{old} is deprecated" in str(w.message)
               for w in caught), [str(w.message) for w in caught]
    namespace: dict[str, object] = {}
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        exec(f"from {old} import *", namespace)  # the statement under test
    namespace.pop("__builtins__")
    namespace.pop("__warningregistry__", None)
    assert sorted(namespace) == sorted(OLD_PUBLIC[old])
    assert sorted(dir(module)) == sorted({*OLD_PUBLIC[old], *vars(module)})
    for name in OLD_PUBLIC[old]:
        home, new_name = MERGED.get((old, name), (_moved.new_home(old, name), name))
        assert namespace[name] is getattr(importlib.import_module(home), new_name), name


@pytest.mark.parametrize(("old", "name"), sorted(MERGED))
def test_a_merged_class_warns_and_resolves_to_the_class_it_was_merged_into(
        old: str, name: str) -> None:
    module, _ = _fresh_import(old)
    home, new_name = MERGED[(old, name)]
    with pytest.warns(DeprecationWarning,
                      match=f"{old}.{name} is deprecated: it was merged into {home}.{new_name}"):
        merged = getattr(module, name)
    assert merged is getattr(importlib.import_module(home), new_name)


@pytest.mark.parametrize(("module", "name"), sorted(LEFT))
def test_a_name_that_left_a_module_still_there_warns_and_resolves(module: str, name: str) -> None:
    home, new_name = LEFT[(module, name)]
    with pytest.warns(DeprecationWarning, match=f"{module}.{name} is deprecated"):
        value = getattr(importlib.import_module(module), name)
    assert value is getattr(importlib.import_module(home), new_name)


@pytest.mark.parametrize("module", sorted(STAYED))
def test_the_names_of_a_module_that_became_a_package_stayed(module: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        namespace: dict[str, object] = {}
        exec(f"from {module} import *", namespace)  # the statement under test
    assert set(STAYED[module]) <= set(namespace)


@pytest.mark.parametrize(("old", "name", "new"), CASES)
def test_an_old_path_warns_and_gives_the_new_object(old: str, name: str, new: str) -> None:
    module, caught = _fresh_import(old)
    assert any(w.category is DeprecationWarning and f"{old} is deprecated" in str(w.message)
               for w in caught), [str(w.message) for w in caught]
    assert getattr(module, name) is getattr(importlib.import_module(new), name)
    assert _moved.new_home(old, name) == new


def test_every_moved_path_is_tested_and_gone_from_the_tree() -> None:
    assert {old for old, _, _ in CASES} | {"kvcore.compat"} == set(_moved.MOVED)
    assert set(OLD_PUBLIC) == set(_moved.MOVED)
    assert {(m, n) for m, names in _moved.MOVED_NAMES.items() for n in names} <= set(LEFT)
    for old in _moved.MOVED:
        # no file or package left at the old path: the finder is the only thing serving it
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            spec = importlib.util.find_spec(old)
        assert spec is not None and spec.origin is None, old


def test_an_unknown_name_of_an_old_module_raises_attribute_error() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        module = importlib.import_module("kvcore.blocks")
    with pytest.raises(AttributeError):
        module.NoSuchName  # noqa: B018
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("kvcore.no_such_module")


def test_a_name_that_left_a_module_warns_and_resolves() -> None:
    import kvcore.hashing
    from kvcore.request import RequestBlockHasher

    with pytest.warns(DeprecationWarning, match="kvcore.hashing.RequestBlockHasher is deprecated"):
        from kvcore.hashing import RequestBlockHasher as old
    assert old is RequestBlockHasher
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        kvcore.hashing.nothing  # noqa: B018


def test_former_top_level_names_warn_and_resolve() -> None:
    from kvcore.errors import InvalidArgumentError
    from kvcore.testing import check_invariants
    from kvcore.types import KVCacheBlock

    for name, obj in [("InvalidArgumentError", InvalidArgumentError),
                      ("check_invariants", check_invariants), ("KVCacheBlock", KVCacheBlock)]:
        with pytest.warns(DeprecationWarning, match=f"kvcore.{name} is deprecated"):
            assert getattr(kvcore, name) is obj
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        kvcore.nothing  # noqa: B018
    for name in kvcore.__all__:  # the public names need no warning
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            getattr(kvcore, name)


def test_kvcore_itself_imports_no_old_path() -> None:
    """Every module of the package imports cleanly with deprecations as errors: nothing inside
    kvcore goes through a path kept only for users."""
    code = ("import kvcore, kvcore.scheduler, kvcore.cli, kvcore.connector, kvcore.events.publisher,"
            " kvcore.integrations.nanovllm, kvcore.testing, kvcore.sim.replay, kvcore.sim.study,"
            " kvcore.bench.commands, kvcore.cluster, runner.engine")
    proc = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", code],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
