"""Paged decode attention: one new query token per sequence, K/V read in place through block tables.

Layouts: q [S, H, D] (last dim contiguous, any row/head strides, e.g. a view of a fused qkv
output); k_cache/v_cache [num_blocks, block_size, KVH, D] (last dim contiguous); block_tables
[S, max_blocks] int32 (or int64), entries past a sequence's blocks are never read; context_lens
[S] int32 (or int64), tokens including the new one, whose K/V are already stored. Query position
p = context_len - 1 sees kv positions p - window < kv <= p. Output [S, H, D] in q's dtype.

Each program owns one (sequence, kv head, split) and all H/KVH query heads of its group, so K/V
are read once per group (GQA), as a [group, BLOCK_N] tl.dot with the group padded to 16 rows.
Split-K (flash-decoding): the context is cut into `num_splits` ranges whose partial outputs and
log-sum-exps a second kernel merges, so few long sequences still fill the GPU. Everything the
host decides depends on shapes only (no .item(), no reads of tensor values), so a CUDA graph can
capture it. Why: today's path gathers every sequence's whole context per layer before SDPA.
"""

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from workers.kernels.launch import TileConfig, dot_precision, pow2, sm_count
from workers.kernels.paged_layout import check_paged

MIN_SPLIT_TOKENS = 256  # a split shorter than this costs more in the merge than it saves
MAX_SPLITS = 64


