"""The vLLM version check without vLLM: full PEP 440 versions, pre-release and development
builds only with ``allow_unreleased_vllm``, and the contract probe of an unlisted version over a
fake vLLM surface built from the recorded contract (kvcore.integrations.vllm.version /
.contract; the real vLLMs against their own records: tests/integrations/vllm/test_contract.py)."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Mapping
from dataclasses import make_dataclass
from typing import Any

import pytest

from kvcore.errors import InvalidArgumentError, UnsupportedFeatureError
from kvcore.integrations.vllm.contract import (
    CALLS,
    CLASSES,
    CONTRACTS,
    EVENTS,
    Contract,
    VllmSurface,
    capture,
    differences,
)
from kvcore.integrations.vllm.settings import parse_settings
from kvcore.integrations.vllm.version import VllmVersionWarning, parse_version


def _method(params: tuple[tuple[str, str], ...]) -> Callable[..., None]:
    def method(self: Any, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("the probe must not call vLLM")

    sig = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    sig += [inspect.Parameter(n, getattr(inspect.Parameter, k)) for n, k in params]
    method.__signature__ = inspect.Signature(sig)  # type: ignore[attr-defined]  # fake vLLM
    return method


def fake_surface(contract: Contract, *, calls: Mapping[str, Any] | None = None,
                 drop: Mapping[str, str] | None = None,
                 events: Mapping[str, tuple[str, ...]] | None = None) -> VllmSurface:
    """Classes offering exactly ``contract`` (its public names, calls and the names kvcore
    answers), with ``calls`` replacing some calls' parameters, ``drop`` removing one name from
    a class, ``events`` replacing some events' fields."""
    calls = {**contract.calls, **(calls or {})}
    classes: dict[str, type] = {}
    for cls in CLASSES:
        body: dict[str, Any] = {n: None for n in contract.names[cls]}
        # The other names kvcore answers are set on the objects by a method, as vLLM's are.
        attrs = [n for n in contract.view_names.get(cls, ()) if n not in body
                 and n != (drop or {}).get(cls)]
        source = "def _setup(self):\n" + "".join(f"    self.{n} = None\n" for n in attrs)
        exec(source, body)  # (a method that sets exactly these names)
        del body["__builtins__"]
        for call, params in calls.items():
            owner, method = call.split(".")
            if owner == cls:
                body[method] = _method(params)
        if drop and cls in drop:
            body.pop(drop[cls], None)
        classes[cls] = type(cls, (), body)
    fields = {**contract.events, **(events or {})}
    return VllmSurface(classes, {e: make_dataclass(e, list(fields[e])) for e in EVENTS})


def _probe(surface: VllmSurface) -> Callable[[tuple[int, int]], list[str]]:
    return lambda near: differences(CONTRACTS[near], surface)


# -- versions -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "minor"), [
    ("0.32.0", 32), ("0.32.0+cpu", 32), ("0.33.2", 33), ("0.33.0.post1", 33),
    ("v0.33.1+cu128", 33), ("0.32", 32)])
