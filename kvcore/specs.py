"""KV-cache specs (what one layer stores per block), groups and the whole-model config.

A *spec* describes one attention type's block format; a *group* is a set of layers that share one
block table (so one spec); a *config* is the groups plus the number of blocks in the shared pool.

As in vLLM, layers with equal specs are split into groups of **equal layer count** (30 sliding +
6 full layers -> five sliding groups and one full group of 6 layers each; counts that do not
divide leave the last group short), so a runner can give layer ``i`` of every group the same KV
tensor: block ids are disjoint across groups because they come from one pool.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from kvcore.errors import InvalidArgumentError


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class KVCacheSpec:
    """Block format of one layer type.  ``block_size`` is in tokens."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype = torch.float16

    kind: ClassVar[str] = "abstract"
    cacheable: ClassVar[bool] = True
    """Whether blocks of this type can be shared through the prefix cache."""
    admission_capped: ClassVar[bool] = False
    """Whether ``full_sequence_must_fit`` admission counts at most ``max_blocks_per_request``
    blocks for this type (vLLM caps the types that recycle blocks within a window: sliding
    window and chunked local attention)."""
    reads_encoder: ClassVar[bool] = False
    """Whether the group holds the encoder's KV (cross attention), not the request's tokens'."""
    holds_state: ClassVar[bool] = False
    """Whether a block holds a recurrent state (Mamba), readable by other requests only after
    the step that computed it."""

    def needed_positions(self, num_tokens: int) -> range:
        """Positions of the request's tokens whose KV the token at position ``num_tokens``
        reads (full attention: every earlier one)."""
        return range(max(num_tokens, 0))

    @property
    def prefix_cacheable(self) -> bool:
        """Whether this group's blocks take part in prefix caching (vLLM's
        ``KVCacheSpec.prefix_cacheable``).  A group that does not is *scratch*: its blocks are
        per-request, never cached, never hit, and the hash granularity ignores its block size
        (a circular buffer; a sliding window rebuilt by bounded replay)."""
        return self.cacheable

    @property
    def prefix_replay_tokens(self) -> int:
        """Tokens a scheduler recomputes at the end of every prefix hit to rebuild this group
        (vLLM's ``prefix_replay_tokens``: DeepSeek-V4 bounded replay); 0: none."""
        return 0

    def __post_init__(self) -> None:
        _positive("block_size", self.block_size)
        _positive("num_kv_heads", self.num_kv_heads)
        _positive("head_size", self.head_size)
        if not isinstance(self.dtype, torch.dtype):
            raise InvalidArgumentError(f"dtype must be a torch.dtype, got {self.dtype!r}")

    def event_stamp(self) -> tuple[str, int | None]:
        """What this group's ``BlockStored`` events say of it, as vLLM publishes them:
        ``(kv_cache_spec_kind, kv_cache_spec_sliding_window)``."""
        return (self.kind if self.kind != "abstract" else "unknown", None)

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer (K and V)."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * _dtype_size(self.dtype)

    def max_blocks_per_request(self, max_model_len: int,
                               max_num_batched_tokens: int | None = None) -> int:
        """The most blocks one request can hold at once."""
        return _cdiv(max_model_len, self.block_size)

    def max_memory_usage_bytes(self, max_model_len: int,
                               max_num_batched_tokens: int | None = None) -> int:
        """Peak bytes one request needs in one layer of this type."""
        return self.max_blocks_per_request(max_model_len, max_num_batched_tokens) * self.page_size_bytes


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(KVCacheSpec):
    """Causal attention over the whole context: a request holds all its blocks until it ends."""

    kind: ClassVar[str] = "full_attention"


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(KVCacheSpec):
    """Each token attends to the last ``sliding_window`` tokens (itself included).

    ``bounded_replay`` (vLLM's ``SlidingWindowMLASpec(bounded_replay=True)``, DeepSeek-V4's
    sliding-window layers) makes the group scratch: never cached nor hit; after a prefix hit
    of the other groups a scheduler recomputes the hit's last ``sliding_window`` tokens
    (``prefix_replay_tokens``) to rebuild it, into fresh blocks (the positions below the window
    of the hit's next token are null, as for any window).

    ``extra_retained_tokens`` (vLLM's, for multi-module MTP, which re-prefills that many of a
    request's last tokens): a request keeps the blocks of that many tokens below its window
    too (they are released that much later and count in ``max_blocks_per_request``), though
    attention does not read them (``needed_positions``) and hits need no more blocks.  Not with
    ``bounded_replay``."""

    sliding_window: int
    bounded_replay: bool = False
    extra_retained_tokens: int = 0
    kind: ClassVar[str] = "sliding_window"
    admission_capped: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive("sliding_window", self.sliding_window)
        if not isinstance(self.bounded_replay, bool):
            raise InvalidArgumentError(f"bounded_replay must be a bool, got "
                                       f"{self.bounded_replay!r}")
        extra = self.extra_retained_tokens
        if type(extra) is not int or extra < 0:
            raise InvalidArgumentError(f"extra_retained_tokens must be an int >= 0, got "
                                       f"{extra!r}")
        if extra and self.bounded_replay:
            raise InvalidArgumentError(f"extra_retained_tokens ({extra}) with bounded_replay: a "
                                       "replayed scratch window retains nothing for later")

    @property
    def retained_tokens(self) -> int:
        """Tokens before a request's next one whose blocks it keeps: the window's
        ``sliding_window - 1`` plus ``extra_retained_tokens`` (vLLM 0.33's
        ``num_retained_tokens``)."""
        return self.sliding_window - 1 + self.extra_retained_tokens

    @property
    def prefix_cacheable(self) -> bool:
        return not self.bounded_replay

    @property
    def prefix_replay_tokens(self) -> int:
        return self.sliding_window if self.bounded_replay else 0

    def event_stamp(self) -> tuple[str, int | None]:
        return (self.kind, self.sliding_window)

    def needed_positions(self, num_tokens: int) -> range:
        return range(max(0, num_tokens - self.sliding_window + 1), max(num_tokens, 0))

    def max_blocks_per_request(self, max_model_len: int,
                               max_num_batched_tokens: int | None = None) -> int:
        # The last window-1 computed tokens (and the extra retained ones) plus one step's new
        # tokens are live; +1 because the window need not start on a block boundary.
        step = max_model_len if max_num_batched_tokens is None else max_num_batched_tokens
        return _cdiv(min(self.retained_tokens + step, max_model_len), self.block_size) + 1


