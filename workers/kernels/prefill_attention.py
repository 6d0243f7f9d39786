"""Paged prefill attention: varlen chunks of new tokens over a cached prefix, K/V read in place.

Layouts: q [T, H, D] holds the rows of P chunks, chunk p's rows cu_seqlens_q[p]:cu_seqlens_q[p+1]
(int32 or int64, P + 1 entries); its n_p tokens sit at positions context_lens[p] - n_p ..
context_lens[p] - 1 and their K/V are already in k_cache/v_cache [num_blocks, block_size, KVH, D],
reached through block_tables [P, max_blocks] (entries past a chunk's blocks are never read).
Causal (kv <= q position) and, with a window, kv > q position - window. Output [T, H, D] in q's
dtype. Contiguous last dimensions, other strides free (see paged_layout.py).

Flash-attention tiles: each program owns BLOCK_M rows of one chunk for one query head (its kv head
is head // group; heads of a group are adjacent program ids, so their K/V tiles meet in L2), and
walks the visible context in BLOCK_N steps with tl.dot and an online softmax. The walk has three
stages: tiles cut by the window's lower edge (masked), tiles every row sees whole (no mask), and
the diagonal (masked). Why: prefill over a cached prefix no longer gathers the prefix per chunk.
"""

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from workers.kernels.launch import TileConfig, dot_precision, pow2
from workers.kernels.paged_layout import check_paged


# The table's width changes from step to step: not specialised on (see decode_attention.py).
@triton.jit(do_not_specialize=["max_context", "stride_ts"])
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    cu_q_ptr,
    lens_ptr,
    out_ptr,
    scale_log2,
    window,
    max_context,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_ts,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    head = tl.program_id(0)
    tile = tl.program_id(1)
    chunk = tl.program_id(2)
    row0 = tl.load(cu_q_ptr + chunk).to(tl.int32)
    n = tl.load(cu_q_ptr + chunk + 1).to(tl.int32) - row0
    if tile * BLOCK_M >= n:
        return
    ctx = tl.minimum(tl.load(lens_ptr + chunk).to(tl.int32), max_context)
    first = ctx - n + tile * BLOCK_M  # position of the tile's first row
    hi = tl.minimum(first + BLOCK_M, ctx)  # one past the tile's last row's position
    lo = 0  # stage 0 [lo, s1): cut by the window's lower edge
    s1 = 0  # stage 1 [s1, s2): seen whole by every row; stage 2 [s2, hi): the diagonal
    if HAS_WINDOW:
        lo = tl.maximum(first - window + 1, 0)
        all_lo = tl.maximum(hi - window, 0)  # kv >= all_lo lies inside every row's window
        s1 = tl.minimum(lo + (tl.maximum(all_lo - lo, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N, hi)
    s2 = s1 + tl.maximum(first + 1 - s1, 0) // BLOCK_N * BLOCK_N

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    rows = tile * BLOCK_M + offs_m
    q_pos = first + offs_m
    md_mask = (rows < n)[:, None] & d_mask[None, :]
    row_off = (row0 + rows).to(tl.int64)
    q = tl.load(q_ptr + row_off[:, None] * stride_qt + head * stride_qh + offs_d[None, :], mask=md_mask, other=0.0)
    kvh = head // GROUP
    table = tables_ptr + chunk.to(tl.int64) * stride_ts
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for stage in tl.static_range(3):
        start = s2
        end = hi
        if stage == 0:
            start = lo
            end = s1
        if stage == 1:
            start = s1
            end = s2
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + offs_n
            valid = pos < hi
            block = tl.load(table + pos // PAGE, mask=valid, other=0).to(tl.int64)
            slot = (pos % PAGE).to(tl.int64)
            nd_mask = valid[:, None] & d_mask[None, :]
            k = tl.load(
                k_ptr + block[:, None] * stride_kb + slot[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :],
                mask=nd_mask,
                other=0.0,
            )
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2
            if stage != 1:
                keep = valid[None, :] & (pos[None, :] <= q_pos[:, None])
                if HAS_WINDOW:
                    keep = keep & (pos[None, :] > q_pos[:, None] - window)
                qk = tl.where(keep, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw nothing yet
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(qk - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                v_ptr + block[:, None] * stride_vb + slot[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :],
                mask=nd_mask,
                other=0.0,
            )
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
            m_i = m_new
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + row_off[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=md_mask,
    )


def prefill_config(dtype: torch.dtype, max_seqlen_q: int) -> TileConfig:
    """Tiles without register spills on sm_90 (ptxas -v): 128 query rows and 8 warps for long
    16-bit chunks, 64 rows for short ones; fp32 (tests: tl.dot on CUDA cores) with small tiles."""
    if dtype.itemsize >= 4:
        return TileConfig(block_m=32, block_n=32, num_warps=4, num_stages=2)
    if max_seqlen_q <= 64:
        return TileConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)
    return TileConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)


def paged_prefill_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    cu_seqlens_q: Tensor,
    context_lens: Tensor,
    max_seqlen_q: int,
    scale: float,
    sliding_window: int | None = None,
    out: Tensor | None = None,
    config: TileConfig | None = None,
) -> Tensor:
    """Causal attention of every chunk's rows over its cached context -> [T, H, D].

    `max_seqlen_q` (a host int >= every chunk's length) sizes the grid; rows of q not covered by
    cu_seqlens_q are left unwritten in `out`."""
    t, h, d = q.shape
    chunks = cu_seqlens_q.shape[0] - 1
    check_paged(q, k_cache, v_cache, block_tables, context_lens, chunks, out)
    out = torch.empty_like(q) if out is None else out
    if t == 0 or chunks <= 0 or max_seqlen_q <= 0:
        return out
    page, kvh = k_cache.shape[1], k_cache.shape[2]
    cfg = config or prefill_config(q.dtype, max_seqlen_q)
    grid = (h, triton.cdiv(max_seqlen_q, cfg.block_m), chunks)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        cu_seqlens_q,
        context_lens,
        out,
        scale * math.log2(math.e),
        sliding_window or 0,
        block_tables.shape[1] * page,
        q.stride(0),
        q.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=h // kvh,
        HEAD_DIM=d,
        BLOCK_D=pow2(d, 16),
        PAGE=page,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        HAS_WINDOW=sliding_window is not None,
        DOT_PREC=dot_precision(q.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out
