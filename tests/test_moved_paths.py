"""Import paths that moved in the restructuring keep working for one release: each warns with a
DeprecationWarning naming the new home and hands back the very objects the new home holds."""

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


@pytest.mark.parametrize(("old", "name", "new"), CASES)
def test_an_old_path_warns_and_gives_the_new_object(old: str, name: str, new: str) -> None:
    for loaded in [m for m in sys.modules if m == old or (m.startswith(old.rpartition(".")[0] + ".")
                   and m in _moved.MOVED)]:
        del sys.modules[loaded]  # (a parent old path, kvcore.compat, warns on its own)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert any(w.category is DeprecationWarning and f"{old} is deprecated" in str(w.message)
               for w in caught), [str(w.message) for w in caught]
    assert getattr(module, name) is getattr(importlib.import_module(new), name)
    assert _moved.new_home(old, name) == new


def test_every_moved_path_is_tested_and_gone_from_the_tree() -> None:
    assert {old for old, _, _ in CASES} | {"kvcore.compat"} == set(_moved.MOVED)
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
