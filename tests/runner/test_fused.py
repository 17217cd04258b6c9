"""The fused kernels of ``runner.kernels.fused`` against the torch code of ``runner.layers`` and
``runner.models.decoder`` they replace: add + RMSNorm (Llama and Gemma weights), the gated MLP
activations, rotary embeddings (partial rotary dims, strided q/k views, in place), then whole
models with the kernels against the torch path.

Without a GPU the kernels run under TRITON_INTERPRET=1 on CPU tensors, in fp32 and fp16 only (the
interpreter computes bf16 wrongly); with CUDA they are compiled and bf16 is added, and the GPU
tests compare bf16 models and model-sized shapes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from runner.attention import AttentionMetadata, GroupMetadata, TorchAttentionBackend
from runner.kernels import fused, fused_kernels, use_fused
from runner.layers.norm import GemmaRMSNorm, RMSNorm
from runner.layers.rotary import RotaryEmbedding
from runner.models import build_model
from runner.models.decoder import ACTIVATIONS, gated_activation
from tests.runner.test_gemma import gemma_config
from tests.runner.test_models import hf_config

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16] if CUDA else [torch.float32,
                                                                      torch.float16]
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0,
          scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device=DEVICE, dtype=dtype)


# (rtol, atol): fp32 torch's defaults; fp16 / bf16 about two units in the last place: a value
# rounded to the dtype on the way (as torch rounds it) may land one unit apart when the fp32
# inputs differ in their last bits, and the weight or ``up`` factor then scales that unit.
TOL = {torch.float32: (1.3e-6, 1e-5), torch.float16: (2e-3, 1e-5),
       torch.bfloat16: (1.6e-2, 1e-5)}


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    rtol, atol = TOL[want.dtype]
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


def assert_mostly_identical(got: torch.Tensor, want: torch.Tensor) -> None:
    """In fp16 / bf16 the kernels round where torch rounds, so most outputs are bit-identical
    (a missed rounding step leaves ~75%); fp32 results differ in the last bits anyway."""
    if want.dtype != torch.float32:
        same = (got == want).float().mean().item()
        assert same >= 0.9, f"only {same:.1%} of the outputs equal torch's"


def torch_path(fn: Callable[[], Any]) -> Any:
    with fused_kernels(False):
        return fn()


# -- dispatch ---------------------------------------------------------------------------------

def test_dispatch_follows_the_device_unless_overridden() -> None:
    cpu = torch.zeros(2)
    assert not use_fused(cpu)  # the CPU path stays plain torch
    with fused_kernels(True):
        assert use_fused(cpu)
        with fused_kernels(False):
            assert not use_fused(cpu)
        assert use_fused(cpu)
    assert not use_fused(cpu)
    if CUDA:
        assert use_fused(cpu.cuda())


def test_every_decoder_activation_has_a_kernel() -> None:
    assert set(ACTIVATIONS) == set(fused.ACTIVATIONS)


# -- RMSNorm ----------------------------------------------------------------------------------

def make_norm(cls: type[RMSNorm], hidden: int, dtype: torch.dtype, seed: int) -> RMSNorm:
    norm = cls(hidden, eps=1e-5)
    with torch.no_grad():
        norm.weight.add_(randn(hidden, seed=seed, scale=0.5).cpu())
    return norm.to(device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [48, 80, 200])
@pytest.mark.parametrize("cls", [RMSNorm, GemmaRMSNorm])
def test_rms_norm_and_add_rms_norm(cls: type[RMSNorm], hidden: int, dtype: torch.dtype) -> None:
    norm = make_norm(cls, hidden, dtype, seed=hidden)
    # rows of different scales (the norm must be per row), one all-zero row
    x = randn(5, hidden, dtype=dtype, seed=1) * torch.tensor(
        [1.0, 4.0, 0.25, 0.0, 2.0], device=DEVICE, dtype=dtype)[:, None]
    residual = randn(5, hidden, dtype=dtype, seed=2)
    x0, r0 = x.clone(), residual.clone()
    with fused_kernels(True):
        got = norm(x)
        got_normed, got_sum = norm(x, residual)
    want = torch_path(lambda: norm(x))
    want_normed, want_sum = torch_path(lambda: norm(x, residual))
    assert_close(got, want)
    assert torch.equal(got_sum, want_sum)  # x + residual rounded like torch's add
    assert_close(got_normed, want_normed)
    assert_mostly_identical(got_normed, want_normed)
    assert torch.equal(x, x0) and torch.equal(residual, r0)  # inputs untouched
    # the reference itself: what the layer computed before the residual stream was deferred
    assert torch.equal(want_normed, norm.torch_norm(x + residual))


@pytest.mark.parametrize("cls", [RMSNorm, GemmaRMSNorm])
def test_rms_norm_on_strided_head_views(cls: type[RMSNorm]) -> None:
    """q/k norms run over [T, H, D] views of the QKV projection's output (rows not evenly
    spaced), D = 80 not a power of two."""
    tokens, heads, head_dim = 3, 3, 80
    qkv = randn(tokens, (heads + 2) * head_dim, dtype=torch.float16, seed=3)
    q = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
    assert not q.is_contiguous()
    norm = make_norm(cls, head_dim, torch.float16, seed=4)
    want = torch_path(lambda: norm(q))
    with fused_kernels(True):
        got = norm(q)
    assert_close(got, want)


def test_llama_norm_output_dtype_follows_the_weight() -> None:
    """torch promotes ``weight (fp32) * normed (fp16)`` to fp32; Gemma casts back to fp16."""
    x = randn(4, 96, dtype=torch.float16, seed=5)
    for cls, out_dtype in ((RMSNorm, torch.float32), (GemmaRMSNorm, torch.float16)):
        norm = make_norm(cls, 96, torch.float32, seed=6)
        with fused_kernels(False):
            want = norm(x)
        got = fused.rms_norm(x, norm.weight, norm.eps, gemma=norm.gemma)
        assert want.dtype == got.dtype == out_dtype
        assert_close(got, want)


# -- gated activation -------------------------------------------------------------------------

# The interpreter's numpy warns where exp overflows to inf, which the kernels rely on.
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [48, 200, 1100])  # 1100: two column blocks of 1024
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh", "gelu"])
def test_act_and_mul(activation: str, inter: int, dtype: torch.dtype) -> None:
    tokens = 3
    wide = randn(tokens, 2 * inter + 16, dtype=dtype, seed=7, scale=3.0)
    gate_up = wide[:, :2 * inter]  # a strided row view, as a sliced projection would be
    # the tails: exp overflows to inf / underflows to 0 there and the kernels must stay finite
    gate_up[0, :8] = torch.tensor([-60.0, -20.0, -8.0, -1e-3, 0.0, 1e-3, 8.0, 60.0], device=DEVICE)
    with fused_kernels(True):
        got = gated_activation(gate_up, activation)
    want = torch_path(lambda: gated_activation(gate_up, activation))
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(want, ACTIVATIONS[activation](gate) * up)  # the decoder's old MLP code
    assert torch.isfinite(got).all()
    assert_close(got, want)
    assert_mostly_identical(got, want)


def test_act_and_mul_rejects_odd_widths_and_unknown_activations() -> None:
    with pytest.raises(ValueError, match="2 \\* I"):
        fused.act_and_mul(torch.zeros(2, 7), "silu")
    with pytest.raises(ValueError, match="no fused kernel"):
        fused.act_and_mul(torch.zeros(2, 8), "relu")


# -- rotary embedding -------------------------------------------------------------------------

ROPE_CASES = [
    # head_dim, partial_rotary_factor, q heads, kv heads, rope parameters
    (64, 1.0, 4, 2, {"rope_type": "default", "rope_theta": 10000.0}),
    (80, 0.5, 3, 1, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                     "rope_theta": 10000.0}),  # yarn: cos/sin scaled by its attention factor
    (96, 0.25, 2, 2, {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}),
    (256, 1.0, 12, 2, {"rope_type": "default", "rope_theta": 1e6}),  # two blocks of 8 heads
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ROPE_CASES, ids=lambda c: f"d{c[0]}-p{c[1]}-{c[2]}x{c[3]}")
def test_rotary_matches_torch(case: tuple[int, float, int, int, dict[str, Any]],
                              dtype: torch.dtype) -> None:
    head_dim, partial, hq, hk, params = case
    rope = RotaryEmbedding(head_dim, params, 64, 128, partial).to(DEVICE)
    tokens = 5
    qkv = randn(tokens, (hq + 2 * hk) * head_dim, dtype=dtype, seed=head_dim)
    q = qkv[:, :hq * head_dim].view(tokens, hq, head_dim)  # strided views, as in Attention
    k = qkv[:, hq * head_dim:(hq + hk) * head_dim].view(tokens, hk, head_dim)
    positions = torch.tensor([7, 0, 127, 64, 3], device=DEVICE)
    before = qkv.clone()
    with fused_kernels(True):  # first, so that no freed buffer holds the expected values
        got_q, got_k = rope(positions, q, k)
    want_q, want_k = torch_path(lambda: rope(positions, q, k))
    assert torch.equal(qkv, before)  # out of place
    assert_close(got_q, want_q)
    assert_close(got_k, want_k)
    assert_mostly_identical(got_q, want_q)
    assert not torch.equal(got_q, q)  # it did rotate

    # in place: same values, written into the views; the pass-through dims and v untouched
    in_q, in_k = fused.rotary_embedding(positions, q, k, rope.cos, rope.sin, rope.rotary_dim,
                                        inplace=True)
    assert in_q.data_ptr() == q.data_ptr() and in_k.data_ptr() == k.data_ptr()
    assert_close(q, want_q)
    assert_close(k, want_k)
    rot = rope.rotary_dim
    assert torch.equal(q[..., rot:], before[:, :hq * head_dim].view_as(q)[..., rot:])
    assert torch.equal(qkv[:, (hq + hk) * head_dim:], before[:, (hq + hk) * head_dim:])


def test_rotary_rejects_bad_arguments() -> None:
    q, k = torch.zeros(2, 2, 8), torch.zeros(2, 1, 8)
    table = torch.zeros(4, 8)
    pos = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="rotary_dim"):
        fused.rotary_embedding(pos, q, k, table[:, :6], table[:, :6], 5)
    with pytest.raises(ValueError, match="does not match"):
        fused.rotary_embedding(pos, q, torch.zeros(3, 1, 8), table, table, 8)
    with pytest.raises(ValueError, match="positions"):
        fused.rotary_embedding(pos[:1], q, k, table, table, 8)


# -- whole models -----------------------------------------------------------------------------

def model_config(kind: str) -> Any:
    if kind == "qwen3":  # q/k norms, SiLU, partial RoPE, hidden 48 and intermediate 80
        return hf_config("qwen3", hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                         partial_rotary_factor=0.5)
    if kind == "gemma3":  # sandwich norms, (1 + weight), GeGLU (tanh), local / global RoPE
        return gemma_config("gemma3", hidden_size=80, intermediate_size=96)
    raise ValueError(kind)


def build(kind: str, dtype: torch.dtype) -> Any:
    model = build_model(model_config(kind), dtype=dtype, device=DEVICE, seed=3)
    with torch.no_grad():  # norms start at the identity; make their weights matter
        g = torch.Generator().manual_seed(4)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_((0.5 * torch.randn(p.shape, generator=g)).to(p))
    return model


def prefill_logits(model: Any, prompts: list[list[int]]) -> torch.Tensor:
    """One packed prefill of ``prompts`` from an empty paged cache (4-token pages)."""
    bs = 4
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    tables: list[list[int]] = []
    next_block = 1  # block 0 is the null block
    for p in prompts:
        n_blocks = -(-len(p) // bs)
        table = list(range(next_block, next_block + n_blocks))
        next_block += n_blocks
        tables.append(table + [0] * (8 - n_blocks))
        ids += p
        pos += range(len(p))
        slots += [table[i // bs] * bs + i % bs for i in range(len(p))]
    lens = [len(p) for p in prompts]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(cu.to(DEVICE), torch.tensor(lens, dtype=torch.int32, device=DEVICE),
                             max(lens), max(lens),
                             [GroupMetadata(torch.tensor(slots, device=DEVICE),
                                            torch.tensor(tables, dtype=torch.int32,
                                                         device=DEVICE))],
                             lens, lens)
    dtype = next(model.parameters()).dtype
    caches = [torch.zeros(2, next_block, bs, model.num_kv_heads_per_rank, model.head_dim,
                          dtype=dtype, device=DEVICE) for _ in range(model.num_layers)]
    with torch.no_grad():
        hidden = model(torch.tensor(ids, device=DEVICE), torch.tensor(pos, device=DEVICE),
                       caches, meta, TorchAttentionBackend())
        return model.compute_logits(hidden).float()


PROMPTS = [[5, 17, 250, 3, 99, 42, 7], [11, 200, 64], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]


@pytest.mark.parametrize("kind", ["qwen3", "gemma3"])
def test_model_with_fused_kernels_equals_torch_path(kind: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32: on CPU through the Triton interpreter, on CUDA compiled.  Counts the kernel calls
    so that the comparison cannot pass by both sides running torch."""
    calls: dict[str, int] = {}

    def counted(name: str) -> None:
        inner = getattr(fused, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[name] = calls.get(name, 0) + 1
            return inner(*args, **kwargs)

        monkeypatch.setattr(fused, name, wrapper)

    for name in ("rms_norm", "add_rms_norm", "act_and_mul", "rotary_embedding"):
        counted(name)
    model = build(kind, torch.float32)
    want = torch_path(lambda: prefill_logits(model, PROMPTS))
    assert not calls
    with fused_kernels(True):
        got = prefill_logits(model, PROMPTS)
    n = model.num_layers
    sandwich = kind == "gemma3"
    # per layer: the input norm (add + norm after the first layer), the MLP input norm (add +
    # norm); q/k norms and Gemma's two output norms are plain; the final norm adds
    assert calls["add_rms_norm"] == 2 * n - 1 + 1
    assert calls["rms_norm"] == 1 + 2 * n + (2 * n if sandwich else 0)
    assert calls["act_and_mul"] == calls["rotary_embedding"] == n
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@needs_cuda
@pytest.mark.parametrize("kind", ["qwen3", "gemma3"])
def test_bf16_model_with_fused_kernels_is_as_accurate_as_torch(kind: str) -> None:
    """bf16 roundings differ by a unit here and there, so compare both bf16 paths against the
    fp32 model: the fused one must be about as close as the torch one."""
    ref = torch_path(lambda: prefill_logits(build(kind, torch.float32), PROMPTS))
    model = build(kind, torch.bfloat16)
    torch_err = (torch_path(lambda: prefill_logits(model, PROMPTS)) - ref).abs().max().item()
    with fused_kernels(None):  # the default on CUDA
        fused_err = (prefill_logits(model, PROMPTS) - ref).abs().max().item()
    assert fused_err <= 1.5 * torch_err + 1e-3, (fused_err, torch_err)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_model_sized_shapes_on_gpu(dtype: torch.dtype) -> None:
    """Llama-3-8B's shapes (hidden 4096, intermediate 14336, 32 x 128 query heads, 8 KV heads)
    for 300 tokens, and a Gemma-sized odd hidden size (2560 -> tile 4096)."""
    tokens = 300
    for hidden, cls in ((4096, RMSNorm), (2560, GemmaRMSNorm)):
        norm = make_norm(cls, hidden, dtype, seed=8)
        x = randn(tokens, hidden, dtype=dtype, seed=9)
        residual = randn(tokens, hidden, dtype=dtype, seed=10)
        with fused_kernels(False):
            want = norm(x, residual)
        got = fused.add_rms_norm(x, residual, norm.weight, norm.eps, gemma=norm.gemma)
        assert torch.equal(got[1], want[1])
        assert_close(got[0], want[0])
    gate_up = randn(tokens, 2 * 14336, dtype=dtype, seed=11)
    assert_close(fused.act_and_mul(gate_up, "silu"),
                 torch_path(lambda: gated_activation(gate_up, "silu")))
    rope = RotaryEmbedding(128, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                                 "rope_theta": 500000.0}, 131072, 4096).to(DEVICE)
    qkv = randn(tokens, 48 * 128, dtype=dtype, seed=12)
    q, k = qkv[:, :4096].view(tokens, 32, 128), qkv[:, 4096:5120].view(tokens, 8, 128)
    positions = torch.randint(0, 4096, (tokens,), device=DEVICE)
    want_q, want_k = torch_path(lambda: rope(positions, q, k))
    got_q, got_k = fused.rotary_embedding(positions, q, k, rope.cos, rope.sin, rope.rotary_dim)
    assert_close(got_q, want_q)
    assert_close(got_k, want_k)
