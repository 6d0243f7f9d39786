"""Rotary position embedding applied in place to q and k, cos/sin read from a per-position table.

Layouts: q [T, H, D] and k [T, KVH, D] (last dim contiguous, other strides free: views of a
fused qkv output are fine), positions [T] int32 or int64 (each < the table's rows), and a table
[max_positions, D] in q's dtype, as `rotary_cache` builds it: the D/2 frequencies' cos, then
their sin. Values are cos/sin of fp32 frequencies rounded to the model dtype, so results follow
llama.apply_rotary's rounding: HF's rotate-half (NeoX) convention, each product rounded to the
dtype before the sum.
Why: no per-step cos/sin tensors and no rotate-half copies, one launch for q and k.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from workers.kernels.launch import pow2


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    pos_ptr,
    cache_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_c,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF
    cos = tl.load(cache_ptr + pos * stride_c + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cache_ptr + pos * stride_c + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    for which in tl.static_range(2):
        if which == 0:
            ptrs = q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :]
            mask = (offs_h < HEADS)[:, None] & d_mask[None, :]
        else:
            ptrs = k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
            mask = (offs_h < KV_HEADS)[:, None] & d_mask[None, :]
        x1 = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
        # Each product rounded to the dtype before the sum, as the eager bf16 ops round.
        dt = q_ptr.dtype.element_ty
        x1c = (x1 * cos).to(dt).to(tl.float32)
        x2s = (x2 * sin).to(dt).to(tl.float32)
        x2c = (x2 * cos).to(dt).to(tl.float32)
        x1s = (x1 * sin).to(dt).to(tl.float32)
        tl.store(ptrs, (x1c - x2s).to(dt), mask=mask)
        tl.store(ptrs + HALF, (x2c + x1s).to(dt), mask=mask)


def rotary_cache(inv_freq: Tensor, max_positions: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """[max_positions, D]: cos then sin of position * inv_freq, as llama.Rotary computes them."""
    positions = torch.arange(max_positions, device=device)
    freqs = positions[:, None].float() * inv_freq.to(device)[None, :]
    return torch.cat((freqs.cos().to(dtype), freqs.sin().to(dtype)), dim=-1)


def apply_rotary_inplace(q: Tensor, k: Tensor, positions: Tensor, cos_sin_cache: Tensor) -> None:
    """Rotate q and k in place by their rows' positions."""
    t, h, d = q.shape
    kvh = k.shape[1]
    if k.shape[0] != t or k.shape[2] != d or d % 2 or cos_sin_cache.shape[-1] != d:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, table {tuple(cos_sin_cache.shape)} do not fit")
    if q.dtype != k.dtype or cos_sin_cache.dtype != q.dtype or positions.shape[0] < t:
        raise ValueError(
            f"dtypes q {q.dtype}, k {k.dtype}, table {cos_sin_cache.dtype}; {positions.shape[0]} positions"
        )
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        raise ValueError("q, k and the table need a contiguous last dimension")
    if t == 0:
        return
    _rotary_kernel[(t,)](
        q,
        k,
        positions,
        cos_sin_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin_cache.stride(0),
        HEADS=h,
        KV_HEADS=kvh,
        HALF=d // 2,
        BLOCK_H=pow2(max(h, kvh)),
        BLOCK_HALF=pow2(d // 2),
        num_warps=4,
    )
