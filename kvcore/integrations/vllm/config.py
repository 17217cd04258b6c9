"""vLLM's ``KVCacheConfig`` as kvcore's, and every vLLM setting kvcore refuses.

kvcore manages what vLLM's full-attention, sliding-window, chunked-local and cross-attention
managers manage (cross attention, as in vLLM, only with prefix caching off), Mamba states in
vLLM's ``"align"`` and ``"none"`` modes (with MTP/EAGLE's speculative state blocks, and under
EAGLE with ``"align"`` checkpoints at its replay boundary), and vLLM's scratch groups: circular
buffers (``CircularBufferSpec``, the CSA compressor ring) and sliding windows rebuilt by bounded
replay (``SlidingWindowMLASpec(bounded_replay=True)``).  vLLM's ``prefix_match_unit`` is
honoured (kvcore hashes where vLLM does), and where vLLM turns its partial hash hits on (the
unit finer than a Mamba ``"align"`` group's blocks) kvcore runs with
``KVCacheConfig.partial_block_hits``.  Anything else a vLLM 0.32 or 0.33 configuration can ask
of its KV-cache manager — context parallelism, host-resident groups, ... — is refused here, at engine start, with an
:class:`~kvcore.errors.UnsupportedFeatureError` that names it and the setting that turns it
off: kvcore never runs a configuration in which it would behave differently from vLLM.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from vllm.v1.core.kv_cache_utils import partial_hash_hits_enabled
from vllm.v1.core.single_type_kv_cache_manager import (
    ChunkedLocalAttentionManager,
    CircularBufferManager,
    CrossAttentionManager,
    FullAttentionManager,
    MambaManager,
    SlidingWindowManager,
)
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec as VllmChunkedLocalSpec,
)
from vllm.v1.kv_cache_interface import (
    CircularBufferSpec as VllmCircularBufferSpec,
)
from vllm.v1.kv_cache_interface import (
    CrossAttentionSpec as VllmCrossAttentionSpec,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec as VllmFullAttentionSpec,
)
from vllm.v1.kv_cache_interface import (
    KVCacheGroupRole,
)
from vllm.v1.kv_cache_interface import (
    MambaSpec as VllmMambaSpec,
)
from vllm.v1.kv_cache_interface import (
    SlidingWindowSpec as VllmSlidingWindowSpec,
)
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from kvcore.errors import UnsupportedFeatureError
from kvcore.integrations.vllm.version import VllmVersion
from kvcore.specs import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)


def refuse(feature: str, how: str) -> UnsupportedFeatureError:
    """The error for a vLLM ``feature`` kvcore does not implement (``how``: turning it off)."""
    return UnsupportedFeatureError(f"kvcore does not implement {feature} (vLLM's own KV-cache "
                                   f"manager does); {how}, or run vLLM without kvcore")


def _spec(group_id: int, group: Any) -> KVCacheSpec:
    """kvcore's spec for vLLM group ``group``, or raise naming what kvcore lacks."""
    spec = group.kv_cache_spec
    name = type(spec).__name__
    if getattr(group, "host_resident", False):
        raise refuse(f"host-resident KV-cache groups (group {group_id}, {name})",
                     "disable the feature that places it on the host")
    role = getattr(group, "role", KVCacheGroupRole.DEFAULT)
    if role != KVCacheGroupRole.DEFAULT:
        raise refuse(f"KV-cache group role {role!s} (group {group_id}, {name})",
                     "disable sparse attention for this model")
    manager = KVCacheSpecRegistry.get_manager_class(spec, None)
    common = dict(block_size=spec.block_size, num_kv_heads=getattr(spec, "num_kv_heads", 1) or 1,
                  head_size=getattr(spec, "head_size", 1) or 1)
    dtype = getattr(spec, "dtype", None)
    if dtype is not None:
        common["dtype"] = dtype
    if manager is FullAttentionManager and isinstance(spec, VllmFullAttentionSpec):
        return FullAttentionSpec(**common)
    if manager is SlidingWindowManager and isinstance(spec, VllmSlidingWindowSpec):
        # Extra retained tokens (multi-module MTP; vLLM's offloading tests set them too): the
        # window's blocks are released that many tokens later.
        extra = getattr(spec, "extra_retained_tokens", 0)
        # Bounded replay (DeepSeek-V4): a scratch window of sliding_window replayed tokens.
        replay = spec.prefix_replay_tokens
        if extra and replay:
            raise refuse(f"bounded replay over a sliding window that retains {extra} extra "
                         f"tokens (group {group_id}, {name})", "use a model without them")
        if replay and (replay != spec.sliding_window or spec.prefix_cacheable):
            raise refuse(f"bounded replay of {replay} tokens over a {spec.sliding_window}-token "
                         f"window (group {group_id}, {name})", "use a model without it")
        if not replay and not spec.prefix_cacheable:
            raise refuse(f"scratch sliding windows without replay (group {group_id}, {name})",
                         "use a model without them")
        return SlidingWindowSpec(sliding_window=spec.sliding_window, bounded_replay=bool(replay),
                                 extra_retained_tokens=extra, **common)
    if manager is CircularBufferManager and isinstance(spec, VllmCircularBufferSpec):
        return CircularBufferSpec(**common)
    if manager is ChunkedLocalAttentionManager and isinstance(spec, VllmChunkedLocalSpec):
        return ChunkedLocalAttentionSpec(attention_chunk_size=spec.attention_chunk_size, **common)
    if manager is MambaManager and isinstance(spec, VllmMambaSpec):
        return _mamba_spec(group_id, spec)
    if manager is CrossAttentionManager and isinstance(spec, VllmCrossAttentionSpec):
        return CrossAttentionSpec(**common)
    if not spec.prefix_cacheable:
        raise refuse(f"scratch KV-cache groups of this type (group {group_id}: {name}, managed "
                     f"in vLLM by {getattr(manager, '__name__', manager)})",
                     "use a model without them")
    what = "Mamba state groups" if name.startswith("Mamba") else "this attention type"
    raise refuse(f"{what} (group {group_id}: {name}, managed in vLLM by "
                 f"{getattr(manager, '__name__', manager)})",
                 "use a model with only full, sliding-window, chunked-local or cross attention, "
                 "Mamba or circular buffers")


