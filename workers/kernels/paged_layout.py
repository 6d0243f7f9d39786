"""The layout rules both paged attention kernels rely on, checked on the host from shapes only.

q [T, H, D] and caches [num_blocks, block_size, KVH, D] of one dtype with a contiguous last
dimension (other strides are free: q may be a view of a fused qkv output), H a multiple of KVH,
one block-table row and one context length per sequence, tables contiguous along a row. Why: a
kernel reading past these assumptions reads the wrong memory instead of failing.
"""

from torch import Tensor


def check_paged(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    num_seqs: int,
    out: Tensor | None,
) -> None:
    """Raise ValueError unless the tensors follow the module's layout for `num_seqs` sequences."""
    h, d = q.shape[1], q.shape[2]
    kvh = k_cache.shape[2]
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[3] != d or h % kvh:
        raise ValueError(f"q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)}/{tuple(v_cache.shape)}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q and the caches need a contiguous last dimension")
    if q.dtype != k_cache.dtype or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"dtypes differ: q {q.dtype}, k {k_cache.dtype}, v {v_cache.dtype}")
    if block_tables.dim() != 2 or block_tables.shape[0] < num_seqs or context_lens.shape[0] < num_seqs:
        raise ValueError(
            f"{num_seqs} sequences need as many block-table rows {tuple(block_tables.shape)} "
            f"and context lengths {tuple(context_lens.shape)}"
        )
    if block_tables.stride(1) != 1 or block_tables.is_floating_point() or context_lens.is_floating_point():
        raise ValueError("block_tables and context_lens are integer tensors, tables contiguous along a row")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1):
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must match q {tuple(q.shape)} {q.dtype}")
