"""kvcore's adapter against vLLM's own KVCacheManager, call for call (no scheduler, no model):
the same block ids, hits, stats and byte-identical KV events, for requests with LoRA adapters,
multimodal items, cache salts, sessions and vLLM's "full" report mode; vLLM's calling
conventions (free of a request that never got blocks, lists that stay in order); and every
configuration the adapter refuses, by name."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    CrossAttentionSpec,
    HiSparseHotSpec,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowMLASpec,
)

from kvcore.errors import InvalidArgumentError, InvariantError, UnsupportedFeatureError
from kvcore.integrations.vllm.events import int_hash
from kvcore.integrations.vllm.manager import KVCacheManagerAdapter
from kvcore.integrations.vllm.settings import KvcoreSettings, parse_settings
from kvcore.integrations.vllm.version import installed, parse_version
from tests.integrations.vllm.helpers import (
    admit,
    event_bytes,
    full,
    kv_config,
    managers,
    request,
    scenario,
    swa,
)


def _make(**kwargs):  # type: ignore[no-untyped-def]
    return lambda rid, tokens: request(rid, tokens, **kwargs)


@pytest.mark.parametrize("kwargs", [
    {},
    {"lora_request": LoRARequest("adapter-a", 3, "/nowhere")},
    {"cache_salt": "tenant-1", "session_id": "chat-9"},
    {"mm_features": [MultiModalFeatureSpec(None, "image", "img-hash-1",
                                           PlaceholderRange(offset=5, length=20)),
                     MultiModalFeatureSpec(None, "image", "img-hash-2",
                                           PlaceholderRange(offset=30, length=4))]},
    {"sampling_params": SamplingParams(max_tokens=100, ignore_eos=True,
                                       extra_args={"kv_cache_report_mode": "full"})},
], ids=["plain", "lora", "salt+session", "multimodal", "report-full"])
@pytest.mark.parametrize("int_hashes", ["1", "0"])
def test_adapter_matches_vllm_call_for_call(kwargs: dict, int_hashes: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", int_hashes)
    theirs, ours = managers(kv_config(num_blocks=12))
    expected = scenario(theirs, _make(**kwargs))
    got = scenario(ours, _make(**kwargs))
    assert got == expected
    assert any(isinstance(x, bytes) and len(x) > 20 for x in got)  # events were compared
    ours.check_invariants()


def test_hybrid_sliding_window_matches_vllm() -> None:
    theirs, ours = managers(kv_config(full(), swa(32), num_blocks=24))
    assert scenario(ours, _make()) == scenario(theirs, _make())


def test_int_hash_is_vllms_conversion(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")
    for h in (b"\x00" * 32, bytes(range(32)), b"\xff" * 16, b"\x01\x02"):
        assert int_hash(h) == maybe_convert_block_hash(h)
    # Every length around the 8 bytes it keeps, with the top bit of each byte set.
    for n in range(41):
        h = bytes((0x80 | i * 37) & 0xFF for i in range(n))
        assert int_hash(h) == maybe_convert_block_hash(h), n


def test_free_of_a_request_without_blocks_does_nothing_and_lists_stay_in_order() -> None:
    theirs, ours = managers(kv_config())
    for m in (theirs, ours):
        m.free(request("never-admitted", range(20)))  # vLLM frees aborted waiting requests
    a = request("a", range(50))
    admit(ours, a)
    held = ours.get_blocks("a").blocks[0]
    ids = [b.block_id for b in held]
    ours.free(a)
    assert [b.block_id for b in held] == ids
    ours.check_invariants()


def test_computed_token_views_match_vllm() -> None:
    theirs, ours = managers(kv_config(num_blocks=32))
    for m in (theirs, ours):
        r = request("r", range(70))
        admit(m, r)
        m.free(r)
    got = []
    for m in (theirs, ours):
        r = request("s", [*range(64), 1, 2, 3])
        blocks, hit, _ = m.get_computed_blocks(r)
        got.append((hit, m.truncate_computed_blocks(blocks, 32).get_block_ids()))
        m.allocate_slots(r, r.num_tokens - hit, hit, blocks)
        r.num_computed_tokens = r.num_tokens
        got.append((m.get_block_ids_for_computed_tokens("s", 40), m.estimate_cached_tokens(r),
                    m.get_computed_blocks_for_connector(request("t", range(40)))[1:]))
    assert got[:2] == got[2:]


def test_verify_hits_refuses_a_hash_collision_vllm_would_serve() -> None:
    """Two prompts made to share their (vLLM-computed) block hashes: vLLM and kvcore without
    verification serve the second one the first one's KV; with ``verify_hits`` kvcore does not."""
    served = []
    for settings in (None, KvcoreSettings(verify_hits=True)):
        _, m = managers(kv_config(), settings=settings)
        a = request("a", range(48))
        admit(m, a)
        m.free(a)
        b = request("b", range(1000, 1048))
        b.block_hashes[:] = a.block_hashes  # a collision on every block
        served.append(m.get_computed_blocks(b)[1])
        m.check_invariants()
    assert served == [32, 0]