@dataclass(frozen=True, kw_only=True)
class ChunkedLocalAttentionSpec(KVCacheSpec):
    """Tokens attend only within their ``attention_chunk_size``-aligned chunk (Llama-4 style)."""

    attention_chunk_size: int
    kind: ClassVar[str] = "chunked_local_attention"
    admission_capped: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive("attention_chunk_size", self.attention_chunk_size)

    def needed_positions(self, num_tokens: int) -> range:
        c = self.attention_chunk_size
        return range(max(num_tokens, 0) // c * c, max(num_tokens, 0))

    def max_blocks_per_request(self, max_model_len: int,
                               max_num_batched_tokens: int | None = None) -> int:
        step = max_model_len if max_num_batched_tokens is None else max_num_batched_tokens
        return _cdiv(min(self.attention_chunk_size + step, max_model_len), self.block_size)


def _collection(value: object) -> bool:
    """Whether ``value`` is a collection of items (an iterable other than a str or bytes)."""
    return isinstance(value, Iterable) and not isinstance(value, (str, bytes))


def _check_states(spec: MambaSpec) -> None:
    """Check a :class:`MambaSpec`'s ``shapes`` (a non-empty collection of shapes, each a
    collection of positive ints) and ``dtypes`` (one ``torch.dtype`` per shape), storing both as
    tuples; raises :class:`InvalidArgumentError` naming the bad value."""
    if not _collection(spec.shapes) or not _collection(spec.dtypes):
        raise InvalidArgumentError(f"MambaSpec.shapes and dtypes must be sequences (one dtype per "
                                   f"state shape), got {spec.shapes!r} and {spec.dtypes!r}")
    shapes: list[tuple[int, ...]] = []
    for shape in spec.shapes:
        dims = tuple(shape) if _collection(shape) else None
        if dims is None or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0
                                   for d in dims):  # (the rule of _positive)
            raise InvalidArgumentError(f"a MambaSpec state shape must be a sequence of positive "
                                       f"ints, got {shape!r}")
        shapes.append(dims)
    dtypes = tuple(spec.dtypes)
    if not shapes or len(dtypes) != len(shapes):
        raise InvalidArgumentError(f"MambaSpec needs one dtype per state shape, got shapes "
                                   f"{spec.shapes!r} and dtypes {spec.dtypes!r}")
    for dtype in dtypes:
        if not isinstance(dtype, torch.dtype):
            raise InvalidArgumentError(f"a MambaSpec dtype must be a torch.dtype, got {dtype!r}")
    object.__setattr__(spec, "shapes", tuple(shapes))
    object.__setattr__(spec, "dtypes", dtypes)


