"""CacheSettings: how a KV-cache manager behaves, beyond the model's shape.

The model's shape (groups, block sizes, pool size) is a :class:`~kvcore.specs.KVCacheConfig`;
everything else a cache can be told (prefix caching, the eviction policy, scheduler hints,
events, hit verification, EAGLE, hashing, custom attention types) is one ``CacheSettings``,
made and validated once where the user speaks (the command line, a ``ReplayConfig``, kvcore
inside vLLM, your own code) and handed down whole: ``KVCacheManager(config, max_model_len,
settings=...)`` builds ``BlockPool(num_blocks, settings=..., events=...)`` and
``make_coordinator(config, pool, settings)``.  A new option is a field here and the code that
reads it.

The manager and the pool also take the fields as keyword arguments, a shorthand for
``settings=CacheSettings(...)``: ``KVCacheManager(config, 4096, eviction_policy="slru")``.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvcore.errors import InvalidArgumentError
from kvcore.eviction.registry import (
    RECOMMENDED,
    RECOMMENDED_NAME,
    REGISTRY,
    PolicyFactory,
)
from kvcore.hashing import BlockHasher
from kvcore.validation import check_flag

_FLAGS = ("enable_caching", "enable_events", "verify_hits", "use_eagle", "eagle_junction_tail",
          "mamba_recache_prompt_boundary", "mamba_shared_prefix_checkpoint", "log_stats",
          "fast_path")


@dataclass(frozen=True)
class CacheSettings:
    """Every option of a KV cache (validated when made; see the module docstring).

    Attributes:
        enable_caching: prefix caching on/off.
        eviction_policy: which free cached block is reused first: a registered name
            (``"lru"``, vLLM's order, the default; ``"slru"``, ``"s3fifo"``, ``"arc"``; options
            as ``"slru:protected_share=0.3"``; see :mod:`kvcore.eviction`) or a factory
            ``blocks -> EvictionPolicy``.  The README's recommendation (a policy and a hint
            depth) is :meth:`recommended`.
        queue_hints: how many waiting requests a scheduler declares to the cache every step
            (``declare_upcoming``), so that their cached prefixes are evicted last (0 = off).
        enable_events: record KV events (``take_events``).
        verify_hits: cached blocks keep their token ids and every hit is confirmed against the
            request's tokens, so a hash collision cannot produce a wrong-KV hit.
        use_eagle: EAGLE/MTP speculative decoding: every prefix hit drops its last block (as
            vLLM's ``use_eagle``; not with chunked local attention), and Mamba "align" groups
            keep their checkpoints at EAGLE's replay boundary.
        eagle_groups: with ``use_eagle``, the KV-cache groups (ids) whose hits drop their last
            block, as vLLM's ``is_eagle_group`` flags (the draft model's groups); ``None``, the
            default: every group.  Groups of one spec are searched together, so one of them
            listed makes them all drop (as vLLM); a sliding window's retention and the hybrid
            caching one block past the aligned boundary follow each group's own drop, the
            prompt's replay boundaries follow whether any group drops.  An id past the
            model's groups is refused when the manager is built.
        num_hash_lookahead_tokens: EAGLE/MTP lookahead hashes (vLLM 0.33's): each block's hash
            also covers the next this many tokens, which the drafter's KV at the block's last
            position read, so a block is hashed (and cached) only once they exist and hits need
            no EAGLE drop; ``KVCacheManager.make_request`` hashes this way, and ``BlockStored``
            events carry the tokens (``lookahead_token_ids``).  0: plain hashes.
        eagle_junction_tail: under EAGLE with sparse retention (a sliding window and a
            ``prefix_cache_retention_interval``), also keep the window tail one block below a
            request's shared-prefix junction, where a sibling that diverges right after the
            junction hits, and a Mamba "align" group the state one block below it (vLLM 0.33;
            ``False``: vLLM 0.32, which keeps only the junction's).
        mamba_recache_prompt_boundary: Mamba "align" groups mark the state at the prompt's last
            block boundary before its end as cached this step (not hittable until the next)
            whenever a chunk ends there, even when it was cached or hit earlier (vLLM 0.32;
            ``False``, the default: only a state cached now, as vLLM 0.33).
        mamba_shared_prefix_checkpoint: with partial-block hits
            (``KVCacheConfig.partial_block_hits``), a Mamba "align" group also keys the state
            where a prompt chunk ends at the request's shared-prefix junction (the longest
            prefix its lookup found some group holding), so a sibling sharing that prefix
            resumes there (vLLM's ``enable_mamba_shared_prefix_checkpoint``, which vLLM honours
            on EAGLE models only: kvcore's vLLM adapter passes it so); without partial hits it
            does nothing.
        log_stats: collect :class:`~kvcore.manager.PrefixCacheStats`.
        fast_path: let ``allocate_slots`` calls that only add new tokens skip the validation they
            cannot fail; ``False`` validates every call in full (both reach the same code).
        hash_algo, hash_seed: block-hash algorithm and seed (see :mod:`kvcore.hashing`).
        block_hasher: a :class:`~kvcore.hashing.BlockHasher` to use instead of
            ``hash_algo``/``hash_seed`` (e.g. a colliding one from :mod:`kvcore.testing.faults`).
        manager_classes: extra spec type -> single-type manager class entries (custom attention
            types; see :mod:`kvcore.managers`).
    """

    enable_caching: bool = True
    eviction_policy: str | PolicyFactory = "lru"
    queue_hints: int = 0
    enable_events: bool = False
    verify_hits: bool = False
    use_eagle: bool = False
    eagle_groups: tuple[int, ...] | None = None
    num_hash_lookahead_tokens: int = 0
    eagle_junction_tail: bool = True
    mamba_recache_prompt_boundary: bool = False
    mamba_shared_prefix_checkpoint: bool = False
    log_stats: bool = True
    fast_path: bool = True
    hash_algo: str = "xxh3_128"
    hash_seed: object = None
    block_hasher: BlockHasher | None = None
    manager_classes: Mapping[type, type] | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        for name in _FLAGS:
            check_flag(name, getattr(self, name))
        policy = self.eviction_policy
        if policy == RECOMMENDED_NAME:  # a policy and a hint depth: not one field's value
            raise InvalidArgumentError(f"eviction_policy {policy!r} names a policy and a queue-"
                                       "hint depth: use CacheSettings.recommended()")
        # Raises naming an unknown, offline or malformed policy, an option it does not take
        # or a bad option value.
        REGISTRY.check(policy)
        hints = self.queue_hints
        if type(hints) is not int or hints < 0:
            raise InvalidArgumentError(f"queue_hints must be an int >= 0, got {hints!r}")
        groups = self.eagle_groups
        if groups is not None and (
                type(groups) is not tuple
                or any(type(g) is not int or g < 0 for g in groups)
                or len(set(groups)) != len(groups)):
            raise InvalidArgumentError(f"eagle_groups must be None or a tuple of distinct group "
                                       f"ids (ints >= 0), got {groups!r}")
        lookahead = self.num_hash_lookahead_tokens
        if type(lookahead) is not int or lookahead < 0:
            raise InvalidArgumentError(f"num_hash_lookahead_tokens must be an int >= 0, got "
                                       f"{lookahead!r}")
        if not isinstance(self.hash_algo, str):
            raise InvalidArgumentError(f"hash_algo must be a str, got {self.hash_algo!r}")
        if self.block_hasher is not None and not isinstance(self.block_hasher, BlockHasher):
            raise InvalidArgumentError(f"block_hasher must be a BlockHasher, got "
                                       f"{self.block_hasher!r}")
        classes = self.manager_classes
        if classes is not None and not isinstance(classes, Mapping):
            raise InvalidArgumentError(f"manager_classes must be a mapping of spec type to "
                                       f"manager class, got {classes!r}")

    @classmethod
    def recommended(cls, **options: Any) -> CacheSettings:
        """The README's recommendation (policy and hint depth), with ``options`` on top."""
        return cls._of(None, {"eviction_policy": RECOMMENDED.policy,
                             "queue_hints": RECOMMENDED.queue_hints, **options})

    @classmethod
    def of(cls, settings: object, options: Mapping[str, Any]) -> CacheSettings:
        """Deprecated (one release): use :meth:`replace`, or pass ``settings=`` and keyword
        options to the manager or the pool."""
        warnings.warn("CacheSettings.of is deprecated: use CacheSettings.replace",
                      DeprecationWarning, stacklevel=2)
        return cls._of(settings, options)

    @classmethod
    def _of(cls, settings: object, options: Mapping[str, Any]) -> CacheSettings:
        """``settings`` (default: the defaults) with ``options`` replacing fields: how the
        manager and the pool turn their arguments into one object.  An unknown option or a bad
        value raises :class:`InvalidArgumentError` naming it."""
        if settings is None:
            settings = _DEFAULT
        elif not isinstance(settings, CacheSettings):
            raise InvalidArgumentError(f"settings must be a CacheSettings, got {settings!r}")
        if not options:
            return settings
        unknown = sorted(set(options) - _FIELDS)
        if unknown:
            raise InvalidArgumentError(f"unknown cache option(s) {', '.join(unknown)}; the "
                                       f"options are {', '.join(sorted(_FIELDS))}")
        return dataclasses.replace(settings, **options)

    def replace(self, **options: Any) -> CacheSettings:
        """A copy with ``options`` changed (validated)."""
        return CacheSettings._of(self, options)


_FIELDS = frozenset(f.name for f in dataclasses.fields(CacheSettings))
_DEFAULT = CacheSettings()
