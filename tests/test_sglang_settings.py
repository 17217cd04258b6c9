"""The parts of kvcore's SGLang backend that do not import SGLang (its settings and its page
hashes), in kvcore's own venv; the backend itself is tested in the SGLang venv
(tests/integrations/sglang)."""

from __future__ import annotations

import hashlib
import struct

import pytest

from kvcore.errors import InvalidArgumentError, UnsupportedFeatureError
from kvcore.eviction import RECOMMENDED
from kvcore.integrations.sglang.hashing import event_seed, page_digest, storage_seed
from kvcore.integrations.sglang.settings import SGLangSettings


def test_defaults_follow_sglangs_policy_argument() -> None:
    assert SGLangSettings.from_env({}) == SGLangSettings("lru", False, 0)
    assert SGLangSettings.from_env({}, sglang_policy="slru").eviction_policy == "slru"
    with pytest.raises(UnsupportedFeatureError, match="KVCORE_SGLANG_EVICTION_POLICY"):
        SGLangSettings.from_env({}, sglang_policy="lfu")


def test_environment_settings() -> None:
    s = SGLangSettings.from_env({"KVCORE_SGLANG_EVICTION_POLICY": "recommended",
                                 "KVCORE_SGLANG_VERIFY_HITS": "true",
                                 "KVCORE_SGLANG_CHECK_INVARIANTS_EVERY": "8"}, sglang_policy="lfu")
    assert s == SGLangSettings(RECOMMENDED.policy, True, 8)
    spec = "slru:protected_share=0.3"
    assert SGLangSettings.from_env({"KVCORE_SGLANG_EVICTION_POLICY": spec}).eviction_policy == spec


@pytest.mark.parametrize(("env", "error"), [
    ({"KVCORE_SGLANG_EVICTION_POLICY": "belady"}, InvalidArgumentError),  # simulator only
    ({"KVCORE_SGLANG_EVICTION_POLICY": "slru:nope=1"}, InvalidArgumentError),
    ({"KVCORE_SGLANG_QUEUE_HINTS": "128"}, UnsupportedFeatureError),
    ({"KVCORE_SGLANG_VERIFY_HITS": "2"}, InvalidArgumentError),
    ({"KVCORE_SGLANG_CHECK_INVARIANTS_EVERY": "x"}, InvalidArgumentError),
])
def test_bad_values_name_the_variable(env: dict[str, str], error: type[Exception]) -> None:
    with pytest.raises(error, match=next(iter(env))) as info:
        SGLangSettings.from_env(env)
    assert "\n" not in str(info.value)


def test_page_digest_is_a_sha256_chain() -> None:
    first = page_digest(None, [1, 2, 3])
    assert first == hashlib.sha256(struct.pack("<3I", 1, 2, 3)).digest()
    assert page_digest(first, [4]) == hashlib.sha256(first + struct.pack("<I", 4)).digest()
    wide = page_digest(None, [1, 2**40])
    assert wide == hashlib.sha256(b"\xff" + struct.pack("<2Q", 1, 2**40)).digest()
    with pytest.raises(InvalidArgumentError):
        page_digest(None, [-1])


def test_namespaces_seed_different_chains() -> None:
    seeds = {storage_seed(ns) for ns in [("a", None), (None, "a"), ("a", "b"), ("ab", None)]}
    assert len(seeds) == 4 and storage_seed((None, None)) is None
    assert event_seed(("lora", None)) is None  # the event chain is seeded by the salt only
    assert event_seed((None, "s")) == event_seed(("lora", "s")) is not None
