"""The KV cache's block copies (workers/executors/kv_copies.py) on every device here: what goes out
to the host tier or a P/D payload comes back bit for bit, into whichever blocks it is written."""

import pytest
import torch

from workers.executors.kv_copies import KVBlockCopies

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
LAYERS, BLOCKS, BLOCK, HEADS, DIM = 2, 12, 4, 2, 8


class Cache(KVBlockCopies):
    """A cache tensor and the attributes the executor sets, without a model."""

    def __init__(self, device: str, dtype: torch.dtype = torch.bfloat16):
        self.device, self.dtype = torch.device(device), dtype
        self.num_layers, self.block_size, self.num_kv_heads, self.head_dim = LAYERS, BLOCK, HEADS, DIM
        shape = (LAYERS, 2, BLOCKS, BLOCK, HEADS, DIM)
        self.kv_cache = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(self.device, dtype)


def settle(cache: Cache, handle) -> None:
    if handle is not None:
        assert cache.copy_done(handle, wait=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "blocks, slots, back",
    [
        ([0, 1, 2], [0, 1, 2], [9, 10, 11]),  # one run of slots
        ([5, 3, 7, 1], [6, 2, 3, 0], [8, 0, 11, 4]),  # unsorted, three runs
        ([4], [5], [4]),  # back into its own block
    ],
)
def test_blocks_swapped_out_come_back_bit_for_bit(device, blocks, slots, back):
    cache = Cache(device)
    before = cache.read_blocks(blocks).clone()
    cache.allocate_host_cache(8)
    cache.swap_out(blocks, slots)
    settle(cache, cache.host_fence())
    cache.kv_cache[:, :, blocks] = 0
    settle(cache, cache.swap_in(back, slots))
    assert torch.equal(cache.read_blocks(back), before)


@pytest.mark.parametrize("device", DEVICES)
def test_a_host_slot_reads_as_one_block_of_the_payload_layout(device):
    cache = Cache(device)
    cache.allocate_host_cache(4)
    cache.swap_out([6, 2], [3, 1])
    settle(cache, cache.host_fence())
    assert bytes(cache.host_bytes(3)) == cache.to_bytes(cache.read_blocks([6]))
    assert bytes(cache.host_bytes(1)) == cache.to_bytes(cache.read_blocks([2]))


@pytest.mark.parametrize("device", DEVICES)
def test_an_imported_payload_writes_the_blocks_it_names(device):
    src, dst = Cache(device), Cache(device)
    dst.kv_cache.zero_()
    payload = src.to_bytes(src.read_blocks([1, 2, 3, 4]))
    dst.import_blocks([7, 8], payload, [1, 3], 4)  # the payload's 2nd and 4th blocks
    assert torch.equal(dst.read_blocks([7, 8]), src.read_blocks([2, 4]))
    assert not dst.read_blocks([0, 1, 2, 3, 4, 5, 6, 9, 10, 11]).any()
    dst.import_blocks([0, 1, 2, 3], bytearray(payload), [0, 1, 2, 3], 4)  # a writable buffer, all of it
    assert torch.equal(dst.read_blocks([0, 1, 2, 3]), src.read_blocks([1, 2, 3, 4]))