@dataclass(frozen=True, kw_only=True)
class MambaSpec(KVCacheSpec):
    """A recurrent state: a block holds the state after its last token, so only the most recent
    block matters; earlier ones are released as the request advances.  ``shapes``/``dtypes``
    describe the state tensors of one layer (conv state, SSM state, ...).

    ``mamba_cache_mode`` is vLLM's: ``"none"`` gives a request a block for every
    ``block_size`` tokens it computes and caches each state (right-most hit); ``"align"``
    (what vLLM runs hybrid models with under prefix caching) keeps only the running state block,
    the one it is copied from, and null positions in between, so a chunk of any length costs
    one new block; with ``num_prefill_checkpoint_blocks`` (1: Mamba2 layers) the prompt's last
    chunk also gets a block for the state at the prompt's last block boundary before its end,
    exported from inside the step (``prefill_checkpoint_alignment``: the token granularity the
    backend can export at), so a repeated prompt hits there.

    ``num_speculative_blocks`` (vLLM's, MTP/EAGLE drafting on a hybrid model: one per draft
    token) gives every request that many state blocks past its running state, where the
    verification step writes the states after each draft token: in ``"none"`` mode the table
    simply reaches that many blocks further; in ``"align"`` mode they follow the running state
    block and move along with it (a step that advances the state past them moves them to the
    table's new end and nulls their old positions).  A prefill checkpoint in ``"align"`` mode
    with speculative blocks needs the hit alignment equal to the block size (vLLM's layout)."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    num_kv_heads: int = 1
    head_size: int = 1
    mamba_cache_mode: str = "none"
    num_prefill_checkpoint_blocks: int = 0
    prefill_checkpoint_alignment: int | None = None
    num_speculative_blocks: int = 0
    kind: ClassVar[str] = "mamba"
    holds_state: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_states(self)
        if self.mamba_cache_mode not in ("none", "align"):
            raise InvalidArgumentError(f"mamba_cache_mode must be 'none' or 'align', got "
                                       f"{self.mamba_cache_mode!r}")
        n = self.num_prefill_checkpoint_blocks
        if not isinstance(n, int) or isinstance(n, bool) or n not in (0, 1):
            raise InvalidArgumentError(f"num_prefill_checkpoint_blocks must be 0 or 1, got {n!r}")
        if n and self.mamba_cache_mode != "align":
            raise InvalidArgumentError("num_prefill_checkpoint_blocks needs mamba_cache_mode "
                                       f"'align', got {self.mamba_cache_mode!r}")
        k = self.num_speculative_blocks
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise InvalidArgumentError(f"num_speculative_blocks must be an int >= 0, got {k!r}")
        if self.prefill_checkpoint_alignment is not None:
            _positive("prefill_checkpoint_alignment", self.prefill_checkpoint_alignment)
        elif n:  # (vLLM's models pair them: a checkpoint without it is never exported)
            raise InvalidArgumentError("num_prefill_checkpoint_blocks=1 needs "
                                       "prefill_checkpoint_alignment (the token granularity "
                                       "the backend exports the checkpoint at), got None")

    def needed_positions(self, num_tokens: int) -> range:
        return range(num_tokens - 1, num_tokens) if num_tokens > 0 else range(0)

    @property
    def page_size_bytes(self) -> int:
        return sum(math.prod(s) * _dtype_size(d) for s, d in zip(self.shapes, self.dtypes))

    def max_blocks_per_request(self, max_model_len: int,
                               max_num_batched_tokens: int | None = None) -> int:
        step = max_model_len if max_num_batched_tokens is None else max_num_batched_tokens
        k = self.num_speculative_blocks
        if self.mamba_cache_mode == "align":  # the running state, its source, a checkpoint
            return min(_cdiv(max_model_len, self.block_size) + k,
                       2 + self.num_prefill_checkpoint_blocks + k)
        return min(_cdiv(max_model_len, self.block_size), _cdiv(step, self.block_size) + 1) + k


@dataclass(frozen=True, kw_only=True)
class CrossAttentionSpec(KVCacheSpec):
    """Encoder-decoder cross attention: blocks for the encoder output, sized by the request's
    encoder tokens (taken at admission) and never shared through the prefix cache."""

    kind: ClassVar[str] = "cross_attention"
    cacheable: ClassVar[bool] = False
    reads_encoder: ClassVar[bool] = True

    def needed_positions(self, num_tokens: int) -> range:
        return range(0)  # it reads the encoder's KV, none of the request's tokens


@dataclass(frozen=True, kw_only=True)
class CircularBufferSpec(KVCacheSpec):
    """One block per request, a ring of ``block_size`` slots (vLLM's ``CircularBufferSpec``:
    the raw keys of the token group a compressor is still compressing, DeepSeek-V4's CSA
    compressor ring).  The block is taken at the request's first allocation and held until it
    is freed; it is scratch (never cached nor hit) and covers no token range, so its block size
    takes part in the hit alignment but not in the hash granularity."""

    kind: ClassVar[str] = "circular_buffer"
    cacheable: ClassVar[bool] = False

    def needed_positions(self, num_tokens: int) -> range:
        return range(0)  # the ring is rewritten in place: no position's KV stays in it

    def max_blocks_per_request(self, max_model_len: int,
                               max_num_batched_tokens: int | None = None) -> int:
        return 1


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one block table (and therefore one spec)."""

    layer_names: tuple[str, ...]
    spec: KVCacheSpec

    def __post_init__(self) -> None:
        if not _collection(self.layer_names) or not self.layer_names:
            raise InvalidArgumentError(
                f"a KV-cache group needs a non-empty sequence of layer names, got "
                f"{self.layer_names!r}")
        object.__setattr__(self, "layer_names", tuple(self.layer_names))
        if not all(isinstance(n, str) for n in self.layer_names):
            raise InvalidArgumentError(f"layer names must be str, got {self.layer_names!r}")
        if not isinstance(self.spec, KVCacheSpec):
            raise InvalidArgumentError(f"a KV-cache group's spec must be a KVCacheSpec, got "
                                       f"{self.spec!r}")


