"""The backend's way into SGLang: the ``sglang.srt.plugins`` entry point, the registry name
``kvcore``, the checks at start (refusals by name, settings from the environment) and the lazy
import (kvcore's SGLang package imports nothing of SGLang until its cache is built)."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points
from types import SimpleNamespace
from typing import Any

import pytest
from sglang.srt.mem_cache.registry import TreeCacheBuildContext, get_radix_cache_factory
from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group

from kvcore.errors import InvalidArgumentError, UnsupportedFeatureError
from kvcore.integrations.sglang import plugin
from kvcore.integrations.sglang.cache import KVCoreRadixCache
from tests.integrations.sglang.helpers import make_allocator, make_params


def context(page_size: int = 4, **flags: Any) -> TreeCacheBuildContext:
    server_args = SimpleNamespace(radix_eviction_policy="lru", **{
        k: v for k, v in flags.items() if k not in _CTX_FLAGS})
    params = make_params(make_allocator(16, page_size), page_size)
    params.is_eagle = flags.get("is_eagle", False)
    return TreeCacheBuildContext(
        server_args=server_args, params=params,
        is_hybrid_swa=flags.get("is_hybrid_swa", False),
        is_hybrid_ssm=flags.get("is_hybrid_ssm", False),
        enable_hierarchical_cache=flags.get("enable_hierarchical_cache", False),
        disable_radix_cache=flags.get("disable_radix_cache", False), tp_worker=None,
        model_config=None, tp_size=1, tp_rank=0, tp_group=None)


_CTX_FLAGS = ("is_eagle", "is_hybrid_swa", "is_hybrid_ssm", "enable_hierarchical_cache",
              "disable_radix_cache")


def test_entry_point_registers_the_backend_through_sglangs_loader() -> None:
    names = {ep.name: ep.value for ep in entry_points(group=GENERAL_PLUGINS_GROUP)}
    assert names.get("kvcore") == "kvcore.integrations.sglang.plugin:register"
    register, _dist = load_plugins_by_group(GENERAL_PLUGINS_GROUP)["kvcore"]
    register()
    register()  # every SGLang process loads it; a second load is harmless
    assert get_radix_cache_factory("kvcore") is plugin.create_cache


def test_builds_the_cache_with_the_environment_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCORE_SGLANG_EVICTION_POLICY", "slru:protected_share=0.5")
    monkeypatch.setenv("KVCORE_SGLANG_VERIFY_HITS", "1")
    cache = plugin.create_cache(context())
    assert isinstance(cache, KVCoreRadixCache)
    assert cache.eviction_policy == "slru" and cache.settings.verify_hits
    assert cache.evictable_size() == cache.protected_size() == 0
    monkeypatch.delenv("KVCORE_SGLANG_EVICTION_POLICY")
    assert plugin.create_cache(context()).eviction_policy == "lru"  # SGLang's default policy


@pytest.mark.parametrize(("flag", "value", "named"), [
    ("is_hybrid_swa", True, "sliding-window"),
    ("is_hybrid_ssm", True, "Mamba"),
    ("enable_hierarchical_cache", True, "HiCache"),
    ("disable_radix_cache", True, "--disable-radix-cache"),
    ("is_eagle", True, "EAGLE"),
    ("enable_session_radix_cache", True, "--enable-session-radix-cache"),
    ("enable_streaming_session", True, "--enable-streaming-session"),
    ("enable_kv_cache_sharding", True, "--enable-kv-cache-sharding"),
    ("enable_lmcache", True, "--enable-lmcache"),
    ("disaggregation_decode_retraction_backup", "host_pool", "host-pool"),
])
def test_refuses_by_name_at_start(flag: str, value: object, named: str) -> None:
    with pytest.raises(UnsupportedFeatureError, match=named) as info:
        plugin.create_cache(context(**{flag: value}))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("env", "value", "error"), [
    ("KVCORE_SGLANG_EVICTION_POLICY", "belady", InvalidArgumentError),
    ("KVCORE_SGLANG_EVICTION_POLICY", "nope", InvalidArgumentError),
    ("KVCORE_SGLANG_QUEUE_HINTS", "64", UnsupportedFeatureError),
    ("KVCORE_SGLANG_VERIFY_HITS", "maybe", InvalidArgumentError),
    ("KVCORE_SGLANG_CHECK_INVARIANTS_EVERY", "-1", InvalidArgumentError),
])
def test_bad_settings_fail_at_start(monkeypatch: pytest.MonkeyPatch, env: str, value: str,
                                    error: type[Exception]) -> None:
    monkeypatch.setenv(env, value)
    with pytest.raises(error, match=env):
        plugin.create_cache(context())


def test_sglang_policy_without_a_kvcore_namesake_is_refused() -> None:
    ctx = context()
    ctx.server_args.radix_eviction_policy = "lfu"
    with pytest.raises(UnsupportedFeatureError, match="KVCORE_SGLANG_EVICTION_POLICY"):
        plugin.create_cache(ctx)


def test_package_imports_no_sglang() -> None:
    code = ("import sys, kvcore.integrations.sglang, kvcore.integrations.sglang.settings, "
            "kvcore.integrations.sglang.hashing; "
            "assert not [m for m in sys.modules if m.split('.')[0] == 'sglang'], 'imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
