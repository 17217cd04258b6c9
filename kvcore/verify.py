"""Exact verification of prefix-cache hits (``verify_hits=True``).

A block hash is evidence, not proof: a collision — an unlucky one, a deliberate one, or a weak
hash function — makes a lookup return a block whose KV was computed for other tokens, at another
position or after another prefix.  In verify mode every cached block also carries a
:class:`PrefixNode`, the exact identity of the prefix its KV belongs to: the block's tokens and
extra keys (LoRA, multimodal items, salt; with lookahead hashes, also the tokens after the block
that the drafter's KV read), its position, and the node of the block before it,
back to position 0.  A hit is served only when the found block's chain equals the request's own
prefix, compared token by token; hashes play no part in the proof.

Nodes are shared: a request that adopts a verified hit continues the hit's chain, so a prefix
that many requests use is stored once.  A node lives as long as a cached block or a running
request refers to it or to one of its descendants (a sliding-window hit needs the whole prefix
before its window, so that prefix stays known even after its blocks were evicted).

Cost: a :class:`HitVerifier` remembers every node it has proven or refuted for its request, so
each node is compared at most once per lookup.  A full-attention hit costs one block comparison
per block (the parent was proven one step earlier); a sliding-window or Mamba hit additionally
walks the chain before its first block once.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, cast, overload

from kvcore.hashing import hash_extra_keys
from kvcore.types import PrefixNode

if TYPE_CHECKING:
    from kvcore.request import RequestLike


def _is_plain(request: RequestLike) -> bool:
    return request.lora_name is None and not request.mm_items and request.cache_salt is None


class HitVerifier:
    """Decides whether cached prefixes equal one request's prefix (see the module docstring).

    ``matches(node, index, block_size)`` is true when ``node`` is exactly the request's prefix
    ending with its block ``index`` of ``block_size`` tokens.
    """

    __slots__ = ("_last", "_lookahead", "_memo", "_plain", "_request", "_tokens")

    def __init__(self, request: RequestLike, lookahead: int = 0) -> None:
        self._request = request
        self._tokens = request.all_token_ids
        self._lookahead = lookahead
        self._plain = not lookahead and _is_plain(request)
        self._memo: dict[PrefixNode, bool] = {}  # node -> equals the request's prefix there
        self._last: PrefixNode | None = None  # the node proven most recently (None: the root)

    def matches(self, node: PrefixNode | None, index: int, block_size: int) -> bool:
        if node is None or node.index != index or len(node.tokens) != block_size:
            return False
        parent = node.parent
        last = self._last
        if parent is last and (index == 0 if last is None else last.index == index - 1):
            # The common case (a hit scanned left to right): the parent was just proven.
            start = index * block_size
            ok = node.tokens == self._tokens[start:start + block_size] and (
                (self._plain and node.extra is None)
                or node.extra == hash_extra_keys(self._request, start, start + block_size,
                                                 self._lookahead))
            self._memo[node] = ok
            if ok:
                self._last = node
            return ok
        memo = self._memo
        tokens = self._tokens
        path: list[PrefixNode] = []
        n: PrefixNode | None = node
        ok = True
        while n is not None:
            known = memo.get(n)
            if known is not None:
                ok = known
                break
            path.append(n)
            start = n.index * block_size
            end = start + block_size
            parent = n.parent
            if (n.tokens != tokens[start:end] or len(n.tokens) != block_size
                    or (parent.index != n.index - 1 if parent is not None else n.index != 0)
                    or n.extra != (None if self._plain
                                   else hash_extra_keys(self._request, start, end,
                                                        self._lookahead))):
                ok = False  # other tokens, or a chain that does not reach back to position 0
                break
            n = parent
        for p in path:  # a mismatch anywhere above makes every descendant a mismatch too
            memo[p] = ok
        if ok:
            self._last = node
        return ok


class _Chain:
    """One request's prefix nodes at one block size: ``base`` (an adopted hit's deepest node,
    standing for itself and its ancestors) followed by the nodes built from the request's own
    tokens.  Adopting a hit costs O(1); the ancestors are only walked if someone asks for them.

    A ``Sequence`` registered as one, not derived from it: a compiled class with a Python base
    gets a ``__weakref__`` slot that mypyc 2.4's deallocator never clears (see
    docs/mypyc_weakref_bug.md), so a weak reference to a freed chain would dangle."""

    __slots__ = ("base", "tail")

    def __init__(self, base: PrefixNode | None) -> None:
        self.base = base
        self.tail: list[PrefixNode] = []

    def __len__(self) -> int:
        return (0 if self.base is None else self.base.index + 1) + len(self.tail)

    @overload
    def __getitem__(self, i: int) -> PrefixNode: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[PrefixNode]: ...

    def __getitem__(self, i: int | slice) -> PrefixNode | Sequence[PrefixNode]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n_base = 0 if self.base is None else self.base.index + 1
        if i < 0:
            i += len(self)
        if i >= n_base:
            return self.tail[i - n_base]
        node = self.base
        while node is not None and node.index > i:
            node = node.parent
        if node is None or i < 0:
            raise IndexError(i)
        return node

    def __iter__(self) -> Iterator[PrefixNode]:
        for i in range(len(self)):
            yield self[i]

    def last(self) -> PrefixNode | None:
        return self.tail[-1] if self.tail else self.base


Sequence.register(_Chain)


class PrefixChains:
    """The prefix nodes of the requests a manager tracks, one chain per request and block size.

    ``nodes(request, block_size, count)`` extends the request's chain to ``count`` nodes from its
    own tokens; ``adopt`` starts it with a verified hit's chain instead, so shared prefixes share
    nodes; ``drop`` forgets the request (its cached blocks keep the nodes they need).
    """

    __slots__ = ("_chains", "_lookahead")

    def __init__(self, lookahead: int = 0) -> None:
        self._chains: dict[str, dict[int, _Chain]] = {}
        self._lookahead = lookahead

    def nodes(self, request: RequestLike, block_size: int,
              count: int) -> Sequence[PrefixNode]:
        per_size = self._chains.get(request.request_id)
        if per_size is None:
            per_size = self._chains[request.request_id] = {}
        chain = per_size.get(block_size)
        if chain is None:
            chain = per_size[block_size] = _Chain(None)
        have = len(chain)
        if have < count:
            tokens = request.all_token_ids
            lookahead = self._lookahead
            plain = not lookahead and _is_plain(request)
            parent = chain.last()
            tail = chain.tail
            for i in range(have, count):
                start = i * block_size
                end = start + block_size
                parent = PrefixNode(parent, i, tokens[start:end], None if plain
                                    else hash_extra_keys(request, start, end, lookahead))
                tail.append(parent)
        return cast("Sequence[PrefixNode]", chain)  # a Sequence by registration (mypy: not)

    def adopt(self, request_id: str, block_size: int, node: PrefixNode) -> None:
        """The request's chain at ``block_size`` becomes ``node`` and its ancestors (``node``
        must have been verified against the request)."""
        per_size = self._chains.get(request_id)
        if per_size is None:
            per_size = self._chains[request_id] = {}
        per_size[block_size] = _Chain(node)

    def drop(self, request_id: str) -> None:
        self._chains.pop(request_id, None)

    def request_ids(self) -> list[str]:
        return list(self._chains)
