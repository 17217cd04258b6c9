"""The manager configurations the hostile driver and the fuzz run drive (``SETUPS``), and small
spec helpers to build more."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcore.eviction.registry import REGISTRY
from kvcore.manager import KVCacheManager
from kvcore.specs import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from kvcore.testing.faults import CollidingHasher


def _attn(cls: type[KVCacheSpec], block_size: int, **kw: int) -> KVCacheSpec:
    return cls(block_size=block_size, num_kv_heads=1, head_size=4, dtype=torch.float16, **kw)


def full(block_size: int = 4) -> KVCacheSpec:
    return _attn(FullAttentionSpec, block_size)


def swa(window: int, block_size: int = 4) -> KVCacheSpec:
    return _attn(SlidingWindowSpec, block_size, sliding_window=window)


def chunked(chunk: int, block_size: int = 4) -> KVCacheSpec:
    return _attn(ChunkedLocalAttentionSpec, block_size, attention_chunk_size=chunk)


def mamba(block_size: int = 4, spec: int = 0) -> KVCacheSpec:
    """A Mamba group in vLLM's "none" mode (``spec``: MTP/EAGLE's speculative state blocks)."""
    return MambaSpec(block_size=block_size, shapes=((2, 4),), dtypes=(torch.float32,),
                     num_speculative_blocks=spec)


def mamba_align(block_size: int = 4, checkpoint: bool = False, spec: int = 0) -> KVCacheSpec:
    """A Mamba group in vLLM's "align" mode (``checkpoint``: with Mamba2's prefill checkpoint
    block; ``spec``: MTP/EAGLE's speculative state blocks)."""
    return MambaSpec(block_size=block_size, shapes=((2, 4),), dtypes=(torch.float32,),
                     mamba_cache_mode="align", num_prefill_checkpoint_blocks=int(checkpoint),
                     prefill_checkpoint_alignment=1 if checkpoint else None,
                     num_speculative_blocks=spec)


def cross(block_size: int = 4) -> KVCacheSpec:
    return _attn(CrossAttentionSpec, block_size)


@dataclass(frozen=True)
class Setup:
    """A manager configuration to drive: its groups, pool, and hashing."""

    name: str
    specs: tuple[KVCacheSpec, ...]
    num_blocks: int = 32
    max_model_len: int = 64
    verify_hits: bool = False
    enable_caching: bool = True
    collisions: str | None = None  # a CollidingHasher mode (needs verify_hits), or real hashes
    use_eagle: bool = False
    fast_path: bool = True  # False: every allocate_slots call takes the validated path
    retention: int | None = None  # KVCacheConfig.prefix_cache_retention_interval
    hash_lookahead: int = 0  # CacheSettings.num_hash_lookahead_tokens
    eviction_policy: str = "lru"  # CacheSettings.eviction_policy
    prefix_match_unit: int | None = None  # KVCacheConfig.prefix_match_unit
    partial_block_hits: bool = False  # KVCacheConfig.partial_block_hits
    shared_prefix_checkpoint: bool = False  # CacheSettings.mamba_shared_prefix_checkpoint
    # The class to build: a subclass of KVCacheManager drives your own manager (or one with a
    # planted bug, to see the driver catch it).
    manager_class: type[KVCacheManager] = KVCacheManager

    def build(self) -> KVCacheManager:
        groups = tuple(KVCacheGroup((f"layer{i}",), s) for i, s in enumerate(self.specs))
        hasher = CollidingHasher(self.collisions) if self.collisions else None
        config = KVCacheConfig(self.num_blocks, groups, self.retention, self.prefix_match_unit,
                               self.partial_block_hits)
        return self.manager_class(config, self.max_model_len,
                              enable_caching=self.enable_caching, verify_hits=self.verify_hits,
                              block_hasher=hasher, enable_events=True, use_eagle=self.use_eagle,
                              fast_path=self.fast_path,
                              num_hash_lookahead_tokens=self.hash_lookahead,
                              eviction_policy=self.eviction_policy,
                              mamba_shared_prefix_checkpoint=self.shared_prefix_checkpoint)