@dataclass(frozen=True)
class KVCacheConfig:
    """The groups of a model and the number of blocks in their shared pool (null block included).

    ``prefix_cache_retention_interval`` (vLLM 0.32's setting of the same name) sparsifies what
    sliding-window groups put in the prefix cache: ``None`` caches every block a hit could end
    on (dense); ``0`` only the window's tail before the prompt's replay boundaries and before a
    shared prefix some group has cached but this one has not (where a sibling request can
    resume); ``k > 0`` also one tail per ``k`` tokens.  It must be a multiple of the hit
    alignment.  Mamba ``"align"`` groups keep only the states at those boundaries (and one per
    ``k`` tokens); other attention types cache densely whatever it is (Mamba groups in ``"none"``
    mode refuse it).

    ``prefix_match_unit`` (vLLM's ``CacheConfig`` setting of the same name) hashes prompts every
    that many tokens instead of every gcd of the prefix-cacheable groups' block sizes; it must
    divide each of those block sizes, and with a single group be its block size (as vLLM
    requires).  Hits still end on the hit alignment (block boundaries),
    as with the gcd: a finer unit only moves where full-attention groups register a prompt's
    partial tail.

    ``partial_block_hits`` (vLLM's partial hash hits, which vLLM turns on exactly when a Mamba
    ``"align"`` group's blocks are larger than the hash unit and every other prefix-cacheable
    group is full attention or has blocks of one unit) lets a hit end on any hash unit, inside
    a block: the hit's shared tail block is copied on write into a fresh block of the request
    (a pending block copy whose endpoints stay withheld until the copy has run), and a Mamba
    "align" request that registered its prompt's last hash boundary inside its running state
    block hands that entry to a copy before it overwrites the state.  It needs exactly that
    configuration (else :class:`~kvcore.errors.InvalidArgumentError`); off (the default), hits
    end on block boundaries whatever the unit.  (Not with ``verify_hits``: a partial entry
    carries no prefix proof; the manager refuses it.)
    """

    num_blocks: int
    groups: tuple[KVCacheGroup, ...] = field(default=())
    prefix_cache_retention_interval: int | None = None
    prefix_match_unit: int | None = None
    partial_block_hits: bool = False

    def __post_init__(self) -> None:
        if self.num_blocks.__class__ is not int or self.num_blocks < 2:
            raise InvalidArgumentError(
                f"num_blocks must be an int >= 2 (block 0 is the null block), got {self.num_blocks!r}")
        if not _collection(self.groups):
            raise InvalidArgumentError(f"KVCacheConfig.groups must be a collection of KVCacheGroup "
                                       f"objects, got {self.groups!r}")
        object.__setattr__(self, "groups", tuple(self.groups))
        if not self.groups:
            raise InvalidArgumentError("a KV-cache config needs at least one group")
        for g in self.groups:
            if not isinstance(g, KVCacheGroup):
                raise InvalidArgumentError(f"KVCacheConfig.groups must hold KVCacheGroup "
                                           f"objects, got {g!r}")
        retention = self.prefix_cache_retention_interval
        if retention is not None:
            if type(retention) is not int or retention < 0:
                raise InvalidArgumentError(f"prefix_cache_retention_interval must be None or an "
                                           f"int >= 0, got {retention!r}")
            if retention % self.alignment_tokens:
                raise InvalidArgumentError(
                    f"prefix_cache_retention_interval={retention} must be a multiple of the hit "
                    f"alignment ({self.alignment_tokens} tokens)")
            if any(g.spec.kind == "mamba" and getattr(g.spec, "mamba_cache_mode", "") != "align"
                   for g in self.groups):
                raise InvalidArgumentError("prefix_cache_retention_interval is not implemented "
                                           "for Mamba groups outside 'align' mode (leave it None)")
        unit = self.prefix_match_unit
        if unit is not None:
            if type(unit) is not int or unit <= 0:
                raise InvalidArgumentError(f"prefix_match_unit must be None or a positive int, "
                                           f"got {unit!r}")
            sizes = [g.spec.block_size for g in self.groups if g.spec.prefix_cacheable]
            if len(self.groups) == 1 and unit != self.groups[0].spec.block_size:
                raise InvalidArgumentError(
                    f"prefix_match_unit={unit}: with a single KV-cache group hits land on its "
                    f"block size ({self.groups[0].spec.block_size} tokens); leave it unset or "
                    "set it to the block size (vLLM refuses it too)")
            if any(size % unit for size in sizes):
                raise InvalidArgumentError(f"prefix_match_unit={unit} must divide every prefix-"
                                           f"cacheable group's block size, got {sizes}")
        if self.partial_block_hits is not False:
            if self.partial_block_hits is not True:
                raise InvalidArgumentError(f"partial_block_hits must be a bool, got "
                                           f"{self.partial_block_hits!r}")
            self._check_partial_block_hits()
        windows = sorted({g.spec.prefix_replay_tokens for g in self.groups
                          if g.spec.prefix_replay_tokens})
        if len(windows) > 1:
            raise InvalidArgumentError(f"groups with bounded replay must replay one window "
                                       f"(vLLM's scheduler rewinds a hit by one), got {windows}")

    def _check_partial_block_hits(self) -> None:
        """Raise unless vLLM would serve partial-block hits for these groups."""
        unit = self.hash_block_size
        coarse = [i for i, g in enumerate(self.groups)
                  if g.spec.kind == "mamba" and getattr(g.spec, "mamba_cache_mode", "") == "align"
                  and g.spec.block_size > unit]
        if not coarse:
            raise InvalidArgumentError(
                f"partial_block_hits needs a Mamba 'align' group whose blocks are larger than "
                f"the {unit}-token hash unit (vLLM serves partial-block hits only then)")
        other = [i for i, g in enumerate(self.groups)
                 if g.spec.prefix_cacheable and g.spec.block_size != unit
                 and g.spec.kind not in ("full_attention", "mamba")]
        if other:
            raise InvalidArgumentError(
                f"partial_block_hits: groups {other} need hits on their block boundaries "
                f"(only full attention and Mamba find a hit inside a block; vLLM turns partial "
                "hits off for such a model)")

    @property
    def hit_alignment_tokens(self) -> int:
        """Where a prefix hit may end: every hash unit with ``partial_block_hits``, else the
        hit alignment (``alignment_tokens``)."""
        return self.hash_block_size if self.partial_block_hits else self.alignment_tokens

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def hash_block_size(self) -> int:
        """Token granularity of block hashes: ``prefix_match_unit`` when set, else the gcd of
        the prefix-cacheable groups' block sizes (scratch groups and cross attention are never
        hashed)."""
        if self.prefix_match_unit is not None:
            return self.prefix_match_unit
        sizes = [g.spec.block_size for g in self.groups if g.spec.prefix_cacheable]
        return math.gcd(*sizes) if sizes else self.groups[0].spec.block_size

    @property
    def alignment_tokens(self) -> int:
        """Granularity of a hybrid hit: the lcm of the block sizes of every group over the
        request's own tokens, scratch groups included (vLLM's scheduler block size; cross
        attention, over the encoder's tokens, is left out)."""
        sizes = [g.spec.block_size for g in self.groups if not g.spec.reads_encoder]
        return math.lcm(*sizes) if sizes else self.groups[0].spec.block_size

    @property
    def prefix_replay_tokens(self) -> int:
        """The bounded-replay window of the groups that have one (0: no group replays): a
        scheduler recomputes that many of a prefix hit's last tokens (at most the hit)."""
        return max((g.spec.prefix_replay_tokens for g in self.groups), default=0)