def _mamba_spec(group_id: int, spec: Any) -> MambaSpec:
    """kvcore's spec for a vLLM Mamba group in ``"align"`` mode (what vLLM runs hybrid models
    with under prefix caching) or ``"none"``, or raise naming what kvcore lacks."""
    mode = spec.mamba_cache_mode
    if mode not in ("align", "none"):
        raise refuse(f"Mamba state groups in mamba_cache_mode={mode!r} (group {group_id})",
                     "use mamba_cache_mode='align' (vLLM's default with prefix caching)")
    if spec.num_prefill_checkpoint_blocks > 1:
        raise refuse(f"{spec.num_prefill_checkpoint_blocks} Mamba prefill checkpoint blocks "
                     f"(group {group_id})", "use a Mamba backend with at most one")
    shapes, dtypes = tuple(tuple(s) for s in spec.shapes), tuple(spec.dtypes)
    if len(shapes) != len(dtypes) or not shapes:  # kvcore sizes pages only: keep the bytes
        shapes, dtypes = ((spec.page_size_bytes,),), (torch.uint8,)
    return MambaSpec(block_size=spec.block_size, shapes=shapes, dtypes=dtypes,
                     mamba_cache_mode=mode,
                     num_prefill_checkpoint_blocks=spec.num_prefill_checkpoint_blocks,
                     prefill_checkpoint_alignment=spec.prefill_checkpoint_alignment,
                     num_speculative_blocks=spec.num_speculative_blocks)