def test_invariants_are_checked_every_n_steps() -> None:
    _, m = managers(kv_config(), settings=KvcoreSettings(check_invariants_every=2))
    a = request("a", range(40))
    admit(m, a)
    m.new_step_starts()  # step 1: not checked
    m.get_blocks("a").blocks[0][0].ref_cnt += 1  # a leak the invariants see
    with pytest.raises(InvariantError, match="ref-count"):
        m.new_step_starts()  # step 2: checked


def test_every_vllm_manager_method_the_scheduler_calls_exists() -> None:
    """The names vLLM 0.32's Scheduler, AsyncScheduler and engine core read on
    ``kv_cache_manager`` (found with grep over vLLM's source) all exist on the adapter."""
    _, m = managers(kv_config())
    for name in ("get_computed_blocks", "get_computed_blocks_for_connector", "allocate_slots",
                 "new_step_starts", "get_blocks", "get_block_ids",
                 "get_block_ids_for_computed_tokens", "free", "pop_blocks_for_free",
                 "cache_blocks", "record_prefix_cache_stats", "make_prefix_cache_stats",
                 "estimate_cached_tokens", "take_events", "take_new_block_ids",
                 "take_kv_cache_block_copies", "take_boundary_state_offloads",
                 "remove_skipped_blocks", "truncate_computed_blocks", "evict_blocks",
                 "reset_prefix_cache", "usage", "empty_kv_cache_blocks", "coordinator",
                 "block_pool", "kv_cache_config", "max_model_len", "record_blocks_for_zeroing",
                 "finalize_partial_tail_offloads", "mamba_shared_prefix_checkpoint"):
        assert hasattr(m, name), name
    c = m.coordinator
    assert c.enable_partial_hash_hits is False and c.num_reprefillable_tokens == 0
    assert [g.block_size for g in c.single_type_managers] == [16]
    assert c.get_num_blocks_to_allocate("x", 40, m.empty_kv_cache_blocks.blocks, 0, 0, 0, 40,
                                        apply_admission_cap=True) == 3


def _mamba(mode: str = "align", **kw: int) -> MambaSpec:
    return MambaSpec(block_size=16, shapes=((2, 4),), dtypes=(torch.float32,),
                     mamba_cache_mode=mode, **kw)


@pytest.mark.parametrize(("config", "kwargs", "names"), [
    (lambda: kv_config(full(), CrossAttentionSpec(block_size=16, num_kv_heads=1, head_size=32,
                                                  dtype=torch.float16)), {},
     "prefix caching with cross attention"),
    (lambda: kv_config(), {"dcp_world_size": 2}, "context parallelism"),
    (lambda: kv_config(), {"num_prefill_lookahead": 3}, "multi-module MTP"),
], ids=["cross-attention", "dcp", "mtp"])
def test_refused_configurations_name_the_feature(config, kwargs, names) -> None:  # type: ignore[no-untyped-def]
    args = dict(kv_cache_config=config(), max_model_len=4096, scheduler_block_size=16,
                hash_block_size=16, enable_caching=True)
    if "hash_block_size" in kwargs:
        args["scheduler_block_size"] = 32
    args.update(kwargs)
    with pytest.raises(UnsupportedFeatureError, match=names) as info:
        KVCacheManagerAdapter(**args, settings=KvcoreSettings())
    assert "kvcore does not implement" in str(info.value)