def test_releases_of_supported_minors_run_without_a_warning(text: str, minor: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        v = parse_version(text)
    assert (v.major, v.minor, v.unreleased, v.probed) == (0, minor, False, False)


@pytest.mark.parametrize("text", ["0.33.1rc1.dev5+g0123abc", "0.33.1rc1", "0.32.0.dev3",
                                  "0.33.0b2", "0.33.0a1", "0.33.1.dev0+gdeadbeef.cpu"])
def test_unreleased_builds_are_refused_naming_the_build_and_the_setting(text: str) -> None:
    with pytest.raises(UnsupportedFeatureError) as err:
        parse_version(text)
    assert f"vLLM {text} is a pre-release or development build" in str(err.value)
    assert "additional_config['kvcore']['allow_unreleased_vllm']" in str(err.value)


def test_an_allowed_unreleased_build_runs_with_one_warning_naming_it() -> None:
    with pytest.warns(VllmVersionWarning) as caught:
        v = parse_version("0.33.1rc1.dev5+g0123abc", allow_unreleased=True)
    assert len(caught) == 1
    assert "vLLM 0.33.1rc1.dev5+g0123abc" in str(caught[0].message)
    assert "allow_unreleased_vllm" in str(caught[0].message)
    assert (v.minor, v.unreleased, v.probed, v.lookahead_hashes) == (33, True, False, True)


@pytest.mark.parametrize("text", ["", "dev", "0.33.x", "1!0.33.0", "latest"])
def test_text_that_is_no_supported_version_is_refused(text: str) -> None:
    with pytest.raises(UnsupportedFeatureError, match=r"supports vLLM 0\.32, 0\.33"):
        parse_version(text, allow_unreleased=True, probe=lambda near: [])


def test_an_unlisted_version_without_a_probe_is_refused() -> None:
    with pytest.raises(UnsupportedFeatureError, match=r"not vLLM 0\.34\.0"):
        parse_version("0.34.0")


# -- the probe ------------------------------------------------------------------------------------
def test_a_recorded_contract_is_what_its_fake_surface_offers() -> None:
    for contract in CONTRACTS.values():
        surface = fake_surface(contract)
        got = capture(surface)
        assert (dict(got.calls), dict(got.names), dict(got.events)) == (
            dict(contract.calls), dict(contract.names), dict(contract.events))
        assert differences(contract, surface) == []


def test_an_unlisted_version_whose_contract_matches_runs_with_033_and_one_warning() -> None:
    surface = fake_surface(CONTRACTS[(0, 33)])
    with pytest.warns(VllmVersionWarning) as caught:
        v = parse_version("0.34.0", probe=_probe(surface))
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "vLLM 0.34.0" in message and "matches vLLM 0.33's" in message
    assert (v.major, v.minor, v.text, v.probed) == (0, 33, "0.34.0", True)
    assert v.lookahead_hashes and v.eagle_junction_tail and not v.mamba_recache_prompt_boundary


def test_an_older_unlisted_version_is_checked_against_032() -> None:
    asked: list[tuple[int, int]] = []

    def probe(near: tuple[int, int]) -> list[str]:
        asked.append(near)
        return differences(CONTRACTS[near], fake_surface(CONTRACTS[(0, 32)]))

    with pytest.warns(VllmVersionWarning):
        v = parse_version("0.31.2", probe=probe)
    assert asked == [(0, 32)]
    assert (v.minor, v.lookahead_hashes, v.mamba_recache_prompt_boundary) == (32, False, True)


def test_a_manager_that_gained_a_keyword_is_refused_naming_it() -> None:
    init = (*CONTRACTS[(0, 33)].calls["KVCacheManager.__init__"], ("foo", "KEYWORD_ONLY"))
    surface = fake_surface(CONTRACTS[(0, 33)], calls={"KVCacheManager.__init__": init})
    with pytest.raises(UnsupportedFeatureError) as err, warnings.catch_warnings():
        warnings.simplefilter("error")  # refused: no warning first
        parse_version("0.34.0", probe=_probe(surface))
    message = str(err.value)
    assert "not vLLM 0.34.0" in message
    assert "KVCacheManager.__init__ gained parameter 'foo' (keyword-only)" in message


def test_every_kind_of_difference_is_listed() -> None:
    contract = CONTRACTS[(0, 33)]
    alloc = contract.calls["KVCacheManager.allocate_slots"]
    moved = tuple((n, "KEYWORD_ONLY") if n == "skip_zeroing_group_ids" else (n, k) for n, k in alloc)
    stored = tuple(f for f in contract.events["BlockStored"] if f != "medium")
    surface = fake_surface(
        contract, calls={"KVCacheManager.allocate_slots": moved,
                         "KVCacheManager.get_computed_blocks": (("request", "POSITIONAL_OR_KEYWORD"),)},
        drop={"BlockPool": "touch", "SingleTypeKVCacheManager": "req_to_blocks"},
        events={"BlockRemoved": (*contract.events["BlockRemoved"], "tier")})
    surface.classes["BlockPool"].get_new_blocks_fast = None  # type: ignore[attr-defined]
    surface.events["BlockStored"] = make_dataclass("BlockStored", list(stored))  # type: ignore[index]
    found = differences(contract, surface)
    assert found == [
        "KVCacheManager.allocate_slots parameter 'skip_zeroing_group_ids' is now keyword-only "
        "(was positional or keyword)",
        "KVCacheManager.get_computed_blocks lost parameter 'max_cache_hit_length'",
        "BlockPool gained 'get_new_blocks_fast'",
        "BlockPool lost 'touch'",
        "SingleTypeKVCacheManager no longer defines 'req_to_blocks', which kvcore answers for it",
        "BlockPool no longer defines 'touch', which kvcore answers for it",
        "KV event BlockStored lost field 'medium'",
        "KV event BlockRemoved gained field 'tier'",
    ]


def test_a_missing_class_or_call_is_a_difference_not_a_crash() -> None:
    contract = CONTRACTS[(0, 33)]
    surface = fake_surface(contract)
    classes = dict(surface.classes)
    del classes["FreeKVCacheBlockQueue"]
    delattr(classes["HybridKVCacheCoordinator"], "find_longest_cache_hit_per_group")
    found = differences(contract, VllmSurface(classes, {}))
    assert "vLLM has no class FreeKVCacheBlockQueue (kvcore's adapter stands in for it)" in found
    assert "vLLM has no KV event BlockStored (kvcore publishes it)" in found
    assert "HybridKVCacheCoordinator.find_longest_cache_hit_per_group no longer exists" in found


def test_the_recorded_contracts_cover_the_same_calls_and_classes() -> None:
    for contract in CONTRACTS.values():
        assert tuple(contract.calls) == CALLS
        assert set(contract.names) == set(CLASSES)
        assert set(contract.events) == set(EVENTS)
        assert set(contract.view_names) <= set(CLASSES)


# -- the setting ----------------------------------------------------------------------------------
def test_allow_unreleased_vllm_is_a_bool_setting() -> None:
    assert parse_settings(None).allow_unreleased_vllm is False
    assert parse_settings({"allow_unreleased_vllm": True}).allow_unreleased_vllm is True
    with pytest.raises(InvalidArgumentError, match=r"allow_unreleased_vllm'.*must be a bool"):
        parse_settings({"allow_unreleased_vllm": "yes"})
