"""FlexAttention over our paged KV cache: a BlockMask whose KV blocks are the cache's pages.

The cache [num_blocks, block_size, KVH, D] is viewed as one physical sequence [1, KVH,
num_blocks * block_size, D] (no copy); each sequence's rows may see only its own pages, so the
block mask lists, per query-row tile, the physical pages it reads (through the block table), as
full pages (every row sees all of it) or partial ones (the mask_mod decides per token: causal
on the logical position that an inverse page table recovers). Why: the comparison issue 14 asks
for, our Triton kernels against FlexAttention with a paged block mask.
"""

import torch
from torch import Tensor


def paged_block_mask(tables: Tensor, context_lens: Tensor, num_q: int, num_blocks: int, page: int, q_block: int = 128):
    """BlockMask for B sequences, each with its last `num_q` tokens as queries (1: decode), whose
    pages are tables[b, :ceil(len / page)], over the physical cache of `num_blocks` pages."""
    from torch.nn.attention.flex_attention import BlockMask

    b, width = tables.shape
    dev = tables.device
    tables = tables.long()
    lens = context_lens.long()
    rows = -(-num_q // q_block)
    first = lens[:, None] - num_q + torch.arange(rows, device=dev)[None, :] * q_block  # [B, rows]
    last = torch.minimum(first + q_block - 1, lens[:, None] - 1)
    visible = last // page + 1  # logical pages some row of the tile sees
    full = torch.clamp((first + 1) // page, max=visible)  # pages every row sees whole
    cols = torch.arange(width, device=dev)
    # Index lists as wide as the physical cache, as flex's dense conversions expect (torch's own
    # paged attention pads the same way); entries past a row's count are ignored.
    full_idx = torch.zeros(b, rows, num_blocks, dtype=torch.long, device=dev)
    part_idx = torch.zeros_like(full_idx)
    full_idx[:, :, :width] = tables[:, None, :]
    part_idx[:, :, :width] = tables.gather(1, (full[:, :, None] + cols).clamp(max=width - 1).view(b, -1)).view(
        b, rows, width
    )
    logical = torch.full((b, num_blocks), -1, dtype=torch.long, device=dev)
    owned = cols[None, :] < ((lens + page - 1) // page)[:, None]
    logical[torch.arange(b, device=dev)[:, None].expand(b, width)[owned], tables[owned]] = cols.expand(b, width)[owned]

    def mask_mod(bi: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        block = logical[bi, kv_idx // page]
        return (block >= 0) & (block * page + kv_idx % page <= lens[bi] - num_q + q_idx)

    return BlockMask.from_kv_blocks(
        (visible - full)[:, None].int(),
        part_idx[:, None].int().contiguous(),
        full[:, None].int(),
        full_idx[:, None].int().contiguous(),
        BLOCK_SIZE=(q_block, page),
        mask_mod=mask_mod,
        seq_lengths=(num_q, num_blocks * page),
        compute_q_blocks=False,
    )


def physical_kv(cache: Tensor) -> Tensor:
    """[num_blocks, block_size, KVH, D] -> [1, KVH, num_blocks * block_size, D], a view."""
    n, page, kvh, d = cache.shape
    return cache.view(1, n * page, kvh, d).transpose(1, 2)