def bytes_per_block(groups: Sequence[KVCacheGroup]) -> int:
    """Memory one block id costs when layer ``i`` of every group shares slot ``i``'s tensor."""
    return (max(g.spec.page_size_bytes for g in groups)
            * max(len(g.layer_names) for g in groups))


def num_blocks_for_memory(groups: Sequence[KVCacheGroup], memory_bytes: int) -> int:
    """How many blocks (null block included) fit in ``memory_bytes``."""
    if not groups:
        raise InvalidArgumentError("num_blocks_for_memory needs at least one group")
    if not isinstance(memory_bytes, int) or memory_bytes < 0:
        raise InvalidArgumentError(f"memory_bytes must be a non-negative int, got {memory_bytes!r}")
    n = memory_bytes // bytes_per_block(groups)
    if n < 2:
        raise InvalidArgumentError(
            f"{memory_bytes} bytes hold {n} blocks of {bytes_per_block(groups)} bytes; need >= 2")
    return n


def group_layers(layer_specs: Sequence[tuple[str, KVCacheSpec]]) -> tuple[KVCacheGroup, ...]:
    """Split layers into groups of equal size: one size for all (the smallest per-spec layer
    count), layers of equal spec kept in model order.  Types are ordered by first appearance."""
    by_spec: dict[KVCacheSpec, list[str]] = {}
    for name, spec in layer_specs:
        by_spec.setdefault(spec, []).append(name)
    if not by_spec:
        raise InvalidArgumentError("no attention layers to group")
    size = min(len(names) for names in by_spec.values())
    groups = []
    for spec, names in by_spec.items():
        for i in range(0, len(names), size):
            groups.append(KVCacheGroup(tuple(names[i:i + size]), spec))
    return tuple(groups)