def kvcore_config(kv_cache_config: Any, *, scheduler_block_size: int, hash_block_size: int,
                  enable_caching: bool, version: VllmVersion | None = None) -> KVCacheConfig:
    """kvcore's :class:`~kvcore.specs.KVCacheConfig` for vLLM's ``kv_cache_config`` (same groups
    in the same order, same pool size: block ids are vLLM's), or raise
    :class:`UnsupportedFeatureError` for anything kvcore would manage differently."""
    groups = list(kv_cache_config.kv_cache_groups)
    if not groups:
        raise refuse("models without KV-cache groups (encoder-only or attention-free)",
                     "serve this model")
    config = KVCacheConfig(
        kv_cache_config.num_blocks,
        tuple(KVCacheGroup(tuple(g.layer_names), _spec(i, g)) for i, g in enumerate(groups)),
        getattr(kv_cache_config, "prefix_cache_retention_interval", None))
    # vLLM's partial hash hits (a hit may end on any hash unit, inside a block, the shared
    # tail copied on write): kvcore's partial_block_hits.
    partial = enable_caching and len(groups) > 1 and partial_hash_hits_enabled(
        groups, hash_block_size, 1,
        [KVCacheSpecRegistry.get_manager_class(g.kv_cache_spec, None) for g in groups])
    if enable_caching and config.hash_block_size != hash_block_size:
        # vLLM hashes at its prefix_match_unit (hits still on block boundaries): so does kvcore.
        sizes = [g.spec.block_size for g in config.groups if g.spec.prefix_cacheable]
        if any(size % hash_block_size for size in sizes):
            raise refuse(f"hashing blocks of {hash_block_size} tokens for groups whose block "
                         f"sizes are {sizes} (gcd {config.hash_block_size})",
                         "give every prefix-cacheable group the same block size")
        config = dataclasses.replace(config, prefix_match_unit=hash_block_size)
    if partial:
        config = dataclasses.replace(config, partial_block_hits=True)
    cross = [i for i, g in enumerate(config.groups) if isinstance(g.spec, CrossAttentionSpec)]
    none_mode = [i for i, g in enumerate(config.groups)
                 if getattr(g.spec, "mamba_cache_mode", "align") == "none"]
    if none_mode and enable_caching and version is not None and version.lookahead_hashes:
        # vLLM 0.33's Mamba manager asserts "align" under prefix caching.
        raise refuse(f"prefix caching with Mamba groups in mamba_cache_mode='none' on vLLM "
                     f"{version.text} (groups {none_mode})", "use mamba_cache_mode='align'")
    if cross and enable_caching:
        # vLLM's CrossAttentionManager raises on its first lookup or cache_blocks call.
        raise refuse(f"prefix caching with cross attention (groups {cross}: encoder-decoder "
                     "models)", "set enable_prefix_caching=False (vLLM's default for them)")
    # vLLM's scheduler block size: the lcm of every group's, cross attention included.
    lcm = math.lcm(*(g.spec.block_size for g in config.groups))
    if lcm != scheduler_block_size:
        raise refuse(f"a scheduler block size of {scheduler_block_size} tokens for groups whose "
                     f"block sizes have lcm {lcm} (context parallelism "
                     "scales blocks)", "turn decode/prefill context parallelism off")
    return config


def zeroing_groups(kv_cache_config: Any) -> tuple[int, ...]:
    """The groups whose newly allocated blocks vLLM's workers zero (Mamba models and mixed
    KV-cache precisions): attention groups other than circular buffers, as vLLM records them."""
    from vllm.v1.kv_cache_interface import AttentionSpec, CircularBufferSpec

    if not getattr(kv_cache_config, "needs_kv_cache_zeroing", False):
        return ()
    return tuple(i for i, g in enumerate(kv_cache_config.kv_cache_groups)
                 if isinstance(g.kv_cache_spec, AttentionSpec)
                 and not isinstance(g.kv_cache_spec, CircularBufferSpec))


def eagle_groups(kv_cache_config: Any, use_eagle: bool,
                 version: VllmVersion) -> tuple[set[int], set[int]]:
    """vLLM's EAGLE group sets for this version: ``(eagle_group_ids, drop_eagle_group_ids)``.

    Groups flagged ``is_eagle_group`` (all of them when the scheduler passes ``use_eagle`` and
    none is flagged) are EAGLE groups; vLLM 0.32 drops a hit's last block in every one of them,
    0.33 only when ``use_eagle`` is passed (lookahead hashes clear it).  kvcore drops in the same
    groups (``CacheSettings.eagle_groups``; equal specs drop alike, in both)."""
    groups = kv_cache_config.kv_cache_groups
    eagle = {i for i, g in enumerate(groups) if getattr(g, "is_eagle_group", False)}
    if use_eagle and not eagle:
        eagle = set(range(len(groups)))
    drop = eagle if use_eagle or not version.eagle_drop_needs_use_eagle else set()
    return eagle, drop
