"""Gemma-3 (text) and Gemma-2 against transformers' own models with the same weights (fp32, CPU).

Model level: packed prefill, incremental decode through shuffled paged blocks and prefill after
a cached prefix give transformers' logits; Gemma-3's local/global RoPE (with linear scaling on
the global layers, as the 4B+ checkpoints have), Gemma-2's attention and final-logit
soft-capping; safetensors folders of ``Gemma3ForCausalLM``, ``Gemma2ForCausalLM`` and the
multimodal ``Gemma3ForConditionalGeneration`` (its language model) load by checkpoint name.

Engine level: greedy ``generate`` equals ``transformers.generate`` (Gemma-3 with prefix
caching on and off and under preemption, Gemma-2); kvcore's hybrid coordinator runs separate
sliding/full KV-cache groups (Gemma-3: 5 sliding-window layers per full-attention layer), and a
long request's sliding groups hold null blocks (blocks left behind the window were freed) while
the full group keeps every block; the Triton backend (interpreted on CPU) gives the same tokens.

Norm weights are randomised (transformers initialises Gemma norms to 0, i.e. a scale of 1) and
``initializer_range`` is raised so that scores are large enough for the soft-caps to matter.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import transformers

from kvcore.coordinator import HybridCoordinator
from kvcore.specs import FullAttentionSpec, SlidingWindowSpec
from runner.engine import LLM
from runner.models import build_model, load_config, load_model
from runner.models.decoder import layer_type_names, rope_parameters
from runner.models.weights import hf_state_items
from runner.sampler import SamplingParams
from tests.runner.test_models import (
    Paged,
    assert_packed_prefill_matches,
    assert_paged_decode_matches,
    reference,
)

TOL = 1e-4
WINDOW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
# head_dim 32 != hidden / heads (16), GQA 2, query_pre_attn_scalar != head_dim: each switch shows.
COMMON = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              head_dim=32, vocab_size=300, max_position_embeddings=256, sliding_window=WINDOW,
              query_pre_attn_scalar=24, initializer_range=0.1)


def gemma_config(kind: str, **kw: Any) -> Any:
    if kind == "gemma3":  # layer_types from the default pattern: 5 sliding, then 1 full
        cfg = transformers.Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 6,
                                               "rope_theta": 100_000.0,
                                               "rope_local_base_freq": 1_000.0, **kw})
    else:  # alternating sliding / full
        cfg = transformers.Gemma2Config(**{**COMMON, "num_hidden_layers": 4,
                                           "attn_logit_softcapping": 2.0,
                                           "final_logit_softcapping": 3.0, **kw})
    cfg._attn_implementation = "eager"
    return cfg


def randomise_norms(model: Any) -> Any:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(std=0.5)
    return model


def hf_gemma(cfg: Any) -> Any:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval().float()
    return randomise_norms(model)


def random_prompts(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(300) for _ in range(n)] for n in lengths]


# -- model level ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind,kw", [
    ("gemma3", {}),
    ("gemma3", {"rope_scaling": {"rope_type": "linear", "factor": 8.0}}),
    ("gemma2", {}),
], ids=["gemma3", "gemma3-linear-global-rope", "gemma2"])
def test_packed_prefill_matches_transformers(kind: str, kw: dict[str, Any]) -> None:
    cfg = gemma_config(kind, **kw)
    hf = hf_gemma(cfg)
    ours = build_model(cfg, weights=hf_state_items(hf))
    windows = ours.layer_sliding_windows
    assert None in windows and WINDOW in windows  # hybrid
    assert_packed_prefill_matches(ours, hf, kind)  # 17 and 33 tokens overrun the window


def test_gemma3_layer_types_and_rope_bases() -> None:
    cfg = gemma_config("gemma3", num_hidden_layers=12)
    model = build_model(cfg)
    assert model.layer_sliding_windows == ([WINDOW] * 5 + [None]) * 2
    layers = model.decoder_layers
    local, glob = layers[0].self_attn, layers[5].self_attn
    assert local.scale == glob.scale == 24 ** -0.5
    # position 1's angle of the first frequency pair is 1 rad for both; the slowest pair differs
    assert local.rotary.cos[1, 15] != glob.rotary.cos[1, 15]
    assert model.embed_scale is not None and model.embed_scale.item() == pytest.approx(8.0)


def test_legacy_gemma3_config_fields() -> None:
    """transformers 4.x Gemma-3 configs: no layer_types (``sliding_window_pattern``), flat RoPE
    fields with ``rope_local_base_freq`` for the sliding layers."""
    legacy = SimpleNamespace(model_type="gemma3_text", num_hidden_layers=7, sliding_window=8,
                             sliding_window_pattern=6, rope_theta=1e6, rope_local_base_freq=1e4,
                             rope_scaling={"rope_type": "linear", "factor": 8.0})
    names = layer_type_names(legacy)
    assert names == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
    assert rope_parameters(legacy, "sliding_attention") == {"rope_type": "default",
                                                            "rope_theta": 1e4}
    assert rope_parameters(legacy, "full_attention") == {"rope_type": "linear", "factor": 8.0,
                                                         "rope_theta": 1e6}


@pytest.mark.parametrize("kind", ["gemma3", "gemma2"])
def test_incremental_decode_through_paged_cache(kind: str) -> None:
    cfg = gemma_config(kind)
    hf = hf_gemma(cfg)
    # 7 steps: the 11-token sequence reaches 18 tokens, past the 8-token sliding window
    assert_paged_decode_matches(build_model(cfg, weights=hf_state_items(hf)), hf, steps=7)


def test_prefill_after_cached_prefix() -> None:
    cfg = gemma_config("gemma3")
    hf = hf_gemma(cfg)
    paged = Paged(build_model(cfg, weights=hf_state_items(hf)))
    tokens = random_prompts((29,), seed=4)[0]
    paged.step([(0, tokens[:12])])
    logits = paged.step([(0, tokens[12:])])
    assert (logits - reference(hf, tokens)[12:]).abs().max().item() <= TOL


def test_gemma2_soft_caps_are_applied() -> None:
    cfg = gemma_config("gemma2")
    hf = hf_gemma(cfg)
    tokens = random_prompts((20,), seed=6)[0]
    capped = Paged(build_model(cfg, weights=hf_state_items(hf))).step([(0, tokens)])
    assert capped.abs().max().item() <= 3.0  # final_logit_softcapping
    for field in ("attn_logit_softcapping", "final_logit_softcapping"):
        uncapped_cfg = gemma_config("gemma2", **{field: None})
        uncapped = Paged(build_model(uncapped_cfg, weights=hf_state_items(hf))).step(
            [(0, tokens)])
        assert (uncapped - capped).abs().max().item() > 1e-2, f"{field} made no difference"


@pytest.mark.parametrize("kind", ["gemma3", "gemma2", "gemma3-multimodal"])
def test_load_from_safetensors_folder(kind: str, tmp_path: Path) -> None:
    if kind == "gemma3-multimodal":
        text = gemma_config("gemma3").to_dict()
        cfg = transformers.Gemma3Config(
            text_config=text, mm_tokens_per_image=4, boi_token_index=297, eoi_token_index=298,
            image_token_index=299,
            vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                               num_attention_heads=2, image_size=28, patch_size=14))
        torch.manual_seed(0)
        hf = randomise_norms(transformers.Gemma3ForConditionalGeneration(cfg).eval().float())
        in_memory = build_model(cfg, weights=hf_state_items(hf))  # model.language_model.* names
        assert in_memory.config.model_type == "gemma3_text"
    else:
        hf = hf_gemma(gemma_config(kind))
    hf.save_pretrained(tmp_path, safe_serialization=True)
    assert load_config(tmp_path).model_type == ("gemma2" if kind == "gemma2" else "gemma3_text")
    ours = load_model(tmp_path)
    tokens = random_prompts((30,), seed=7)[0]
    assert (Paged(ours).step([(0, tokens)]) - reference(hf, tokens)).abs().max().item() <= TOL


def test_bidirectional_gemma3_is_refused() -> None:
    with pytest.raises(ValueError, match="bidirectional"):
        build_model(gemma_config("gemma3", use_bidirectional_attention=True))


# -- engine level ---------------------------------------------------------------------------------

def hf_greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             do_sample=False)
    return out[0, len(prompt):].tolist()


def engine_prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(300) for _ in range(rng.randint(3, 30))] for _ in range(n)]


def tokens(outputs: list[Any]) -> list[list[int]]:
    return [o.token_ids for o in outputs]


@dataclass
class Saved:
    """A tiny transformers model saved as safetensors, shared prompts (three with a common
    16-token prefix, for prefix-cache hits) and transformers' greedy tokens for them."""

    path: Path
    hf: Any
    prompts: list[list[int]]
    want: list[list[int]]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Saved]:
    cache: dict[str, Saved] = {}

    def get(kind: str) -> Saved:
        if kind not in cache:
            path = tmp_path_factory.mktemp(kind)
            hf = hf_gemma(gemma_config(kind))
            hf.generation_config.eos_token_id = None
            hf.generation_config.pad_token_id = 0
            hf.save_pretrained(path, safe_serialization=True)
            system = list(range(40, 56))
            ps = [system + p for p in engine_prompts(3, seed=0)] + engine_prompts(2, seed=1)
            cache[kind] = Saved(path, hf, ps, [hf_greedy(hf, p, GREEDY.max_tokens) for p in ps])
        return cache[kind]

    return get