# -- transformers configs -------------------------------------------------------------------------

_SLIDING = {"sliding_attention", "sliding_window", "local_attention"}
_FULL = {"full_attention", "global_attention", "attention"}
_CHUNKED = {"chunked_attention"}


def layer_attention_types(hf_config: Any, num_layers: int) -> list[str]:
    """Per-layer attention type: ``full``, ``sliding`` or ``chunked``.

    Read from ``config.layer_types`` wherever the config declares it: transformers computes it
    (from ``use_sliding_window``/``max_window_layers``, ``sliding_window_pattern``,
    ``no_rope_layers`` and the like) for Gemma-2, Gemma-3, Cohere2, Qwen2, Qwen3 and Llama-4
    since 4.53, for GPT-OSS since its first release (4.55) and for Qwen2-MoE since 5.0, and a
    ``config.json`` that lists it gives it to any version.  Only configs without it take
    :func:`_derived_layer_types`."""
    declared = getattr(hf_config, "layer_types", None)
    if declared:
        out = []
        for i, t in enumerate(declared[:num_layers]):
            if t in _SLIDING:
                out.append("sliding")
            elif t in _FULL:
                out.append("full")
            elif t in _CHUNKED:
                out.append("chunked")
            else:
                raise InvalidArgumentError(f"layer {i} has unsupported attention type {t!r}")
        if len(out) != num_layers:
            raise InvalidArgumentError(
                f"config.layer_types has {len(declared)} entries for {num_layers} layers")
        return out
    return _derived_layer_types(hf_config, num_layers)