# Host ints that change from step to step (table width, split count and the partials' strides
# that follow from it) are not specialised on: each new divisibility would compile a variant
# (~0.5 s) inside a step.
@triton.jit(
    do_not_specialize=[
        "num_splits",
        "max_context",
        "stride_ts",
        "stride_ps",
        "stride_ph",
        "stride_pk",
        "stride_ls",
        "stride_lh",
    ]
)
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    lens_ptr,
    out_ptr,
    part_o_ptr,
    part_lse_ptr,
    scale_log2,
    window,
    num_splits,
    max_context,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_ts,
    stride_os,
    stride_oh,
    stride_ps,
    stride_ph,
    stride_pk,
    stride_ls,
    stride_lh,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DIRECT: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq64 = seq.to(tl.int64)
    ctx = tl.minimum(tl.load(lens_ptr + seq).to(tl.int32), max_context)
    start = 0
    if HAS_WINDOW:
        start = tl.maximum(ctx - window, 0)
    per_split = tl.cdiv(tl.cdiv(ctx - start, num_splits), BLOCK_N) * BLOCK_N
    lo = start + split * per_split
    hi = tl.minimum(lo + per_split, ctx)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kvh * GROUP + offs_g
    gd_mask = (offs_g < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + seq64 * stride_qs + heads[:, None] * stride_qh + offs_d[None, :], mask=gd_mask, other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = tables_ptr + seq64 * stride_ts
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + offs_n
        valid = pos < hi
        block = tl.load(table + pos // PAGE, mask=valid, other=0).to(tl.int64)
        slot = (pos % PAGE).to(tl.int64)
        nd_mask = valid[:, None] & (offs_d < HEAD_DIM)[None, :]
        k = tl.load(
            k_ptr + block[:, None] * stride_kb + slot[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :],
            mask=nd_mask,
            other=0.0,
        )
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2
        qk = tl.where(valid[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_ptr + block[:, None] * stride_vb + slot[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :],
            mask=nd_mask,
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new

    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    if DIRECT:
        tl.store(
            out_ptr + seq64 * stride_os + heads[:, None] * stride_oh + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=gd_mask,
        )
    else:
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        tl.store(
            part_o_ptr + seq64 * stride_ps + heads[:, None] * stride_ph + split * stride_pk + offs_d[None, :],
            o,
            mask=gd_mask,
        )
        tl.store(part_lse_ptr + seq64 * stride_ls + heads * stride_lh + split, lse, mask=offs_g < GROUP)


@triton.jit(do_not_specialize=["num_splits", "stride_ps", "stride_ph", "stride_pk", "stride_ls", "stride_lh"])
def _merge_kernel(
    part_o_ptr,
    part_lse_ptr,
    out_ptr,
    num_splits,
    stride_ps,
    stride_ph,
    stride_pk,
    stride_ls,
    stride_lh,
    stride_os,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLITS: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_k = tl.arange(0, SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    k_mask = offs_k < num_splits
    lse = tl.load(part_lse_ptr + seq * stride_ls + head * stride_lh + offs_k, mask=k_mask, other=float("-inf"))
    top = tl.max(lse, 0)
    weight = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))
    o = tl.load(
        part_o_ptr + seq * stride_ps + head * stride_ph + offs_k[:, None] * stride_pk + offs_d[None, :],
        mask=k_mask[:, None] & (offs_d < HEAD_DIM)[None, :],
        other=0.0,
    )
    total = tl.sum(weight, 0)
    merged = tl.sum(o * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        out_ptr + seq * stride_os + head * stride_oh + offs_d,
        merged.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


def decode_config(dtype: torch.dtype) -> TileConfig:
    """64 context tokens per step for 16-bit caches (no spills on sm_90); 32 for fp32 (tests),
    whose tl.dot runs on CUDA cores and needs the registers."""
    return TileConfig(block_n=32 if dtype.itemsize >= 4 else 64, num_warps=4, num_stages=2)


def default_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Splits per (sequence, kv head): enough programs to fill the SMs about twice, but no split
    shorter than MIN_SPLIT_TOKENS of the table's capacity. Shapes only, so graph-safe."""
    programs = max(num_seqs * num_kv_heads, 1)
    want = math.ceil(2 * sm_count(device) / programs)
    most = math.ceil(max_context / MIN_SPLIT_TOKENS)
    return max(1, min(want, most, MAX_SPLITS))


def paged_decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    out: Tensor | None = None,
    config: TileConfig | None = None,
) -> Tensor:
    """Attention of each sequence's one new token over its cached context -> [S, H, D].

    `num_splits` None picks one from S, KVH, the table's width (or the window) and the SM count."""
    s, h, d = q.shape
    _, page, kvh, _ = k_cache.shape
    check_paged(q, k_cache, v_cache, block_tables, context_lens, s, out)
    out = torch.empty_like(q) if out is None else out
    if s == 0:
        return out
    max_context = block_tables.shape[1] * page
    span = min(max_context, sliding_window or max_context)  # the most tokens a query sees
    splits = num_splits or default_num_splits(s, kvh, span, q.device)
    group = h // kvh
    direct = splits == 1
    cfg = config or decode_config(q.dtype)
    part_o = q.new_empty((s, h, splits, d) if not direct else (1, 1, 1, 1), dtype=torch.float32)
    part_lse = q.new_empty((s, h, splits) if not direct else (1, 1, 1), dtype=torch.float32)
    _decode_kernel[(s, kvh, splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        part_o,
        part_lse,
        scale * math.log2(math.e),
        sliding_window or 0,
        splits,
        max_context,
        q.stride(0),
        q.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        *part_o.stride()[:3],
        *part_lse.stride()[:2],
        GROUP=group,
        BLOCK_G=pow2(group, 16),
        HEAD_DIM=d,
        BLOCK_D=pow2(d, 16),
        PAGE=page,
        BLOCK_N=cfg.block_n,
        HAS_WINDOW=sliding_window is not None,
        DIRECT=direct,
        DOT_PREC=dot_precision(q.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if not direct:
        _merge_kernel[(s, h)](
            part_o,
            part_lse,
            out,
            splits,
            *part_o.stride()[:3],
            *part_lse.stride()[:2],
            out.stride(0),
            out.stride(1),
            HEAD_DIM=d,
            BLOCK_D=pow2(d, 16),
            SPLITS=pow2(splits, 2),
            num_warps=4,
        )
    return out
