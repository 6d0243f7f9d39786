"""The kernel path's step inputs: the scheduler's chunks packed into int32 arrays on the host,
moved to the device in one asynchronous copy from a reused pinned buffer.

Per-sequence Python (a few list operations each) is the only host work of a step's inputs: no
tensor is built per token or per sequence, and no pinned memory is allocated per step.
"""

from array import array
from dataclasses import dataclass

import torch
from torch import Tensor

from workers.attention import KernelBatch
from workers.executors.batch import SeqChunk


class Staging:
    """A pinned host buffer, reused every step, for host -> device copies of int32 arrays.

    The copy is asynchronous, so before the buffer is written again the previous copy must have
    left it: an event recorded after each copy is waited on before the next fill."""

    def __init__(self, device: torch.device, size: int = 1 << 16):
        self.device = device
        self.pinned = device.type == "cuda"
        self.host = torch.empty(size, dtype=torch.int32, pin_memory=self.pinned)
        self.copied = torch.cuda.Event() if self.pinned else None

    def upload(self, values: array) -> Tensor:
        """`values` (array of 'i') as a new int32 tensor on the device."""
        n = len(values)
        if self.copied is not None:
            self.copied.synchronize()
        if n > self.host.numel():
            self.host = torch.empty(max(n, 2 * self.host.numel()), dtype=torch.int32, pin_memory=self.pinned)
        if n:
            self.host[:n].copy_(torch.frombuffer(values, dtype=torch.int32))
        out = self.host[:n].to(self.device, non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        return out


@dataclass
class DecodeInputs:
    """A decode-only step on the host: one token per sequence (graph replay fills its buffers)."""

    token_ids: array
    positions: array
    slots: array
    context_lens: array
    tables: array  # [n, width] row-major
    width: int
    sample_src: array  # per row: the last step's sampled row its input token is, or -1 (workers/inflight.py)

    @property
    def num_seqs(self) -> int:
        return len(self.token_ids)


def is_decode(chunks: list[SeqChunk]) -> bool:
    """Every chunk computes one token and samples: the step a decode graph can replay."""
    return all(len(c.token_ids) == 1 and c.sample for c in chunks)


def leading_decodes(chunks: list[SeqChunk]) -> int:
    """How many chunks from the front compute one token and sample (the scheduler puts running
    decodes first): those rows go to the decode kernel."""
    n = 0
    for c in chunks:
        if len(c.token_ids) != 1 or not c.sample:
            break
        n += 1
    return n


def decode_inputs(chunks: list[SeqChunk], block_size: int) -> DecodeInputs:
    """Each field built by one comprehension; table rows copied as slices into a zeroed array."""
    b = block_size
    n = len(chunks)
    pos = array("i", [c.start_pos for c in chunks])
    used = [p // b + 1 for p in pos]
    width = max(used, default=0)
    tables = array("i", bytes(4 * n * width))
    for r, (c, k) in enumerate(zip(chunks, used)):
        row = c.block_table[:k]  # a request's table is an int32 array: the slice copies as bytes
        tables[r * width : r * width + k] = row if isinstance(row, array) else array("i", row)
    return DecodeInputs(
        token_ids=array("i", [c.token_ids[0] for c in chunks]),
        positions=pos,
        slots=array("i", [c.block_table[p // b] * b + p % b for c, p in zip(chunks, pos)]),
        context_lens=array("i", [p + 1 for p in pos]),
        tables=tables,
        width=width,
        sample_src=array("i", [c.prev_sample for c in chunks]),
    )


@dataclass
class ChunkInputs:
    """The multi-token part of a step on the host: varlen rows, chunk offsets, block tables."""

    token_ids: array
    positions: array
    slots: array
    context_lens: array
    cu_seqlens: array
    tables: array  # [n, width] row-major
    width: int
    longest: int


def chunk_inputs(chunks: list[SeqChunk], block_size: int) -> ChunkInputs:
    """Per chunk a few array extends; the slots (one per token) in one vectorised pass after."""
    b = block_size
    width = max((-(-(c.start_pos + len(c.token_ids)) // b) for c in chunks), default=0)
    ids, pos, lens, cu, tables = (array("i") for _ in range(5))
    pad = [0] * width
    cu.append(0)
    longest = 0
    for c in chunks:
        n, start = len(c.token_ids), c.start_pos
        end = start + n
        row = c.block_table[: -(-end // b)]
        ids.extend(c.token_ids)
        pos.extend(range(start, end))
        lens.append(end)
        cu.append(cu[-1] + n)
        tables.extend(row)
        tables.extend(pad[: width - len(row)])
        longest = max(longest, n)
    return ChunkInputs(ids, pos, slots_of(pos, cu, tables, width, b), lens, cu, tables, width, longest)


def slots_of(pos: array, cu: array, tables: array, width: int, block_size: int) -> array:
    """slot = table[row][p // B] * B + p % B for every token, row the chunk it belongs to."""
    if not pos:
        return array("i")
    p = torch.frombuffer(pos, dtype=torch.int32).long()
    rows = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.frombuffer(cu, dtype=torch.int32).diff())
    table = torch.frombuffer(tables, dtype=torch.int32)
    slots = (table[rows * width + p // block_size].long() * block_size + p % block_size).int()
    return array("i", slots.numpy().tobytes())


def kernel_inputs(chunks: list[SeqChunk], block_size: int, staging: Staging) -> tuple[Tensor, Tensor, KernelBatch]:
    """(token ids, positions, KernelBatch) for any step, in one host -> device copy."""
    nd = leading_decodes(chunks)
    d = decode_inputs(chunks[:nd], block_size)
    c = chunk_inputs(chunks[nd:], block_size)
    flat, at = packed(
        [
            d.token_ids + c.token_ids,
            d.positions + c.positions,
            d.slots + c.slots,
            d.context_lens,
            d.tables,
            c.context_lens,
            c.cu_seqlens,
            c.tables,
        ]
    )
    dev = staging.upload(flat)
    ids, pos, slots, dlens, dtables, plens, cu, ptables = (dev[lo:hi] for lo, hi in at)
    batch = KernelBatch(slots, nd, None, None)
    if nd:
        batch.decode_lens, batch.decode_tables = dlens, dtables.view(nd, d.width)
    if len(c.context_lens):
        batch.prefill_lens, batch.cu_seqlens_q = plens, cu
        batch.prefill_tables, batch.max_seqlen_q = ptables.view(len(plens), c.width), c.longest
    return ids, pos, batch


def packed(fields: list[array]) -> tuple[array, list[tuple[int, int]]]:
    """The fields end to end, each starting on a 16-byte boundary, and each one's (start, end).

    Triton specialises a kernel on whether each pointer argument is 16-byte aligned, so slices
    at arbitrary offsets compiled a new variant for most steps (~0.5 s each, measured on an H200
    as prefill steps of 490 ms)."""
    flat, at = array("i"), []
    for f in fields:
        at.append((len(flat), len(flat) + len(f)))
        flat.extend(f)
        flat.extend(ALIGN_PAD[: -len(flat) % 4])
    return flat, at


ALIGN_PAD = array("i", [0, 0, 0])