def _derived_layer_types(hf_config: Any, num_layers: int) -> list[str]:
    """Layer types of a config without ``layer_types``, as transformers' modeling code derives
    them.  Only needed for transformers 4.45-4.52 (Gemma-2, Gemma-3, Cohere2, Qwen2, Qwen3,
    Llama-4: the pattern lived in the modeling code), Qwen2-MoE before 5.0, Qwen3-MoE (no
    version declares it) and hand-made configs.  Llama, Mistral, Mixtral and the like never
    declare it: their layers are all alike (``sliding_window``, if set, on every layer)."""
    window = getattr(hf_config, "sliding_window", None)
    model_type = getattr(hf_config, "model_type", "") or ""
    if model_type.startswith(("qwen2", "qwen3")):
        # before 4.53 Qwen configs keep ``sliding_window`` set while use_sliding_window is off;
        # layers from max_window_layers on slide (4.x modeling; since 4.53 transformers slides
        # every Qwen3-MoE layer when it is on, which no released checkpoint turns on)
        if window and getattr(hf_config, "use_sliding_window", False):
            first = getattr(hf_config, "max_window_layers", 0)
            return ["sliding" if i >= first else "full" for i in range(num_layers)]
        return ["full"] * num_layers
    chunk = getattr(hf_config, "attention_chunk_size", None)
    if chunk:
        # Llama-4: chunked attention on the RoPE layers (no_rope_layers[i] == 1, since 4.52),
        # full attention on every 4th (NoPE) layer (4.51 hard-codes the interval)
        use_rope = getattr(hf_config, "no_rope_layers", None)
        if not use_rope and model_type.startswith("llama4"):
            use_rope = [int((i + 1) % 4 != 0) for i in range(num_layers)]
        if use_rope:
            if len(use_rope) < num_layers:
                raise InvalidArgumentError(
                    f"config.no_rope_layers has {len(use_rope)} entries for {num_layers} layers")
            return ["chunked" if use_rope[i] else "full" for i in range(num_layers)]
        return ["chunked"] * num_layers
    if not window:
        return ["full"] * num_layers
    # Gemma-3 (default 6) and Cohere2 (default 4) declare the period of their full layers;
    # Gemma-2 alternates sliding / full without declaring it
    pattern = getattr(hf_config, "sliding_window_pattern", None)
    if not pattern and model_type == "gemma2":
        pattern = 2
    if pattern:
        return ["full" if (i + 1) % int(pattern) == 0 else "sliding" for i in range(num_layers)]
    return ["sliding"] * num_layers