def _setups() -> tuple[Setup, ...]:
    base = (
        Setup("full", (full(4),)),
        Setup("full-bs2", (full(2),), num_blocks=48),
        Setup("swa7", (swa(7, 4),)),
        Setup("chunked13", (chunked(13, 4),)),
        Setup("chunked6", (chunked(6, 4),)),
        Setup("full+chunked13", (full(4), chunked(13, 4)), num_blocks=48),
        Setup("full4+swa12/8", (full(4), swa(12, 8)), num_blocks=48),
        Setup("full+swa5+swa5", (full(4), swa(5, 4), swa(5, 4)), num_blocks=64),
        Setup("full+mamba", (full(4), mamba(4)), num_blocks=48),
        Setup("full+cross", (full(4), cross(4)), num_blocks=48),
        Setup("full+mamba-align", (full(4), mamba_align(4, checkpoint=True)), num_blocks=48),
        Setup("full+mamba-align retention0", (full(4), mamba_align(4)), num_blocks=48,
              retention=0),
        Setup("nocache full+swa", (full(4), swa(8, 4)), num_blocks=48, enable_caching=False),
        Setup("full8+swa4", (full(8), swa(6, 4)), num_blocks=48),  # partial prompt-tail entries
        # Hashes every 2 tokens (prefix_match_unit): partial prompt-tail entries at 2-token
        # boundaries, hits on 8-token ones.
        Setup("full8+swa4 unit2", (full(8), swa(6, 4)), num_blocks=48, prefix_match_unit=2),
        Setup("full eagle", (full(4),), use_eagle=True),
        Setup("full8+swa4 eagle", (full(8), swa(6, 4)), num_blocks=48, use_eagle=True),
        Setup("full+swa7+mamba eagle", (full(4), swa(7, 4), mamba(4)), num_blocks=64,
              use_eagle=True),
        # MTP/EAGLE on hybrid models: speculative Mamba state blocks in both modes, and an
        # "align" group's checkpoints at EAGLE's replay boundary.
        Setup("full+mamba spec2", (full(4), mamba(4, spec=2)), num_blocks=48),
        Setup("full+mamba-align spec3 eagle", (full(4), mamba_align(4, checkpoint=True, spec=3)),
              num_blocks=48, use_eagle=True),
        # Partial-block hits (vLLM's partial hash hits): hits end on any hash unit, inside a
        # block, the shared tail copied on write; odd units too (3 of 12), and under EAGLE.
        Setup("full8+mamba-align8 unit2 partial", (full(8), mamba_align(8)), num_blocks=48,
              prefix_match_unit=2, partial_block_hits=True),
        Setup("full12+mamba-align12 unit3 partial", (full(12), mamba_align(12)), num_blocks=48,
              prefix_match_unit=3, partial_block_hits=True),
        Setup("full8+mamba-align8 unit4 partial eagle", (full(8), mamba_align(8)), num_blocks=48,
              prefix_match_unit=4, partial_block_hits=True, use_eagle=True),
        Setup("full12+mamba-align12 unit3 partial checkpoint",
              (full(12), mamba_align(12, checkpoint=True)), num_blocks=48, prefix_match_unit=3,
              partial_block_hits=True),
        Setup("full8+mamba-align8 unit2 partial checkpoint eagle retention0",
              (full(8), mamba_align(8, checkpoint=True)), num_blocks=48, prefix_match_unit=2,
              partial_block_hits=True, use_eagle=True, retention=0),
        Setup("full8+mamba-align8 unit2 partial eagle shared-prefix", (full(8), mamba_align(8)),
              num_blocks=48, prefix_match_unit=2, partial_block_hits=True, use_eagle=True,
              shared_prefix_checkpoint=True),
        Setup("full8+mamba-align8 unit4 partial checkpoint spec2",
              (full(8), mamba_align(8, checkpoint=True, spec=2)), num_blocks=48,
              prefix_match_unit=4, partial_block_hits=True),
    )
    verified = tuple(Setup(f"{s.name} verify", s.specs, s.num_blocks, s.max_model_len, True,
                           s.enable_caching, use_eagle=s.use_eagle, retention=s.retention,
                           prefix_match_unit=s.prefix_match_unit)
                     for s in base if s.enable_caching and not s.partial_block_hits)
    colliding = tuple(Setup(f"{s.name} {mode}", s.specs, s.num_blocks, s.max_model_len, True,
                            True, mode, s.use_eagle, retention=s.retention,
                            prefix_match_unit=s.prefix_match_unit)
                      for s in base if s.enable_caching and not s.partial_block_hits
                      for mode in ("tokens", "constant", "truncated"))
    general = tuple(Setup(f"{s.name} general-path", s.specs, s.num_blocks, s.max_model_len,
                          use_eagle=s.use_eagle, enable_caching=s.enable_caching, fast_path=False)
                    for s in base if s.name in ("full", "full+swa5+swa5", "full+cross",
                                                "nocache full+swa", "full8+swa4 eagle"))
    return base + verified + colliding + general + _mixed_block_sizes()


MIXED = "mixed-bs"
"""The name prefix of the setups whose groups have different block sizes crossed with
lookahead hashes, sparse retention and every eviction policy (``--match mixed-bs`` in
``python -m kvcore.bench fuzz``)."""


def _mixed_block_sizes() -> tuple[Setup, ...]:
    """Layouts whose groups have different block sizes (the hit alignment, their lcm, larger
    than some group's block; hashes at their gcd, finer than some group's), each with
    lookahead hashes off and on (3 tokens), dense and sparse retention where the layout takes
    it (none, 0, one per 16 tokens), and every eviction policy the pool runs."""
    layouts: tuple[tuple[str, tuple[KVCacheSpec, ...], bool], ...] = (
        # (name, groups, takes sparse retention)
        ("full8+mamba-align4", (full(8), mamba_align(4, checkpoint=True)), True),
        ("full4+mamba-align8", (full(4), mamba_align(8, checkpoint=True)), True),
        ("full4+mamba-align8 spec2", (full(4), mamba_align(8, checkpoint=True, spec=2)), True),
        ("full8+swa6/4+mamba-align4", (full(8), swa(6, 4), mamba_align(4, checkpoint=True)),
         True),
        ("full8+mamba4", (full(8), mamba(4)), False),
        ("full4+swa12/8", (full(4), swa(12, 8)), True),
    )
    out = []
    for name, specs, sparse in layouts:
        for lookahead in (0, 3):
            for retention in ((None, 0, 16) if sparse else (None,)):
                for policy in REGISTRY.names(offline=False):
                    out.append(Setup(
                        f"{MIXED} {name} la{lookahead} "
                        f"{'dense' if retention is None else f'ret{retention}'} {policy}", specs,
                        num_blocks=64, hash_lookahead=lookahead, retention=retention,
                        eviction_policy=policy))
    return tuple(out)


SETUPS: tuple[Setup, ...] = _setups()
"""Full, sliding window, chunked local with chunk sizes that are not multiples of the block
size, hybrids (different block sizes, partial prompt-tail entries, Mamba in both modes — "align"
with a prefill checkpoint, and under sparse retention, and both with speculative state blocks —
cross attention),
EAGLE, caching off; each again with ``verify_hits`` and with each colliding hasher; a few with
``fast_path`` off; and the ``mixed-bs`` family: hybrids of different block sizes per group
crossed with lookahead hashes, sparse retention and every eviction policy."""
