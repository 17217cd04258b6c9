"""The installed vLLM against the contract kvcore records for it; the version check at engine
start (unlisted versions probed, unreleased builds only with the setting); the views' typed
refusal of names they do not provide; the retained longer hits and the coordinator lookup
against vLLM's own manager (kvcore.integrations.vllm.contract / .version / .views)."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import pytest
import vllm.version

from kvcore.errors import (
    InvalidArgumentError,
    InvalidGroupError,
    UnsupportedFeatureError,
    ViewAttributeError,
)
from kvcore.integrations.vllm import contract as contract_module
from kvcore.integrations.vllm import views
from kvcore.integrations.vllm.contract import CONTRACTS, capture, differences, load_surface
from kvcore.integrations.vllm.manager import KVCacheManagerAdapter
from kvcore.integrations.vllm.replay import Engine, ReplaySetup, make_scheduler
from kvcore.integrations.vllm.version import VllmVersionWarning, installed, parse_version
from tests.integrations.vllm.helpers import full, kv_config, managers, request, swa

VERSION = installed()
CONTRACT = CONTRACTS[(VERSION.major, VERSION.minor)]


# -- the recorded contract -------------------------------------------------------------------------
def test_the_installed_vllm_matches_its_recorded_contract() -> None:
    surface = load_surface()
    got = capture(surface)
    assert dict(got.calls) == dict(CONTRACT.calls)
    assert dict(got.names) == dict(CONTRACT.names)
    assert dict(got.events) == dict(CONTRACT.events)
    assert differences(CONTRACT, surface) == []


def test_the_other_supported_version_differs_by_what_version_py_lists() -> None:
    other = CONTRACTS[(0, 65 - VERSION.minor)]  # 0.32 <-> 0.33
    found = differences(other, load_surface())
    assert any("'num_hash_lookahead_tokens'" in d for d in found)  # lookahead hashes
    assert any("get_computed_blocks " in d and "max_cache_hit_length" in d for d in found)
    assert any("lookahead_token_ids" in d for d in found)


def _answered(view_cls: type) -> set[str]:
    """The names a view class answers for vLLM's (its own state aside)."""
    own = {"_kv", "_pool", "_views", "_manager", "_complete", "block", "view"}
    return {n for n in dir(view_cls) if not n.startswith("__") and n not in own
            and n not in dir(views._View)} | set(getattr(view_cls, "__slots__", ())) - own


@pytest.mark.parametrize(("vllm_classes", "view_cls", "kvcore_only"), [
    (("BlockPool",), views.BlockPoolView,
     {"num_hash_lookahead_tokens"} if VERSION.minor == 32 else set()),
    (("SingleTypeKVCacheManager",), views.GroupView, {"retains_complete_hit"}),
    (("KVCacheCoordinator", "HybridKVCacheCoordinator"), views.HybridCoordinatorView,
     {"drop_eagle_group_ids"} if VERSION.minor == 32 else set()),
    (("FreeKVCacheBlockQueue",), views.FreeBlockQueueView, set()),
    (("KVCacheBlock",), views.BlockView, set()),
])
def test_the_recorded_view_names_are_what_each_view_answers(
        vllm_classes: tuple[str, ...], view_cls: type, kvcore_only: set[str]) -> None:
    recorded = {n for c in vllm_classes for n in CONTRACT.view_names[c]}
    assert _answered(view_cls) - kvcore_only == recorded


def test_the_recorded_manager_names_are_the_adapters() -> None:
    adapter, = managers(kv_config())[1:]
    for name in CONTRACT.view_names["KVCacheManager"]:
        getattr(adapter, name)  # (raises if the adapter lost one)


# -- the version check at engine start -------------------------------------------------------------
def _patch_version(monkeypatch: pytest.MonkeyPatch, text: str, near: tuple[int, int],
                   expected: Any) -> None:
    monkeypatch.setattr(vllm.version, "__version__", text)
    monkeypatch.setitem(contract_module.CONTRACTS, near, expected)  # type: ignore[arg-type]