@pytest.mark.parametrize("use_eagle", [True, False])
@pytest.mark.parametrize("flagged", [(0,), (1,), (0, 2)])
def test_eagle_drops_in_the_groups_vllm_drops_in(flagged: tuple[int, ...],
                                                 use_eagle: bool) -> None:
    """Groups flagged ``is_eagle_group``: the groups whose hits drop (each group view's
    ``use_eagle``, the coordinator's sets) are vLLM's, on the installed version (0.32 drops in
    flagged groups whatever ``use_eagle`` says, 0.33 only with it), and so is the hit."""
    specs = [full(), swa(32), swa(64)]
    config = kv_config(num_blocks=64).__class__(
        num_blocks=64, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"l{i}"], s, is_eagle_group=i in flagged)
                         for i, s in enumerate(specs)])
    theirs, ours = managers(config, use_eagle=use_eagle)
    assert ([m.use_eagle for m in ours.coordinator.single_type_managers]
            == [m.use_eagle for m in theirs.coordinator.single_type_managers])
    assert ours.coordinator.eagle_group_ids == theirs.coordinator.eagle_group_ids
    assert ours.coordinator.drop_eagle_group_ids == getattr(
        theirs.coordinator, "drop_eagle_group_ids", theirs.coordinator.eagle_group_ids)
    for m in (theirs, ours):
        admit(m, request("a", range(150)))
    hits = [admit(m, request("b", [*range(150), 7]))[0] for m in (theirs, ours)]
    assert hits[0] == hits[1] and hits[0] > 0


def test_partial_hash_hits_run_as_kvcores_partial_block_hits() -> None:
    """Where vLLM turns partial hash hits on (a Mamba "align" group whose blocks are larger than
    the hash unit), kvcore runs with partial_block_hits and the coordinator view says so."""
    for extra in ({}, {"num_prefill_checkpoint_blocks": 1, "prefill_checkpoint_alignment": 1},
                  {"num_speculative_blocks": 2}):
        config = kv_config(full(32), MambaSpec(block_size=32, shapes=((2, 4),),
                                               dtypes=(torch.float32,), mamba_cache_mode="align",
                                               **extra))
        m = KVCacheManagerAdapter(config, 4096, scheduler_block_size=32, hash_block_size=16,
                                  enable_caching=True, settings=KvcoreSettings())
        assert m.kv.config.partial_block_hits and m.kv.hash_block_size == 16
        assert m.coordinator.enable_partial_hash_hits is True
    # Blocks of one hash unit everywhere: no partial hits, in vLLM as in kvcore.
    config = kv_config(full(32), MambaSpec(block_size=32, shapes=((2, 4),),
                                           dtypes=(torch.float32,), mamba_cache_mode="align"))
    m = KVCacheManagerAdapter(config, 4096, scheduler_block_size=32, hash_block_size=32,
                              enable_caching=True, settings=KvcoreSettings())
    assert not m.kv.config.partial_block_hits
    assert m.coordinator.enable_partial_hash_hits is False


@pytest.mark.parametrize(("use_eagle", "unit", "effective"),
                         [(True, 16, True), (False, 16, False), (True, 32, False)])
def test_shared_prefix_checkpoints_take_effect_where_vllms_do(use_eagle: bool, unit: int,
                                                              effective: bool) -> None:
    """``enable_mamba_shared_prefix_checkpoint``: in effect on an EAGLE model with partial hash
    hits (the manager's ``mamba_shared_prefix_checkpoint``, which vLLM's scheduler reads to
    stop prompt chunks at the junction), accepted and without effect otherwise, as in vLLM."""
    config = kv_config(full(32), MambaSpec(block_size=32, shapes=((2, 4),),
                                           dtypes=(torch.float32,), mamba_cache_mode="align"))
    m = KVCacheManagerAdapter(config, 4096, scheduler_block_size=32, hash_block_size=unit,
                              enable_caching=True, use_eagle=use_eagle,
                              enable_mamba_shared_prefix_checkpoint=True,
                              settings=KvcoreSettings())
    assert m.mamba_shared_prefix_checkpoint is effective
    assert m.kv.coordinator.managers[1].shared_prefix_checkpoint is effective


