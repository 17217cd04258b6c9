"""CacheSettings: every cache option in one object, validated when made, naming a bad value."""

from __future__ import annotations

import pytest

from kvcore import CacheSettings, KVCacheManager
from kvcore.errors import InvalidArgumentError
from kvcore.eviction import RECOMMENDED
from tests.factories import full_spec, make_config


def test_recommended_is_the_policy_and_its_hint_depth() -> None:
    s = CacheSettings.recommended(enable_events=True)
    assert (s.eviction_policy, s.queue_hints, s.enable_events) == (*RECOMMENDED, True)
    m = KVCacheManager(make_config(full_spec(), num_blocks=8), 64, settings=s)
    assert m.pool.eviction_policy == RECOMMENDED.policy == "learned" and m.settings is s


@pytest.mark.parametrize(("options", "words"), [
    ({"eviction_policy": "recommended"}, ("'recommended'", "CacheSettings.recommended()")),
    ({"queue_hints": -1}, ("queue_hints", "-1")),
    ({"queue_hints": True}, ("queue_hints", "True")),
    ({"verify_hits": "yes"}, ("verify_hits", "'yes'")),
    ({"eviction_policy": "mru"}, ("'mru'",)),
    ({"eviction_policy": "belady"}, ("'belady'", "simulator-only")),
    # Policy options are checked when the settings are made, not when a pool is built.
    ({"eviction_policy": "slru:protected_share=2"}, ("protected_share", "2.0")),
    ({"eviction_policy": "slru:bogus=1"}, ("'slru'", "bogus", "protected_share, ghost_factor")),
    ({"eviction_policy": "slru:protected_share=2,bogus=1"}, ("'slru'", "bogus")),
    ({"eviction_policy": "arc:ghost_factor=1"}, ("'arc'", "ghost_factor", "none")),
    ({"manager_classes": [1]}, ("manager_classes", "[1]")),
    ({"frobnicate": 1}, ("frobnicate",)),
])
def test_a_bad_option_is_refused_naming_it(options: dict[str, object],
                                           words: tuple[str, ...]) -> None:
    makers = [lambda: CacheSettings().replace(**options),
              lambda: KVCacheManager(make_config(full_spec(), num_blocks=8), 64, **options)]
    if "frobnicate" not in options:  # (an unknown field is the dataclass's TypeError)
        makers.append(lambda: CacheSettings(**options))  # type: ignore[arg-type]  # on purpose
    for make in makers:
        with pytest.raises(InvalidArgumentError) as excinfo:
            make()
        for word in words:
            assert word in str(excinfo.value)


def test_the_keyword_shorthand_is_the_same_settings() -> None:
    m = KVCacheManager(make_config(full_spec(), num_blocks=8), 64, eviction_policy="arc",
                       queue_hints=4)
    assert m.settings == CacheSettings(eviction_policy="arc", queue_hints=4)
    assert m.settings.replace(queue_hints=0) == CacheSettings(eviction_policy="arc")