def config_dtype(hf_config: Any) -> torch.dtype:
    """The dtype a ``transformers`` config declares (bfloat16 if none)."""
    for attr in ("dtype", "torch_dtype"):
        value = getattr(hf_config, attr, None)
        if isinstance(value, torch.dtype):
            return value
        if isinstance(value, str) and isinstance(getattr(torch, value, None), torch.dtype):
            return getattr(torch, value)
    return torch.bfloat16


def kv_cache_config_from_hf(
    hf_config: Any,
    block_size: int = 16,
    num_blocks: int | None = None,
    memory_bytes: int | None = None,
    dtype: torch.dtype | None = None,
) -> KVCacheConfig:
    """Build the KV-cache groups of a ``transformers`` config (Llama, Qwen2/3, Mistral, Gemma-2/3,
    Cohere2, GPT-OSS, Llama-4, and anything declaring ``layer_types``).  Give either
    ``num_blocks`` or ``memory_bytes``; ``dtype`` defaults to the config's dtype."""
    text = getattr(hf_config, "text_config", None) or hf_config
    num_layers = getattr(text, "num_hidden_layers", None)
    num_heads = getattr(text, "num_attention_heads", None)
    if not num_layers or not num_heads:
        raise InvalidArgumentError("config has no num_hidden_layers / num_attention_heads")
    num_kv_heads = getattr(text, "num_key_value_heads", None) or num_heads
    head_size = getattr(text, "head_dim", None) or text.hidden_size // num_heads
    dtype = dtype or config_dtype(text)
    window = getattr(text, "sliding_window", None)
    chunk = getattr(text, "attention_chunk_size", None)
    layer_specs: list[tuple[str, KVCacheSpec]] = []
    for i, kind in enumerate(layer_attention_types(text, num_layers)):
        common = dict(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size,
                      dtype=dtype)
        spec: KVCacheSpec
        if kind == "sliding":
            if not window:
                raise InvalidArgumentError(f"layer {i} is sliding but config.sliding_window is unset")
            spec = SlidingWindowSpec(sliding_window=int(window), **common)
        elif kind == "chunked":
            if not chunk:
                raise InvalidArgumentError(f"layer {i} is chunked but attention_chunk_size is unset")
            spec = ChunkedLocalAttentionSpec(attention_chunk_size=int(chunk), **common)
        else:
            spec = FullAttentionSpec(**common)
        layer_specs.append((f"model.layers.{i}.self_attn", spec))
    groups = group_layers(layer_specs)
    if num_blocks is None:
        if memory_bytes is None:
            raise InvalidArgumentError("give num_blocks or memory_bytes")
        num_blocks = num_blocks_for_memory(groups, memory_bytes)
    return KVCacheConfig(num_blocks=num_blocks, groups=groups)
