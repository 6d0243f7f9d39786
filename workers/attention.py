"""Paged attention: store new K/V into a block-paged cache and attend through block tables.

A layer's cache is a pair of tensors [num_blocks, block_size, kv_heads, head_dim]. A sequence's
tokens live in the blocks its block table lists, so sequences share a cached prefix simply by
listing the same block ids. Two paths, chosen by the step's metadata type:

- `KernelBatch` (CUDA): Triton kernels (workers/kernels) read K/V in place through the block
  tables: one-token rows go to the decode kernel (CUDA-graph safe), chunks to the varlen
  prefill kernel.
- `AttentionBatch` (everywhere, the reference): whole blocks are gathered with one index per
  block and handed to scaled_dot_product_attention. One-token (decode) sequences are batched
  into a single padded call; multi-token (prefill) chunks run one call each.

Shape buckets. On CUDA, scaled_dot_product_attention runs cuDNN, which builds an execution plan
the first time it meets a shape: ~40 ms on an H200, against ~0.4 ms to run one. Decode shapes
(sequences x context) and prefill shapes (chunk x context) change nearly every step, so a fresh
worker spent its first half-minute at a new load building plans, at ~1.8x the step time
(bench/results/README.md, session 6). The runner therefore pads shapes to buckets: the decode
batch with dummy rows (length 1, output dropped), block tables with block 0 (masked out), and
each prefill chunk to a multiple of `bucket` tokens (rows after every real one, which causal
masking hides from them; their output is dropped), so a few plans serve every load.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass
class PrefillSeq:
    """A sequence computing several new tokens: flat rows `rows`, the first at `start_pos`."""

    rows: slice
    start_pos: int
    block_table: Tensor  # [blocks covering 0 .. start_pos + n - 1]


@dataclass
class AttentionBatch:
    """Per-step attention metadata, tensorised once by the runner and shared by every layer."""

    slot_mapping: Tensor  # [T] flat cache slot of each new token
    decode_rows: Tensor  # [S'] flat row of each one-token sequence; S' >= S pads with row 0
    decode_tables: Tensor  # [S', max_blocks] block tables, padded with block 0 (masked out)
    decode_lens: Tensor  # [S'] context length including the new token (1 for padding rows)
    prefills: list[PrefillSeq]
    num_decodes: int = 0  # S: the real decode rows, first in decode_rows
    bucket: int = 1  # prefill chunks are padded to a multiple of this many tokens


@dataclass
class KernelBatch:
    """Per-step metadata for the kernel path, tensorised once by the runner (int32 throughout).

    The first `num_decodes` rows are one-token sequences, attended by the decode kernel (GQA
    packed, split-K); the remaining rows are chunks, attended by the varlen prefill kernel. The
    scheduler lists running decodes first, so a mixed step is one call of each."""

    slot_mapping: Tensor  # [T] flat cache slot of each new token; -1 stores nothing (padding)
    num_decodes: int
    decode_tables: Tensor | None  # [D, W] blocks of each decode row; entries past its context unread
    decode_lens: Tensor | None  # [D] context length including the new token; 0 for padding rows
    prefill_tables: Tensor | None = None  # [P, W] blocks of each chunk
    prefill_lens: Tensor | None = None  # [P] context length including the chunk
    cu_seqlens_q: Tensor | None = None  # [P+1] first row of each chunk, counted from row num_decodes
    max_seqlen_q: int = 0
    num_splits: int | None = None  # decode context partitions (None: the kernel picks from shapes)


class PagedAttention(nn.Module):
    """Causal attention over the paged cache; the runner binds `k_cache`/`v_cache` to each layer."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int | None):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.sliding_window = sliding_window
        self.k_cache = self.v_cache = torch.empty(0)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, batch: AttentionBatch | KernelBatch) -> Tensor:
        """q [T, heads, hd], k/v [T, kv_heads, hd] for the new tokens -> output [T, heads, hd]."""
        if isinstance(batch, KernelBatch):
            return self._kernels(q, k, v, batch)
        self._store(k, v, batch.slot_mapping)
        out = torch.empty_like(q)
        n = batch.num_decodes
        if n:
            out[batch.decode_rows[:n]] = self._decode(q[batch.decode_rows], batch)[:n]
        for seq in batch.prefills:
            rows = seq.rows.stop - seq.rows.start
            pad = -rows % batch.bucket
            chunk = [F.pad(x[seq.rows], (0, 0, 0, 0, 0, pad)) if pad else x[seq.rows] for x in (q, k, v)]
            out[seq.rows] = self._prefill(*chunk, seq)[:rows]
        return out

    def _kernels(self, q: Tensor, k: Tensor, v: Tensor, batch: KernelBatch) -> Tensor:
        from workers.kernels.decode_attention import paged_decode_attention
        from workers.kernels.prefill_attention import paged_prefill_attention
        from workers.kernels.store_kv import store_kv

        store_kv(k, v, self.k_cache, self.v_cache, batch.slot_mapping)
        scale, d = self.head_dim**-0.5, batch.num_decodes
        out = torch.empty_like(q)
        if d:
            paged_decode_attention(
                q[:d],
                self.k_cache,
                self.v_cache,
                batch.decode_tables,
                batch.decode_lens,
                scale,
                self.sliding_window,
                batch.num_splits,
                out=out[:d],
            )
        if batch.cu_seqlens_q is not None:
            paged_prefill_attention(
                q[d:],
                self.k_cache,
                self.v_cache,
                batch.prefill_tables,
                batch.cu_seqlens_q,
                batch.prefill_lens,
                batch.max_seqlen_q,
                scale,
                self.sliding_window,
                out=out[d:],
            )
        return out

    def _store(self, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
        self.k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slot_mapping, k)
        self.v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slot_mapping, v)

    def _gather(self, cache: Tensor, tables: Tensor) -> Tensor:
        """[S, blocks] tables -> [S, kv_heads, blocks * block_size, hd], the layout SDPA wants."""
        s, n = tables.shape
        return cache[tables].view(s, n * cache.shape[1], self.num_kv_heads, self.head_dim).transpose(1, 2)

    def _decode(self, q: Tensor, batch: AttentionBatch) -> Tensor:
        k = self._gather(self.k_cache, batch.decode_tables)
        v = self._gather(self.v_cache, batch.decode_tables)
        kv_pos = torch.arange(k.shape[2], device=q.device)[None, :]
        lens = batch.decode_lens[:, None]
        mask = kv_pos < lens
        if self.sliding_window is not None:
            mask &= kv_pos >= lens - self.sliding_window
        out = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=mask[:, None, None, :], enable_gqa=True)
        return out[:, :, 0]

    def _prefill(self, q: Tensor, k: Tensor, v: Tensor, seq: PrefillSeq) -> Tensor:
        q = q.transpose(0, 1)[None]
        if seq.start_pos == 0 and self.sliding_window is None:
            # Nothing cached precedes the chunk: plain causal attention on the fresh K/V, which
            # also lets CUDA pick a fused kernel.
            out = F.scaled_dot_product_attention(
                q, k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True, enable_gqa=True
            )
            return out[0].transpose(0, 1)
        k = self._gather(self.k_cache, seq.block_table[None])
        v = self._gather(self.v_cache, seq.block_table[None])
        q_pos = torch.arange(seq.start_pos, seq.start_pos + q.shape[2], device=q.device)[:, None]
        kv_pos = torch.arange(k.shape[2], device=q.device)[None, :]
        mask = kv_pos <= q_pos
        if self.sliding_window is not None:
            mask &= kv_pos > q_pos - self.sliding_window
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return out[0].transpose(0, 1)
