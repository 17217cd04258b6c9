"""kvcore's pytest plugin (entry point ``kvcore``): kvcore's checks inside your own test runs.

* ``pytest --kvcore-check``: every :class:`~kvcore.manager.KVCacheManager` built while a test
  runs checks itself after each public call (:func:`kvcore.testing.checked`);
  ``--kvcore-check-every N`` checks every N-th call, ``--kvcore-track-contents`` also follows
  what each KV slot holds (wrong-KV hits).  ``@pytest.mark.kvcore_unchecked`` opts a test out.
* ``kv_manager`` fixture: ``kv_manager("hybrid", num_blocks=64)`` builds a checked manager that
  also tracks contents, from spec names (``full``, ``swa``, ``chunked``, ``mamba``, ``hybrid``)
  or :class:`~kvcore.specs.KVCacheSpec` objects; at teardown every request must have been freed
  and every block must be free again (no forgotten ``free``, no leak).

Nothing of kvcore (nor torch, nor hypothesis) is imported unless one of these is used.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from kvcore.manager import KVCacheManager
    from kvcore.specs import KVCacheSpec

_STATE = pytest.StashKey[dict[str, Any]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvcore", "kvcore KV-cache checks")
    group.addoption("--kvcore-check", action="store_true",
                    help="check every KVCacheManager the tests build after each of its public "
                    "calls (invariants; kvcore.testing.checked)")
    group.addoption("--kvcore-check-every", type=int, default=1, metavar="N",
                    help="with --kvcore-check: check after every N-th call (default 1)")
    group.addoption("--kvcore-track-contents", action="store_true",
                    help="with --kvcore-check: also follow what each KV slot holds and check "
                    "every adopted hit and running table (wrong-KV hits)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "kvcore_unchecked: do not check the KVCacheManagers this test builds "
        "(--kvcore-check) nor the kv_manager fixture's leaks")
    if not config.getoption("--kvcore-check"):
        return
    from kvcore.manager import add_construction_hook
    from kvcore.testing.checked import checked

    state: dict[str, Any] = {"active": True}
    every = config.getoption("--kvcore-check-every")
    track = config.getoption("--kvcore-track-contents")

    def check_new_manager(manager: KVCacheManager) -> None:
        if state["active"]:
            checked(manager, every=every, track_contents=track)

    # Every manager built from now on is checked (kvcore's construction hook: the compiled
    # build's KVCacheManager cannot be patched); undone in unconfigure.
    state["remove_hook"] = add_construction_hook(check_new_manager)
    config.stash[_STATE] = state


def pytest_unconfigure(config: pytest.Config) -> None:
    state = config.stash.get(_STATE, None)
    if state is not None:
        state["remove_hook"]()


def pytest_runtest_setup(item: pytest.Item) -> None:
    state = item.config.stash.get(_STATE, None)
    if state is not None:
        state["active"] = item.get_closest_marker("kvcore_unchecked") is None


def pytest_runtest_teardown(item: pytest.Item) -> None:
    state = item.config.stash.get(_STATE, None)
    if state is not None:
        state["active"] = True


def spec_from_name(name: str, block_size: int, **kw: int) -> list[KVCacheSpec]:
    """The specs a name stands for: ``full``, ``swa`` (window ``window``, default 4 blocks),
    ``chunked`` (``chunk``, default 8 blocks), ``mamba``, ``hybrid`` (full + swa)."""
    import torch

    from kvcore.specs import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    common: dict[str, Any] = dict(block_size=block_size, num_kv_heads=1, head_size=8,
                                  dtype=torch.float16)
    window = kw.get("window", 4 * block_size)
    if name == "full":
        return [FullAttentionSpec(**common)]
    if name == "swa":
        return [SlidingWindowSpec(sliding_window=window, **common)]
    if name == "chunked":
        return [ChunkedLocalAttentionSpec(attention_chunk_size=kw.get("chunk", 8 * block_size),
                                          **common)]
    if name == "mamba":
        return [MambaSpec(block_size=block_size, shapes=((2, 4),), dtypes=(torch.float32,))]
    if name == "hybrid":
        return spec_from_name("full", block_size) + spec_from_name("swa", block_size,
                                                                   window=window)
    raise pytest.UsageError(f"kv_manager: unknown spec name {name!r}; use full, swa, chunked, "
                            "mamba, hybrid or KVCacheSpec objects")


@pytest.fixture
def kv_manager(request: pytest.FixtureRequest) -> Iterator[Callable[..., KVCacheManager]]:
    """Factory of checked, content-tracking KV-cache managers; leak-checked at teardown."""
    made: list[KVCacheManager] = []

    def make(*specs: str | KVCacheSpec, num_blocks: int = 64, block_size: int = 16,
             max_model_len: int = 2048, window: int | None = None, chunk: int | None = None,
             **manager_kwargs: Any) -> KVCacheManager:
        from kvcore.manager import KVCacheManager
        from kvcore.specs import KVCacheConfig, KVCacheGroup
        from kvcore.testing.checked import checked, is_checked, unchecked

        extra = {k: v for k, v in (("window", window), ("chunk", chunk)) if v is not None}
        resolved: list[KVCacheSpec] = []
        for s in specs or ("full",):
            resolved.extend(spec_from_name(s, block_size, **extra) if isinstance(s, str) else [s])
        groups = tuple(KVCacheGroup((f"layer{i}",), s) for i, s in enumerate(resolved))
        manager = KVCacheManager(KVCacheConfig(num_blocks, groups), max_model_len,
                                 **manager_kwargs)
        if is_checked(manager):  # --kvcore-check already did; re-check with contents tracked
            unchecked(manager)
        made.append(checked(manager, track_contents=True))
        return manager

    yield make
    if request.node.get_closest_marker("kvcore_unchecked") is not None:
        return
    from kvcore.testing.checked import assert_no_leak

    for manager in made:
        assert_no_leak(manager)
