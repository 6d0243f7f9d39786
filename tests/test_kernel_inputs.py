"""The kernel path's host-side step inputs (pure Python; the device only receives them)."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from workers.executors.batch import SeqChunk
from workers.executors.kernel_inputs import Staging, chunk_inputs, kernel_inputs
from workers.sampling_params import SamplingParams


@given(st.data(), st.integers(1, 32))
def test_chunk_slots_follow_each_chunks_table(data, block_size):
    """slot(p) = table[p // B] * B + p % B for every position of every chunk, in order."""
    chunks, want, next_block = [], [], 0
    for _ in range(data.draw(st.integers(1, 5))):
        end = data.draw(st.integers(1, 200))
        start = data.draw(st.integers(0, end - 1))
        blocks = -(-end // block_size) + data.draw(st.integers(0, 2))  # tables may run past the chunk
        table = list(range(next_block, next_block + blocks))[:: data.draw(st.sampled_from([1, -1]))]
        next_block += blocks
        chunks.append(chunk(end - start, start, table, sample=False))
        want += [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
    assert chunk_inputs(chunks, block_size).slots.tolist() == want


def chunk(tokens: int, start: int, table: list[int], sample: bool = True) -> SeqChunk:
    return SeqChunk(list(range(100, 100 + tokens)), start, table, sample, SamplingParams(max_tokens=4), 0)


def test_mixed_step_packs_decodes_then_chunks():
    """Decodes first (one token each), then prefill chunks with their offsets, slots, tables."""
    b = 4
    chunks = [chunk(1, 5, [7, 3]), chunk(6, 2, [9, 1, 4], sample=False), chunk(3, 0, [2])]
    c = chunk_inputs(chunks[1:], b)
    assert c.cu_seqlens.tolist() == [0, 6, 9] and c.longest == 6 and c.width == 2
    assert c.slots.tolist() == [38, 39, 4, 5, 6, 7, 8, 9, 10]
    assert c.tables.tolist() == [9, 1, 2, 0]
    ids, pos, batch = kernel_inputs(chunks, b, Staging(torch.device("cpu")))
    assert batch.num_decodes == 1 and batch.decode_lens.tolist() == [6]
    assert batch.decode_tables.tolist() == [[7, 3]]
    assert pos.tolist() == [5, 2, 3, 4, 5, 6, 7, 0, 1, 2]
    assert batch.slot_mapping.tolist() == [3 * b + 1, *c.slots.tolist()]
    assert ids.tolist() == [100, *range(100, 106), *range(100, 103)]
    assert batch.prefill_lens.tolist() == [8, 3] and batch.cu_seqlens_q.tolist() == [0, 6, 9]