GROUP_SPECS = {"gemma3": [SlidingWindowSpec] * 5 + [FullAttentionSpec],  # 1 layer per group
               "gemma2": [SlidingWindowSpec, FullAttentionSpec]}  # 2 layers per group


@pytest.mark.parametrize("kind,caching", [("gemma3", True), ("gemma3", False), ("gemma2", True)],
                         ids=["gemma3-prefix-caching", "gemma3-no-caching", "gemma2"])
def test_greedy_equals_transformers_generate(kind: str, caching: bool,
                                             saved: Callable[[str], Saved]) -> None:
    s = saved(kind)
    llm = LLM(s.path, block_size=4, num_blocks=256, max_num_batched_tokens=64,
              enable_prefix_caching=caching)
    assert [type(g.spec) for g in llm.kv_config.groups] == GROUP_SPECS[kind]
    assert isinstance(llm.manager.coordinator, HybridCoordinator) == caching
    first = llm.generate(s.prompts[:1], GREEDY, use_tqdm=False)  # caches the shared prefix
    rest = llm.generate(s.prompts[1:], GREEDY, use_tqdm=False)
    assert tokens(first + rest) == s.want
    if caching:
        assert all(o.num_cached_tokens >= 16 for o in rest[:2])
    llm.manager.check_invariants()
    assert llm.manager.num_free_blocks == 255


