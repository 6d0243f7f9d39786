"""The paged KV cache's block copies on a torch device: P/D export and import, and the host tier's
swaps out and back.

A mixin of the torch executor (`TorchRunner`): these read and write its one cache tensor,
[layers, 2, blocks, block_size, kv_heads, head_dim], so a set of blocks is one index op, and its
host tier's pinned slots, so a run of slots is one copy. The engine and the transfer code call
them on the executor, as they do the `sim` executor's stand-ins (workers/executors/sim.py).
"""

from contextlib import nullcontext

import torch
from torch import Tensor

from workers.sampling import to_device


class KVBlockCopies:
    """Block copies over `kv_cache`; the executor sets the attributes annotated here."""

    kv_cache: Tensor
    device: torch.device
    dtype: torch.dtype
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    host_cache: Tensor  # allocate_host_cache

    def read_blocks(self, block_ids: list[int]) -> Tensor:
        """K/V of these blocks, [layers, 2, n, block_size, kv_heads, head_dim], on the runner's device."""
        return self.kv_cache[:, :, torch.tensor(block_ids, device=self.device)]

    def write_blocks(self, block_ids: list[int], kv: Tensor) -> None:
        """Write a tensor shaped as `read_blocks` returns into these blocks (P/D import)."""
        index = torch.tensor(block_ids, device=self.device)
        self.kv_cache.index_copy_(2, index, kv.to(device=self.device, dtype=self.dtype))

    def allocate_host_cache(self, num_slots: int) -> None:
        """The host tier's K/V, [slots, layers, 2, block_size, kv_heads, head_dim]: a slot is
        contiguous, so a run of slots is one copy; pinned on CUDA, so copies do not block. Left
        uninitialised (tens of GiB would take seconds to zero): a slot is read only after a store."""
        self.host_cache = torch.empty(
            num_slots,
            self.num_layers,
            2,
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
            dtype=self.dtype,
            pin_memory=self.device.type == "cuda",
        )
        self.copy_stream: torch.cuda.Stream | None = None

    def swap_out(self, block_ids: list[int], slots: list[int]) -> None:
        """Copy device blocks into host slots (block_ids[i] -> slots[i]): one gather on the
        device, then one asynchronous copy per run of consecutive slots, in the step stream's
        order (a later step that overwrites the blocks runs after it)."""
        order = sorted(range(len(slots)), key=slots.__getitem__)
        ids = to_device([block_ids[i] for i in order], torch.long, self.device)
        with torch.inference_mode():
            gathered = self.kv_cache.index_select(2, ids).permute(2, 0, 1, 3, 4, 5).contiguous()
            for first, start, n in _runs([slots[i] for i in order]):
                self.host_cache[start : start + n].copy_(gathered[first : first + n], non_blocking=True)

    def swap_in(self, block_ids: list[int], slots: list[int]) -> "torch.cuda.Event | None":
        """Copy host slots back into device blocks (slots[i] -> block_ids[i]): one asynchronous
        copy per run of consecutive slots, then one scatter. On CUDA they run on a copy stream
        that first waits for everything queued so far (copies out of the blocks reused here) and
        then overlaps the steps queued after; the returned event marks their end. Every tensor
        they use is made on that stream, so the allocator reuses none of it before they end."""
        order = sorted(range(len(slots)), key=slots.__getitem__)
        sorted_slots = [slots[i] for i in order]
        cuda = self.device.type == "cuda"
        stream = self._copy_stream() if cuda else None
        with torch.inference_mode(), torch.cuda.stream(stream) if stream is not None else nullcontext():
            parts = [
                self.host_cache[start : start + n].to(self.device, non_blocking=True)
                for _, start, n in _runs(sorted_slots)
            ]
            kv = torch.cat(parts).permute(1, 2, 0, 3, 4, 5)
            self.kv_cache.index_copy_(2, to_device([block_ids[i] for i in order], torch.long, self.device), kv)
            if stream is None:
                return None
            done = torch.cuda.Event()
            done.record(stream)
        return done

    def host_fence(self) -> "torch.cuda.Event | None":
        """On CUDA, an event after every copy out queued so far on the step stream (they are
        asynchronous into pinned memory); on CPU they are done already."""
        if self.device.type != "cuda":
            return None
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        return done

    def host_bytes(self, slot: int) -> memoryview:
        """Host slot `slot`'s K/V, [layers, 2, block_size, kv_heads, head_dim]: one block of
        `import_blocks`' payload layout, as a view of the slot (read off the engine thread after
        `host_fence`, while the slot is pinned)."""
        return memoryview(self.host_cache[slot].view(torch.uint8).reshape(-1).numpy())

    def _copy_stream(self) -> "torch.cuda.Stream":
        """The stream copies back run on, made to wait for the work queued on the step stream."""
        if self.copy_stream is None:
            self.copy_stream = torch.cuda.Stream(self.device)
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        return self.copy_stream

    @staticmethod
    def copy_done(handle: "torch.cuda.Event", wait: bool = False) -> bool:
        if wait:
            handle.synchronize()
        return handle.query()

    @staticmethod
    def to_bytes(kv: Tensor) -> bytes:
        """`read_blocks`' tensor as the transfer payload's raw bytes."""
        return kv.contiguous().cpu().view(torch.uint8).numpy().tobytes()

    def import_blocks(self, block_ids: list[int], data: bytes | Tensor, positions: list[int], total: int) -> None:
        """Write blocks `positions` of a `total`-block payload (bytes, or a tensor from CUDA IPC).

        Any thread may call it: it writes only `block_ids`, which the importer holds and has not
        published, so no step reads them (workers/transfer.py: reserve, write, publish)."""
        if isinstance(data, Tensor):
            kv = data
        else:
            buf = data if not memoryview(data).readonly else bytearray(data)
            raw = torch.frombuffer(buf, dtype=torch.uint8).view(self.dtype)
            kv = raw.view(self.num_layers, 2, total, self.block_size, self.num_kv_heads, self.head_dim)
        self.write_blocks(block_ids, kv if len(positions) == total else kv[:, :, positions])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """Sorted slots as runs of consecutive ones: (index of its first, first slot, length)."""
    runs: list[tuple[int, int, int]] = []
    for i, s in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == s:
            first, start, n = runs[-1]
            runs[-1] = (first, start, n + 1)
        else:
            runs.append((i, s, 1))
    return runs
