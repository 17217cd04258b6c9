"""Numerics of the reference paths: a float64 model computes in float64 (norms, RoPE, the torch
attention backend), so it can judge fp32 results; a Qwen2.5-shaped config (hidden 896, 7 query
heads of 128, one KV head, qkv bias) matches transformers in fp32 and is as close as
transformers to the float64 reference.

The fp32 comparisons run on one torch thread, whatever the process was left with: the
summation order of a matmul follows the thread count (which an engine built earlier in the
process may have picked from the machine's load), and with it the last bits of every logit."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch
import transformers

from runner.layers.norm import GemmaRMSNorm, RMSNorm
from runner.layers.rotary import RotaryEmbedding
from runner.models import build_model
from runner.models.weights import hf_state_items
from tests.runner.test_models import Paged, hf_model, reference


def test_float64_norms_and_rope_stay_in_float64() -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 64, dtype=torch.float64) * 3
    for norm in (RMSNorm(64), GemmaRMSNorm(64)):
        norm = norm.double()
        with torch.no_grad():
            norm.weight.normal_()
        scale = norm.weight + 1 if norm.gemma else norm.weight
        want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * scale
        assert norm(x).dtype == torch.float64
        assert (norm(x) - want).abs().max().item() < 1e-13, type(norm).__name__
    rope = RotaryEmbedding(32, {"rope_theta": 10000.0}, 64, 64).double()
    q, k = torch.randn(6, 4, 32, dtype=torch.float64), torch.randn(6, 2, 32, dtype=torch.float64)
    pos = torch.arange(6) * 7
    cos, sin = rope.cos[pos].unsqueeze(1), rope.sin[pos].unsqueeze(1)

    def rotate(t: torch.Tensor) -> torch.Tensor:
        return t * cos + torch.cat((-t[..., 16:], t[..., :16]), dim=-1) * sin

    got_q, got_k = rope(pos, q, k)
    assert (got_q - rotate(q)).abs().max().item() < 1e-13
    assert (got_k - rotate(k)).abs().max().item() < 1e-13


def _qwen25_shaped() -> object:
    cfg = transformers.Qwen2Config(hidden_size=896, intermediate_size=1024, num_hidden_layers=2,
                                   num_attention_heads=7, num_key_value_heads=1,
                                   vocab_size=1000, max_position_embeddings=256)
    cfg._attn_implementation = "eager"
    return cfg


@pytest.fixture
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


FP32_EPS = torch.finfo(torch.float32).eps


@pytest.mark.usefixtures("one_thread")
def test_qwen25_shaped_prefill_against_transformers_and_a_float64_reference() -> None:
    cfg = _qwen25_shaped()
    hf = hf_model(cfg)  # biases drawn too (transformers initialises them to 0)
    ours = build_model(cfg, dtype=torch.float32, weights=hf_state_items(hf), max_positions=256)
    ref = build_model(cfg, dtype=torch.float64, weights=hf_state_items(hf), max_positions=256)
    rng = random.Random(1)
    prompts = [[rng.randrange(1000) for _ in range(n)] for n in (5, 17, 33)]
    logits = Paged(ours).step(list(enumerate(prompts))).double()
    paged = Paged(ref)
    paged.caches = [c.double() for c in paged.caches]
    exact = paged.step(list(enumerate(prompts)))
    assert exact.dtype == torch.float64
    start = 0
    for p in prompts:
        mine = logits[start:start + len(p)]
        theirs = reference(hf, p).double()
        best = exact[start:start + len(p)]
        assert (mine - theirs).abs().max().item() <= 1e-5
        err_ours = (mine - best).abs().max().item()
        err_theirs = (theirs - best).abs().max().item()
        # As close as transformers, up to the fp32 noise floor: a few units in the last place of
        # the largest logit, which another summation order alone moves (another batch shape:
        # the paged step batches the prompts, transformers runs each alone).
        floor = 4 * FP32_EPS * best.abs().max().item()
        assert err_ours <= 1e-5 and err_ours <= 1.5 * err_theirs + floor, (
            err_ours, err_theirs, floor)
        assert torch.equal(mine.argmax(-1), best.argmax(-1))
        start += len(p)