def test_preemption_keeps_transformers_outputs(saved: Callable[[str], Saved]) -> None:
    s = saved("gemma3")
    tight = LLM(s.path, block_size=4, num_blocks=72, max_num_batched_tokens=16)
    got = tight.generate(s.prompts, GREEDY, use_tqdm=False)
    assert tokens(got) == s.want
    assert tight.scheduler.stats.num_preemptions > 0
    tight.manager.check_invariants()


def test_sliding_window_blocks_are_freed_as_a_long_request_advances(
        saved: Callable[[str], Saved]) -> None:
    s = saved("gemma3")
    llm = LLM(s.path, block_size=4, num_blocks=128, max_num_batched_tokens=16)
    seen: list[tuple[tuple[list[int], ...], int]] = []
    forward = llm.runner.forward

    # kvcore's block table of the request, per group (the engine's own tables keep stale ids
    # left of a window, as vLLM's workers do: attention never reads there)
    def recording(inputs: Any) -> Any:
        tables = tuple(list(ids) for ids in llm.manager.get_block_ids("0"))
        seen.append((tables, llm.manager.num_free_blocks))
        return forward(inputs)

    llm.runner.forward = recording  # type: ignore[method-assign]
    prompt = random_prompts((50,), seed=8)[0]  # chunked prefill: 4 chunks, then decodes
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    assert out.request_id == "0" and out.token_ids == hf_greedy(s.hf, prompt, 14)
    (*sliding, full), num_free = seen[-1]  # last decode: 63 tokens in the cache
    assert len(full) == 16 and all(full)  # full attention keeps all 16 blocks of 4 tokens
    for table in sliding:
        # the window of 8 tokens spans at most 3 blocks; everything before it is the null block
        assert len(table) == 16 and len([b for b in table if b]) <= 3 and table[0] == 0
    assert 127 - num_free <= 16 + 5 * 3  # in use: the full group's + the windows (not 6 x 16)
    llm.manager.check_invariants()


@pytest.mark.parametrize("kind", ["gemma3", "gemma2"])
def test_triton_backend_equals_transformers(kind: str, saved: Callable[[str], Saved]) -> None:
    """Interpreted on CPU (slow): two prompts, a few tokens.  head_dim 32 and GQA 2 give
    power-of-two tiles; Gemma-2 soft-caps the kernels' scores."""
    s = saved(kind)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm = LLM(s.path, block_size=4, num_blocks=64, backend="triton")
    got = llm.generate(s.prompts[3:], params, use_tqdm=False)  # prefill, then decode steps
    assert tokens(got) == [w[:4] for w in s.want[3:]]