def test_a_prefix_match_unit_without_partial_hits_hashes_where_vllm_does() -> None:
    """vLLM's prefix_match_unit on a model without Mamba "align" groups: hashes every unit,
    hits on block boundaries (vLLM enables partial-block hits only with such a group); kvcore
    hashes at the same unit, so it reads vLLM's hashes as vLLM does."""
    m = KVCacheManagerAdapter(kv_config(full(32), swa(32, block_size=32)), max_model_len=4096,
                              scheduler_block_size=32, hash_block_size=16, enable_caching=True,
                              settings=KvcoreSettings())
    assert m.kv.hash_block_size == 16 and m.kv.config.prefix_match_unit == 16
    assert m.block_pool.hash_block_size == 16


@pytest.mark.parametrize("mode", ["align", "none"])
def test_speculative_mamba_blocks_and_eagle_are_managed(mode: str) -> None:
    """MTP/EAGLE on a hybrid model: the speculative state blocks reach kvcore's spec, and the
    block counts of a first allocation (the scheduler's reservation of in-flight prefills
    reads them) are vLLM's own manager's, for every prompt length around the block edges
    ("align" under EAGLE: one state block plus the speculative ones; "none": the tokens'
    blocks plus them)."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager

    from kvcore import specs

    args: dict[str, Any] = dict(
        kv_cache_config=kv_config(full(), _mamba(mode, num_speculative_blocks=2)),
        max_model_len=4096, scheduler_block_size=16, hash_block_size=16,
        enable_caching=mode == "align", use_eagle=mode == "align")
    ours = KVCacheManagerAdapter(**args, settings=KvcoreSettings())
    theirs = VllmKVCacheManager(**args)
    spec = ours.kv.config.groups[1].spec
    assert isinstance(spec, specs.MambaSpec) and spec.num_speculative_blocks == 2
    empty = ours.empty_kv_cache_blocks.blocks
    counts = []
    for main in (1, 15, 16, 17, 40, 64):
        for lookahead in (0, 3):
            got = [m.coordinator.get_num_blocks_to_allocate(
                "x", main + lookahead, empty, 0, 0, 0, main, apply_admission_cap=True,
                prefill_end=main) for m in (ours, theirs)]
            assert got[0] == got[1], (main, lookahead, got)
            counts.append(got[0])
    full_blocks = -(-64 // 16)
    assert counts[-2] == full_blocks + (1 + 2 if mode == "align" else full_blocks + 2)


def test_scratch_groups_are_mapped_and_unknown_ones_refused() -> None:
    """vLLM's bounded-replay window and circular buffer become kvcore's scratch specs (the
    hash block is the cacheable groups' gcd, the hit alignment the lcm of all); a scratch group
    of a type kvcore lacks is still refused, naming it."""
    from kvcore import specs

    window = SlidingWindowMLASpec(block_size=16, num_kv_heads=1, head_size=64,
                                  dtype=torch.bfloat16, sliding_window=32, bounded_replay=True)
    ring = CircularBufferSpec(block_size=8, num_kv_heads=1, head_size=32, dtype=torch.float16)
    _, m = managers(kv_config(full(), window, ring))
    groups = m.kv.config.groups
    assert groups[1].spec == specs.SlidingWindowSpec(
        block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16, sliding_window=32,
        bounded_replay=True)
    assert isinstance(groups[2].spec, specs.CircularBufferSpec)
    assert m.kv.config.prefix_replay_tokens == 32
    assert (m.kv.config.hash_block_size, m.kv.config.alignment_tokens) == (16, 16)
    hot = HiSparseHotSpec(block_size=16, page_size=64, blocks_per_request=2)
    with pytest.raises(UnsupportedFeatureError, match="HiSparseHotSpec"):
        KVCacheManagerAdapter(kv_config(full(), hot), max_model_len=4096,
                              scheduler_block_size=16, hash_block_size=16,
                              settings=KvcoreSettings())


def test_supported_attention_types_are_accepted() -> None:
    chunked = ChunkedLocalAttentionSpec(block_size=16, num_kv_heads=1, head_size=32,
                                        dtype=torch.float16, attention_chunk_size=64)
    for config in (kv_config(), kv_config(full(), swa(32)), kv_config(chunked),
                   kv_config(full(), swa(32), prefix_cache_retention_interval=0),
                   kv_config(full(), swa(32), prefix_cache_retention_interval=64),
                   kv_config(full(), _mamba(), prefix_cache_retention_interval=0),
                   kv_config(full(), _mamba(num_prefill_checkpoint_blocks=1,
                                            prefill_checkpoint_alignment=1)),
                   kv_config(full(dtype=torch.float16), full(dtype=torch.bfloat16)),
                   # Mamba "none" with prefix caching: vLLM 0.32 runs it, 0.33 asserts "align".
                   *([] if installed().lookahead_hashes else [kv_config(_mamba("none"))])):
        _, m = managers(config)
        assert m.kv.config.num_groups == len(config.kv_cache_groups)
        assert (m.kv.config.prefix_cache_retention_interval
                == config.prefix_cache_retention_interval)


@pytest.mark.parametrize("retention", [0, None, 32])
def test_hybrid_sliding_window_under_retention_matches_vllm(retention: int | None) -> None:
    theirs, ours = managers(kv_config(full(), swa(32), num_blocks=24,
                                      prefix_cache_retention_interval=retention))
    assert scenario(ours, _make()) == scenario(theirs, _make())


def test_the_shared_prefix_boundary_reaches_the_admission_past_other_lookups() -> None:
    """Full attention + a window under sparse retention: ``b``'s lookup finds full attention
    holding 96 tokens the window group does not (no hit, boundary 96), and vLLM's scheduler
    keeps that boundary on the request.  Another request's lookup before ``b``'s admission
    changes nothing: ``b`` keeps its window tail below the boundary cached, so ``d``, sharing
    the same prefix, hits it there, as with vLLM's own manager."""
    def run(m: Any) -> tuple[int, int, int, bytes]:
        a = request("a", range(160))
        admit(m, a)
        m.free(a)
        b = request("b", [*range(96), *[9999] * 64])
        blocks, n, boundary = m.get_computed_blocks(b)
        b.shared_prefix_boundary = boundary  # as vLLM's scheduler does with every lookup
        m.get_computed_blocks(request("c", [*range(48), *[7] * 40]))  # e.g. an estimate
        assert m.allocate_slots(b, b.num_tokens - n, n, blocks) is not None
        b.num_computed_tokens = b.num_tokens
        m.free(b)
        _, hit, _ = m.get_computed_blocks(request("d", [*range(96), *[5] * 64]))
        return n, boundary, hit, event_bytes(m)

    theirs, ours = managers(kv_config(full(), swa(32), num_blocks=64,
                                      prefix_cache_retention_interval=0))
    got = run(ours)
    assert got == run(theirs)
    assert got[:3] == (0, 96, 96)


@pytest.mark.parametrize(("raw", "match"), [
    ({"eviction_policy": "mru"}, "unknown eviction policy"),
    ({"queue_hints": -1}, "queue_hints"),
    ({"verify_hits": "yes"}, "verify_hits"),
    ({"check_invariants_every": 1.5}, "check_invariants_every"),
    ({"evictoin_policy": "lru"}, "unknown additional_config"),
    ("lru", "mapping"),
])
def test_bad_settings_are_refused(raw: object, match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        parse_settings(raw)


def test_an_eviction_option_the_policy_lacks_fails_at_construction() -> None:
    with pytest.raises(InvalidArgumentError, match="takes no option"):
        managers(kv_config(), settings=parse_settings({"eviction_policy": "slru:bogus=1"}))


def test_events_bytes_cover_stores_and_evictions() -> None:
    theirs, ours = managers(kv_config(num_blocks=6))
    for m in (theirs, ours):
        for i in range(4):  # 5 usable blocks: later requests evict earlier prefixes
            r = request(f"r{i}", range(i * 100, i * 100 + 40))
            admit(m, r)
            m.free(r)
    assert event_bytes(ours) == event_bytes(theirs)


def test_the_request_view_follows_vllms_in_place_changes() -> None:
    """A streaming-input session truncates and extends vLLM's token and hash lists in place and
    adds multimodal items: the view sees each change."""
    from kvcore.integrations.vllm.request import VllmRequestView

    r = request("s", range(40), mm_features=[MultiModalFeatureSpec(
        None, "image", "a", PlaceholderRange(offset=2, length=4))])
    view = VllmRequestView(r)
    assert (view.num_tokens, len(view.block_hashes), len(view.mm_items)) == (40, 2, 1)
    del r._all_token_ids[20:]
    del r.block_hashes[1:]
    r._all_token_ids.extend(range(100, 130))
    r.mm_features.append(MultiModalFeatureSpec(None, "image", "b",
                                               PlaceholderRange(offset=30, length=4)))
    r.update_block_hashes()
    r.num_computed_tokens = 16
    assert view.num_tokens == 50 and view.all_token_ids[20] == 100
    assert view.block_hashes == r.block_hashes and len(view.block_hashes) == 3
    assert [m.identifier for m in view.mm_items] == ["a", "b"]
    assert view.num_computed_tokens == 16


def test_the_expected_build_runs() -> None:
    """CI runs this suite against both builds (KVCORE_EXPECT_BUILD=compiled for the mypyc one,
    where the adapter and the request view are compiled too)."""
    import os
    from importlib.machinery import EXTENSION_SUFFIXES

    import kvcore
    from kvcore.integrations.vllm import manager, request

    expected = os.environ.get("KVCORE_EXPECT_BUILD")
    if expected is not None:
        assert kvcore.__compiled__ is (expected == "compiled")
    for module in (manager, request):
        assert (module.__file__ or "").endswith(tuple(EXTENSION_SUFFIXES)) is kvcore.__compiled__


@pytest.mark.parametrize("text", ["0.32.0", "0.32.0+cpu", "0.33.0", "0.33.2"])
def test_supported_versions_parse(text: str) -> None:
    v = parse_version(text)
    assert (v.major, v.minor) in ((0, 32), (0, 33))
    assert v.lookahead_hashes is (v.minor == 33)


@pytest.mark.parametrize("text", ["0.31.1", "0.34.0", "1.0.0", "dev", ""])
def test_other_versions_are_refused_naming_the_supported_ones(text: str) -> None:
    with pytest.raises(UnsupportedFeatureError, match=r"supports vLLM 0\.32, 0\.33"):
        parse_version(text)


def test_lookahead_hashes_are_refused_on_vllm_032() -> None:
    with pytest.raises(UnsupportedFeatureError, match="lookahead block hashes"):
        KVCacheManagerAdapter(kv_config(), 4096, 16, 16, num_hash_lookahead_tokens=1,
                              vllm_version=parse_version("0.32.0"))


@pytest.mark.skipif(not installed().lookahead_hashes,
                    reason="vLLM 0.32 has no lookahead hashes (refused: test above)")
@pytest.mark.parametrize(("lookahead", "manager_lookahead"), [(1, 1), (3, 3), (1, 0), (0, 2)])
def test_lookahead_hashes_match_vllm_033_call_for_call(lookahead: int,
                                                       manager_lookahead: int) -> None:
    """A 32-token prompt with lookahead 1 has one hash (the second block waits for token 32):
    the same blocks cached, hit and published (with their lookahead tokens) as vLLM's.  Also
    when the engine hashed the requests with another lookahead than the manager's (vLLM's own
    tests do): both cache exactly the blocks the request has hashes for."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    fn = get_hash_fn_by_name("sha256")
    init_none_hash(fn)
    block_hasher = get_request_block_hasher(16, fn, lookahead)

    def make(rid: str, tokens: list[int]) -> Request:
        return Request(rid, list(tokens), SamplingParams(max_tokens=1000, ignore_eos=True),
                       None, block_hasher=block_hasher, cache_salt="t",
                       mm_features=[MultiModalFeatureSpec(None, "image", "img",
                                                          PlaceholderRange(offset=30, length=6))])

    theirs, ours = managers(kv_config(num_blocks=12),
                            num_hash_lookahead_tokens=manager_lookahead)
    assert scenario(ours, make) == scenario(theirs, make)
    r = make("x", list(range(32)))
    assert len(r.block_hashes) == (1 if lookahead else 2)


def test_the_views_answer_vllms_names_like_vllms_own_objects() -> None:
    """After the same calls, the names vLLM's tests and connectors read on the pool, the
    coordinator and its single-type managers give what vLLM's own objects give."""
    from types import MappingProxyType

    theirs, ours = managers(kv_config(full(), swa(32), num_blocks=24))
    got = []
    for m in (theirs, ours):
        a = request("a", range(70))
        admit(m, a)
        b = request("b", range(40))
        admit(m, b)
        m.free(b)
        pool, coord = m.block_pool, m.coordinator
        groups = coord.single_type_managers
        cached = pool.get_cached_block(b.block_hashes[1], [0, 1])
        got.append((
            pool.get_num_free_blocks(), pool.free_block_queue.num_free_blocks,
            pool.num_gpu_blocks, pool.hash_block_size, pool.null_block.block_id,
            [blk.block_id for blk in pool.free_block_queue.get_all_free_blocks()],
            None if cached is None else [blk.block_id for blk in cached],
            pool.get_cached_block(b"\x00" * 32, [0]),
            [(g.kv_cache_group_id, g.block_size, type(g.kv_cache_spec).__name__)
             for g in groups],
            [[blk.block_id for blk in g.req_to_blocks["a"]] for g in groups],
            ["b" in g.req_to_blocks for g in groups],
            [g._null_block is pool.null_block for g in groups],
            [pool.blocks[blk.block_id] == blk for blk in groups[0].req_to_blocks["a"]],
            [blk.ref_cnt for blk in groups[0].req_to_blocks["a"]],
            coord.kv_cache_config.num_blocks, sorted(coord.eagle_group_ids),
            [blk._block_hash for blk in groups[0].req_to_blocks["a"]],
            sorted((key, blk.block_id)
                   for key, value in pool.cached_block_hash_to_block._cache.items()
                   for blk in (value.values() if isinstance(value, dict) else [value]))))
    assert got[0] == got[1]
    assert got[1][-1]  # blocks are cached
    assert isinstance(ours.coordinator.single_type_managers[0].req_to_blocks, MappingProxyType)
    with pytest.raises(TypeError):
        ours.coordinator.single_type_managers[0].req_to_blocks["c"] = []  # type: ignore[index]
    assert len(ours.block_pool.cached_block_hash_to_block) > 0


def test_block_counts_with_a_partial_local_hit_and_external_tokens_are_vllms() -> None:
    """A local hit ending inside a block (partial hash hits) followed by external tokens up to a
    block boundary: vLLM counts each group's copy of the shared tail by the local hit, and the
    coordinator view does too (found in review: it counted by local + external, 3 blocks
    against vLLM's 5 here)."""
    config = kv_config(full(32), MambaSpec(block_size=32, shapes=((2, 4),),
                                           dtypes=(torch.float32,), mamba_cache_mode="align"))
    counts = []
    for m in managers(config, block_size=32, hash_block_size=16):
        a = request("a", range(150), block_size=16)
        blocks, hit, _ = m.get_computed_blocks(a)
        assert m.allocate_slots(a, 144, hit, blocks) is not None  # a chunk ends at unit 144
        a.num_computed_tokens = 144
        m.new_step_starts()
        b = request("b", [*range(144), *range(1000, 1100)], block_size=16)
        blocks, hit, _ = m.get_computed_blocks(b)
        assert hit == 144  # inside the fifth block of 32
        counts.append(m.coordinator.get_num_blocks_to_allocate(
            "b", hit + 16 + 40, blocks.blocks, 0, hit + 16, hit, hit + 16 + 40))
    assert counts[0] == counts[1]
