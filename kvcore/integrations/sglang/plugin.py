"""The ``kvcore`` radix-cache backend's registration in SGLang, and its checks at start.

SGLang loads every entry point of its ``sglang.srt.plugins`` group in each of its processes;
kvcore's (``pyproject.toml``) is :func:`register`, which registers :func:`create_cache` under
the name ``kvcore`` with SGLang's ``register_radix_cache_backend``.  ``--radix-cache-backend
kvcore`` then builds the cache through :func:`create_cache`, which refuses, by name and with the
reason, every configuration the backend does not implement (:func:`refusals`) and reads its
settings (:mod:`~kvcore.integrations.sglang.settings`), before building
:class:`~kvcore.integrations.sglang.cache.KVCoreRadixCache`.
"""

from __future__ import annotations

import os
from importlib.metadata import version
from typing import TYPE_CHECKING

from kvcore.errors import UnsupportedFeatureError
from kvcore.integrations.sglang import SUPPORTED_SGLANG
from kvcore.integrations.sglang.settings import SGLangSettings

if TYPE_CHECKING:
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext

    from kvcore.integrations.sglang.cache import KVCoreRadixCache

BACKEND_NAME = "kvcore"

# (server argument, value that is refused, why): read off SGLang's server arguments.
_REFUSED_ARGS: tuple[tuple[str, object, str], ...] = (
    ("enable_hierarchical_cache", True, "HiCache (host and storage tiers) is not implemented"),
    ("enable_lmcache", True, "LMCache's tree is its own cache"),
    ("enable_flexkv", True, "FlexKV's tree is its own cache"),
    ("enable_unified_cache_external_linker", True, "external cache linkers are not implemented"),
    ("enable_session_radix_cache", True, "radix sessions are not implemented"),
    ("enable_streaming_session", True, "streaming sessions are not implemented"),
    ("enable_kv_cache_sharding", True, "KV sharding (logical-page rotation) is not implemented"),
    ("disaggregation_decode_retraction_backup", "host_pool",
     "host-pool retraction backup is not implemented"),
)
_PLAIN_ALLOCATORS = ("TokenToKVPoolAllocator", "PagedTokenToKVPoolAllocator")


def register() -> None:
    """Register the ``kvcore`` backend (idempotent: a second call in a process does nothing)."""
    from sglang.srt.mem_cache.registry import (
        get_radix_cache_factory,
        register_radix_cache_backend,
    )

    if get_radix_cache_factory(BACKEND_NAME) is None:
        register_radix_cache_backend(BACKEND_NAME, create_cache)


def refusals(ctx: TreeCacheBuildContext) -> list[str]:
    """What in ``ctx`` the backend does not implement, one line each (empty: none)."""
    out: list[str] = []
    checks = (
        (ctx.disable_radix_cache, "--disable-radix-cache: the backend is a prefix cache; drop "
         "--radix-cache-backend to run without one"),
        (ctx.is_hybrid_swa, "a hybrid sliding-window (SWA) model: SWA state is not implemented"),
        (ctx.is_hybrid_ssm, "a hybrid Mamba/SSM model: Mamba state is not implemented"),
        (ctx.is_dsa, "a DSA (sparse attention) model: its index cache is not implemented"),
        (ctx.enable_hierarchical_cache, "--enable-hierarchical-cache: HiCache is not "
         "implemented"),
        (bool(ctx.params.is_eagle), "EAGLE speculative decoding: bigram keys are not "
         "implemented"),
    )
    out.extend(line for refused, line in checks if refused)
    for name, bad, why in _REFUSED_ARGS:
        value = getattr(ctx.server_args, name, None)
        if value == bad and not (name == "enable_hierarchical_cache"
                                 and ctx.enable_hierarchical_cache):
            out.append(f"--{name.replace('_', '-')}={value}: {why}")
    allocator = ctx.params.token_to_kv_pool_allocator
    kind = type(allocator).__name__
    if kind not in _PLAIN_ALLOCATORS:
        out.append(f"token allocator {kind}: the backend runs over "
                   f"{' or '.join(_PLAIN_ALLOCATORS)} only")
    return out


def create_cache(ctx: TreeCacheBuildContext) -> KVCoreRadixCache:
    """SGLang's factory for ``--radix-cache-backend kvcore``: refuses what is not implemented
    (:class:`~kvcore.errors.UnsupportedFeatureError`, one line per reason), validates the
    settings, builds the cache."""
    installed = version("sglang")
    if installed != SUPPORTED_SGLANG:
        raise UnsupportedFeatureError(
            f"the kvcore radix-cache backend supports SGLang {SUPPORTED_SGLANG}, this is "
            f"{installed}")
    refused = refusals(ctx)
    if refused:
        raise UnsupportedFeatureError("--radix-cache-backend kvcore cannot run this "
                                      "configuration: " + "; ".join(refused))
    settings = SGLangSettings.from_env(
        os.environ, sglang_policy=getattr(ctx.server_args, "radix_eviction_policy", None)
        or ctx.params.eviction_policy)
    from kvcore.integrations.sglang.cache import KVCoreRadixCache

    return KVCoreRadixCache(ctx.params, settings)