def test_an_unlisted_version_whose_contract_differs_stops_the_scheduler_naming_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    init = tuple(p for p in CONTRACT.calls["KVCacheManager.__init__"] if p[0] != "watermark")
    # Recorded without `watermark`: the installed manager "gained" it.
    expected = dataclasses.replace(CONTRACT, calls={**CONTRACT.calls,
                                                    "KVCacheManager.__init__": init})
    _patch_version(monkeypatch, "0.34.0", (0, 33), expected)
    with pytest.raises(UnsupportedFeatureError) as err:
        make_scheduler(ReplaySetup(), Engine.parse("kvcore"))
    assert "not vLLM 0.34.0" in str(err.value)
    assert "KVCacheManager.__init__ gained parameter 'watermark'" in str(err.value)
    make_scheduler(ReplaySetup(), Engine.parse("vllm"))  # vLLM alone is not kvcore's business


def test_an_unlisted_version_whose_contract_matches_runs_with_one_warning(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _patch_version(monkeypatch, "0.34.0", (0, 33), CONTRACT)
    with pytest.warns(VllmVersionWarning) as caught:
        sched = make_scheduler(ReplaySetup(), Engine.parse("kvcore"))
    assert [str(w.message).count("vLLM 0.34.0") for w in caught] == [1]
    assert sched.kv_cache_manager.vllm_version.probed
    assert sched.kv_cache_manager.vllm_version.minor == 33


def test_a_dev_build_needs_the_setting_at_engine_start(monkeypatch: pytest.MonkeyPatch) -> None:
    text = f"0.{VERSION.minor}.1rc1.dev5+g0123abc"
    monkeypatch.setattr(vllm.version, "__version__", text)
    with pytest.raises(UnsupportedFeatureError, match="allow_unreleased_vllm"):
        make_scheduler(ReplaySetup(), Engine.parse("kvcore"))
    with pytest.warns(VllmVersionWarning, match=text.replace("+", r"\+")) as caught:
        sched = make_scheduler(ReplaySetup(), Engine.parse("kvcore"),
                               additional_config={"kvcore": {"allow_unreleased_vllm": True}})
    assert len(caught) == 1
    assert sched.kv_cache_manager.vllm_version.unreleased


# -- views: typed refusals -------------------------------------------------------------------------
def _views(adapter: KVCacheManagerAdapter) -> list[Any]:
    pool = adapter.block_pool
    return [pool, pool.free_block_queue, pool.blocks, pool.blocks[1],
            pool.cached_block_hash_to_block, pool.cached_block_hashes_by_block,
            adapter.coordinator, adapter.coordinator.single_type_managers[0]]


def test_a_name_a_view_does_not_provide_is_a_typed_error_naming_view_and_name() -> None:
    _, adapter = managers(kv_config(full(), swa(32)))
    for view in _views(adapter):
        name = type(view).__name__
        with pytest.raises(ViewAttributeError) as err:
            view.move_block_hashes  # noqa: B018
        assert isinstance(err.value, AttributeError)
        assert isinstance(err.value, UnsupportedFeatureError)
        assert (err.value.view, err.value.name) == (name, "move_block_hashes")
        assert f"reading 'move_block_hashes' on kvcore's {name}" in str(err.value)
        assert "vLLM internal kvcore's view does not provide" in str(err.value)
        assert not hasattr(view, "move_block_hashes")
        assert getattr(view, "move_block_hashes", 7) == 7


def test_setting_a_name_on_a_view_is_a_typed_error_and_changes_nothing() -> None:
    _, adapter = managers(kv_config(full(), swa(32)))
    group = adapter.coordinator.single_type_managers[0]
    for view, name in [(adapter.block_pool, "anything_new"),
                       # (num_free_blocks is settable: test_pool_views.py)
                       (adapter.block_pool.free_block_queue, "fake_free_list_head"),
                       (adapter.block_pool, "enable_caching"),  # set once, by kvcore
                       (group, "block_pool"), (group, "use_eagle"),
                       (adapter.coordinator, "enable_partial_hash_hits"),
                       (adapter.coordinator, "single_type_managers"),
                       (adapter.block_pool.blocks[1], "ref_cnt")]:
        before = getattr(view, name, None)
        with pytest.raises(ViewAttributeError, match=f"setting '{name}' on kvcore's"):
            setattr(view, name, 0)
        assert getattr(view, name, None) is before


# -- retained longer hits --------------------------------------------------------------------------
def _retain(manager: Any, group_ids: tuple[int, ...]) -> None:
    """What a connector's bind does (vLLM's OffloadingConnector, hybrid models)."""
    for g in group_ids:
        manager.coordinator.single_type_managers[g].retains_longer_hit = True
        manager.coordinator.single_type_managers[g].retains_complete_hit = True
    manager.retained_hit_group_ids = tuple(
        dict.fromkeys((*manager.retained_hit_group_ids, *group_ids)))


def _ids(blocks: Any) -> list[list[int]]:
    return [[b.block_id for b in group] for group in blocks]


@pytest.mark.parametrize("retain", [False, True])
@pytest.mark.parametrize("external", [0, 16])
def test_retained_longer_hits_match_vllm(retain: bool, external: int) -> None:
    """A full-attention group whose window partner lost a block: the coordinator's lookup,
    the manager's lookup and an admission with external tokens, kvcore as vLLM, with and
    without the full-attention group retaining its longer hit."""
    ms = managers(kv_config(full(), swa(32), num_blocks=32))
    outs = []
    for m in ms:
        if retain:
            _retain(m, (0,))
            assert m.coordinator.single_type_managers[0].retains_longer_hit
            assert m.retained_hit_group_ids == (0,)
        a = request("a", range(64))
        blocks, hit, _ = m.get_computed_blocks(a)
        m.allocate_slots(a, 64, hit, blocks)
        a.num_computed_tokens = 64
        m.cache_blocks(a, 64)
        fa_ids, swa_ids = m.get_block_ids("a")
        m.free(a)
        m.evict_blocks([swa_ids[3]])  # the window block at tokens 48..63
        b = request("b", [*range(64), *range(500, 520)])
        coord = m.coordinator.find_longest_cache_hit(b.block_hashes, b.num_tokens - 1)
        blocks, hit, _ = m.get_computed_blocks(b)
        new = m.allocate_slots(b, b.num_tokens - hit - external, hit, blocks,
                               num_external_computed_tokens=external)
        assert new is not None
        outs.append((_ids(coord[0]), coord[1:], _ids(blocks.blocks), hit, m.get_block_ids("b"),
                     fa_ids))
    assert outs[0] == outs[1]
    coord_ids, (length, uncached), hit_ids, hit, tables, fa_ids = outs[1]
    assert (length, uncached, hit) == (48, 16, 48)
    assert len(coord_ids[0]) == len(hit_ids[0]) == (4 if retain else 3)  # full attention's hit
    # Retained, the resident block stands for the external tokens in the full-attention group.
    assert (tables[0][3] == fa_ids[3]) is (retain and external > 0)


def test_retention_flags_take_bools_and_valid_groups() -> None:
    _, adapter = managers(kv_config(full(), swa(32)))
    group = adapter.coordinator.single_type_managers[1]
    assert (group.retains_longer_hit, group.retains_complete_hit) == (False, False)
    with pytest.raises(InvalidArgumentError, match="retains_longer_hit must be a bool"):
        group.retains_longer_hit = 1
    with pytest.raises(InvalidArgumentError, match="retains_complete_hit must be a bool"):
        group.retains_complete_hit = "yes"
    with pytest.raises(InvalidGroupError, match="5 is not a group id"):
        adapter.retained_hit_group_ids = (0, 5)
    assert adapter.retained_hit_group_ids == ()
    group.retains_longer_hit = True
    group.retains_complete_hit = True
    assert adapter.retained_hit_group_ids == (1,)
    assert (group.retains_longer_hit, group.retains_complete_hit) == (True, True)
    group.retains_longer_hit = False
    assert adapter.retained_hit_group_ids == ()


def test_the_version_check_runs_once_per_engine_start(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real = parse_version

    def counting(text: str, **kwargs: Any) -> Any:
        calls.append(text)
        return real(text, **kwargs)

    monkeypatch.setattr("kvcore.integrations.vllm.version.parse_version", counting)
    with warnings.catch_warnings():
        warnings.simplefilter("error", VllmVersionWarning)
        make_scheduler(ReplaySetup(), Engine.parse("kvcore"))
    assert len(calls) == 1


def test_offloading_connector_binds_through_the_views() -> None:
    """vLLM's OffloadingConnector (whose bind, after 0.33, sets the retention flags and looks
    hits up through the coordinator: the calls test_retained_longer_hits_match_vllm makes) is
    accepted, as SimpleCPUOffloadConnector is; a subclass with a bind of its own is not."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )

    from kvcore.integrations.vllm.scheduler import _binds_through_views

    class OwnBind(OffloadingConnector):
        def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
            raise AssertionError("never called")

    assert _binds_through_views(OffloadingConnector)
    assert not _binds_through_views(OwnBind)
