"""Fused Triton kernels for the element-wise work around attention: residual add + RMSNorm, the
gated MLP activation and rotary embeddings.  Each replaces several torch kernels (and their
round trips through memory) by one pass, and reproduces the torch code of
:mod:`runner.layers` (the reference) step by step: the same fp32 computations and the same
roundings to the model dtype, so results differ only by the order of fp32 reductions, by
transcendental functions' last bits and by one GELU formula (below).

* :func:`rms_norm` / :func:`add_rms_norm`: one program per row (``[..., H]``, any ``H``: the
  row is one ``next_power_of_2(H)`` tile, masked).  ``add_rms_norm`` also writes
  ``residual_out = x + residual`` (rounded to the dtype, as torch's add) and normalises it.
  Two weight conventions: Llama's ``weight * normed.to(dtype)`` (the product in the promoted
  dtype of weight and input) and Gemma's ``normed * (1 + weight)`` in fp32, cast to the input
  dtype at the end.  Rows may be strided (q/k heads as views of the QKV projection).
* :func:`act_and_mul`: ``act(gate) * up`` over the gate-up projection's output ``[T, 2 * I]``
  (gate first) into ``[T, I]``; programs over (token, column block).  The activation is taken
  in fp32 and rounded to the dtype before the product, as torch computes ``act(gate) * up``.
  Activations: :data:`ACTIVATIONS`.  The tanh GELU is computed as ``g / (1 + exp(-2z))``,
  which equals torch's ``0.5 * g * (1 + tanh(z))`` without its cancellation for negative
  ``g`` (on 8800 random fp16 inputs it matched an fp64 reference everywhere, torch's fp32
  formula was a unit off on ~3.5%).
* :func:`rotary_embedding`: rotate-half RoPE of the first ``rotary_dim`` dims of every q and k
  head, cos/sin rows looked up by position; the other dims are copied (out of place) or left
  alone (in place).  Programs over (token, block of heads), q and k in the same program so
  cos/sin are loaded once.

Launches depend only on tensor shapes (no host synchronisation), so they can be captured in
CUDA graphs.  Warp counts are simple rules of thumb, not tuned on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
"""Activation names of :mod:`runner.models.decoder` (transformers' names) -> kernel variant."""

_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_SQRT_HALF = tl.constexpr(0.7071067811865476)


def _num_warps(block: int) -> int:
    return min(16, max(1, block // 512))


# -- RMSNorm ----------------------------------------------------------------------------------

@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
                     stride_x0, stride_x1, stride_r0, stride_r1, stride_o0, stride_o1,
                     stride_ro0, stride_ro1, n_cols, eps,
                     HAS_RESIDUAL: tl.constexpr, GEMMA: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + i * stride_x0 + j * stride_x1 + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + i * stride_r0 + j * stride_r1 + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + i * stride_ro0 + j * stride_ro1 + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    normed = xf * rstd
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if GEMMA:
        y = normed * (1.0 + w)
    else:  # the product is taken in the output (promoted) dtype: fp32 then one rounding
        y = w * normed.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + i * stride_o0 + j * stride_o1 + cols, y.to(out_ptr.dtype.element_ty),
             mask=mask)


def _as_3d(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[M, N, H]`` with a contiguous last dimension (a view when possible)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    if t.dim() == 1:
        return t.view(1, 1, -1)
    if t.dim() == 2:
        return t.unsqueeze(1)
    return t.reshape(-1, t.shape[-2], t.shape[-1])


def _rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
              gemma: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight of shape {tuple(weight.shape)} for rows of {hidden}")
    out_dtype = x.dtype if gemma else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    res_out = None
    x3, o3 = _as_3d(x), _as_3d(out)
    r3, ro3 = x3, o3  # unused without a residual
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match "
                             f"x {tuple(x.shape)} {x.dtype}")
        res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        r3, ro3 = _as_3d(residual), _as_3d(res_out)
    if x.numel() == 0:
        return out, res_out
    block = triton.next_power_of_2(hidden)
    weight = weight if weight.stride(0) == 1 else weight.contiguous()
    _rms_norm_kernel[(x3.shape[0], x3.shape[1])](
        x3, r3, weight, o3, ro3, x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1),
        o3.stride(0), o3.stride(1), ro3.stride(0), ro3.stride(1), hidden, eps,
        HAS_RESIDUAL=residual is not None, GEMMA=gemma, BLOCK=block, num_warps=_num_warps(block))
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
             gemma: bool = False) -> torch.Tensor:
    """RMSNorm over the last dimension of ``x`` (``[..., H]``); ``gemma``: ``(1 + weight)``."""
    return _rms_norm(x, None, weight, eps, gemma)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 gemma: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)`` in one pass; the inputs are not modified."""
    out, res_out = _rms_norm(x, residual, weight, eps, gemma)
    assert res_out is not None
    return out, res_out


# -- gated activation -------------------------------------------------------------------------

@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter,
                        ACT: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    row = x_ptr + t * stride_x
    g = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(row + inter + cols, mask=mask, other=0.0).to(tl.float32)
    if ACT == "silu":
        a = g / (1.0 + tl.exp(-g))
    elif ACT == "gelu_tanh":
        # 0.5 * g * (1 + tanh(z)) = g / (1 + exp(-2z)): no cancellation where tanh(z) ~ -1,
        # and right at both tails (exp -> 0 gives g, exp -> inf gives -0)
        z = _SQRT_2_OVER_PI * (g + 0.044715 * g * g * g)
        a = g / (1.0 + tl.exp(-2.0 * z))
    else:  # "gelu" (erf)
        a = g * 0.5 * (1.0 + tl.erf(g * _SQRT_HALF))
    a = a.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + t * stride_o + cols, (a * u).to(out_ptr.dtype.element_ty), mask=mask)


def act_and_mul(x: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(x[:, :I]) * x[:, I:]`` for ``x`` of shape ``[T, 2 * I]``; ``activation`` is a key
    of :data:`ACTIVATIONS`."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"no fused kernel for activation {activation!r}")
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"expected [T, 2 * I], got {tuple(x.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    tokens, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty(tokens, inter, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _act_and_mul_kernel[(tokens, triton.cdiv(inter, block))](
        x, out, x.stride(0), out.stride(0), inter, ACT=ACTIVATIONS[activation], BLOCK=block,
        num_warps=max(1, block // 256))
    return out


# -- rotary embedding -------------------------------------------------------------------------

@triton.jit
def _rotate_heads(src, dst, stride_src_h, stride_dst_h, heads, num_heads, offs, half_mask,
                  cos1, cos2, sin1, sin2, half, rot, head_dim,
                  COPY_PASS: tl.constexpr, BLOCK_PASS: tl.constexpr):
    """Rotate-half of the first ``rot`` dims of the rows ``heads`` (< num_heads) of one token:
    ``[x1, x2] -> [x1 * cos1 - x2 * sin1, x2 * cos2 + x1 * sin2]`` in fp32."""
    h_mask = heads < num_heads
    mask = h_mask[:, None] & half_mask[None, :]
    src_rows = src + heads[:, None] * stride_src_h
    dst_rows = dst + heads[:, None] * stride_dst_h
    x1 = tl.load(src_rows + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src_rows + half + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    y1 = x1 * cos1[None, :] - x2 * sin1[None, :]
    y2 = x2 * cos2[None, :] + x1 * sin2[None, :]
    tl.store(dst_rows + offs[None, :], y1.to(dst.dtype.element_ty), mask=mask)
    tl.store(dst_rows + half + offs[None, :], y2.to(dst.dtype.element_ty), mask=mask)
    if COPY_PASS:
        cols = rot + tl.arange(0, BLOCK_PASS)
        pass_mask = h_mask[:, None] & (cols < head_dim)[None, :]
        kept = tl.load(src_rows + cols[None, :], mask=pass_mask, other=0.0)
        tl.store(dst_rows + cols[None, :], kept, mask=pass_mask)


@triton.jit
def _rotary_kernel(pos_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, q_out_ptr, k_out_ptr,
                   stride_qt, stride_qh, stride_kt, stride_kh,
                   stride_qot, stride_qoh, stride_kot, stride_koh, stride_cos, stride_sin,
                   num_q_heads, num_k_heads, head_dim, half,
                   BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, COPY_PASS: tl.constexpr,
                   BLOCK_PASS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    half_mask = offs < half
    cos_row = cos_ptr + pos * stride_cos
    sin_row = sin_ptr + pos * stride_sin
    cos1 = tl.load(cos_row + offs, mask=half_mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_row + half + offs, mask=half_mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_row + offs, mask=half_mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_row + half + offs, mask=half_mask, other=0.0).to(tl.float32)
    rot = 2 * half
    _rotate_heads(q_ptr + t * stride_qt, q_out_ptr + t * stride_qot, stride_qh, stride_qoh, heads,
                  num_q_heads, offs, half_mask, cos1, cos2, sin1, sin2, half, rot, head_dim,
                  COPY_PASS, BLOCK_PASS)
    _rotate_heads(k_ptr + t * stride_kt, k_out_ptr + t * stride_kot, stride_kh, stride_koh, heads,
                  num_k_heads, offs, half_mask, cos1, cos2, sin1, sin2, half, rot, head_dim,
                  COPY_PASS, BLOCK_PASS)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, *,
                     inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE (rotate-half) on the first ``rotary_dim`` dims of every head of ``q`` ``[T, Hq, D]``
    and ``k`` ``[T, Hk, D]`` (any token and head strides); ``cos``/``sin``: ``[P, rotary_dim]``
    tables, row ``positions[t]`` for token ``t`` (positions are not bounds-checked).  Returns new
    contiguous tensors, or ``(q, k)`` rotated in place with ``inplace``."""
    tokens, num_q_heads, head_dim = q.shape
    if k.dim() != 3 or k.shape[0] != tokens or k.shape[2] != head_dim:
        raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)}")
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rotary_dim {rotary_dim} must be even and in (0, {head_dim}]")
    if cos.shape[-1] != rotary_dim or sin.shape[-1] != rotary_dim:
        raise ValueError("cos/sin tables must have rotary_dim columns")
    if positions.shape != (tokens,):
        raise ValueError(f"positions {tuple(positions.shape)} for {tokens} tokens")
    if inplace and (q.stride(2) != 1 or k.stride(2) != 1):
        raise ValueError("in place needs q and k with a contiguous head_dim")
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    q_in = q if q.stride(2) == 1 else q.contiguous()
    k_in = k if k.stride(2) == 1 else k.contiguous()
    q_out = q if inplace else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = k if inplace else torch.empty(k.shape, dtype=k.dtype, device=k.device)
    num_k_heads = k.shape[1]
    if tokens == 0:
        return q_out, k_out
    half = rotary_dim // 2
    block_half = triton.next_power_of_2(half)
    max_heads = max(num_q_heads, num_k_heads)
    block_h = min(triton.next_power_of_2(max_heads), max(1, 1024 // block_half))
    pass_dims = 0 if inplace else head_dim - rotary_dim
    grid = (tokens, triton.cdiv(max_heads, block_h))
    _rotary_kernel[grid](
        positions, cos, sin, q_in, k_in, q_out, k_out,
        q_in.stride(0), q_in.stride(1), k_in.stride(0), k_in.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        cos.stride(0), sin.stride(0), num_q_heads, num_k_heads, head_dim, half,
        BLOCK_H=block_h, BLOCK_HALF=block_half, COPY_PASS=pass_dims > 0,
        BLOCK_PASS=triton.next_power_of_2(max(pass_dims, 1)),
        num_warps=max(1, min(4, block_h * block_half // 256)))
    return q_out, k_out
