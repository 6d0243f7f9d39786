"""Store the step's new K/V rows into their slots of the paged cache, both caches in one launch.

Layouts: k/v [T, KVH, D] (last dim contiguous, other strides free: views of a fused qkv output
are fine), k_cache/v_cache [num_blocks, block_size, KVH, D] of the same dtype, slot_mapping [T]
int32 or int64 holding block * block_size + offset, -1 for a row to skip (padding). One program
per token. Why: replaces two index_copy_ launches (and their index checks) per layer.
"""

import triton
import triton.language as tl
from torch import Tensor

from workers.kernels.launch import pow2


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slots_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ckb,
    stride_ckt,
    stride_ckh,
    stride_cvb,
    stride_cvt,
    stride_cvh,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot < 0:
        return
    block = slot // PAGE
    offset = slot % PAGE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    tl.store(
        k_cache_ptr + block * stride_ckb + offset * stride_ckt + offs_h[:, None] * stride_ckh + offs_d[None, :],
        k,
        mask=mask,
    )
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(
        v_cache_ptr + block * stride_cvb + offset * stride_cvt + offs_h[:, None] * stride_cvh + offs_d[None, :],
        v,
        mask=mask,
    )


def store_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """k_cache/v_cache[slot] = k/v[row] for every row whose slot is >= 0, in place."""
    t, kvh, d = k.shape
    if v.shape != k.shape or k_cache.shape[2:] != (kvh, d) or v_cache.shape != k_cache.shape:
        raise ValueError(f"k/v {tuple(k.shape)}/{tuple(v.shape)} do not fit caches {tuple(k_cache.shape)}")
    if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
        raise ValueError(f"dtypes differ: k {k.dtype} -> {k_cache.dtype}, v {v.dtype} -> {v_cache.dtype}")
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k, v and the caches need a contiguous last dimension")
    if slot_mapping.shape[0] < t:
        raise ValueError(f"{t} rows but {slot_mapping.shape[0]} slots")
    if t == 0:
        return
    _store_kv_kernel[(t,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        KV_HEADS=kvh,
        HEAD_DIM=d,
        BLOCK_H=pow2(kvh),
        BLOCK_D=pow2(d),
        PAGE=k_cache.shape[1],
        num_warps=4,
    )
