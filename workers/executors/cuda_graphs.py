"""CUDA graphs for decode steps: the model's forward and logits captured once per batch-size
bucket over static input buffers, then replayed with one copy of the step's inputs.

A decode step of a small model is hundreds of short kernels, and launching them from Python
costs more than running them (measured: ~670 launches, 12.9 ms wall for 7.2 ms of GPU work);
a replay launches them all at once. A step of n sequences replays the smallest bucket >= n;
the extra rows have context length 0 and slot -1, so they read and write no cache and their
logits are dropped. Prefill and mixed steps run eagerly.
"""

import logging
import time
from array import array
from collections.abc import Callable

import torch
from torch import Tensor

from workers.attention import KernelBatch
from workers.executors.kernel_inputs import DecodeInputs, Staging

log = logging.getLogger("kvgate.worker")


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_num_seqs (which is always a bucket), as vLLM does."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


class DecodeGraphs:
    """`forward(ids, positions, batch) -> logits` captured for every bucket; `run` replays."""

    def __init__(
        self,
        forward: Callable[[Tensor, Tensor, KernelBatch], Tensor],
        max_num_seqs: int,
        max_blocks: int,
        device: torch.device,
        num_splits: Callable[[int], int | None],
    ):
        self.device = device
        self.sizes = bucket_sizes(max_num_seqs)
        self.max_blocks = max_blocks
        n = self.sizes[-1]
        # ids, positions, slots, lens, and the last step's sampled row each input token is (or -1)
        self.vectors = torch.zeros(5, n, dtype=torch.int32, device=device)
        self.tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.staging = Staging(device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, Tensor] = {}
        self.capture_s = 0.0
        self.memory_bytes = 0
        self._capture(forward, num_splits)

    def _batch(self, bs: int, num_splits: Callable[[int], int | None]) -> KernelBatch:
        ids, pos, slots, lens, _ = self.vectors[:, :bs].unbind(0)
        return KernelBatch(slots, bs, self.tables[:bs], lens, num_splits=num_splits(bs))

    def _capture(self, forward, num_splits) -> None:
        """Largest bucket first, all in one memory pool, so the smaller graphs reuse its memory."""
        t0 = time.perf_counter()
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_reserved(self.device)
        pool = None
        self.vectors[2].fill_(-1)
        for bs in reversed(self.sizes):
            batch = self._batch(bs, num_splits)
            ids, pos = self.vectors[0, :bs], self.vectors[1, :bs]
            forward(ids, pos, batch)  # compiles every kernel before capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bs] = forward(ids, pos, batch)
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)
        self.capture_s = time.perf_counter() - t0
        self.memory_bytes = torch.cuda.memory_reserved(self.device) - before
        log.info(
            "captured %d decode CUDA graphs (batch 1..%d) in %.1f s, %.0f MiB",
            len(self.sizes),
            self.sizes[-1],
            self.capture_s,
            self.memory_bytes / 2**20,
        )

    @property
    def max_num_seqs(self) -> int:
        return self.sizes[-1]

    def run(self, d: DecodeInputs, fill_ids: Callable[[Tensor, Tensor], None]) -> Tensor:
        """Logits [n, vocab] of a decode step of n <= max_num_seqs sequences, from one copy of
        its inputs; `fill_ids(ids, sample_src)` writes the previous step's sampled tokens into
        the input ids on the device before the replay."""
        n = d.num_seqs
        bs = next(b for b in self.sizes if b >= n)
        zeros, skip = array("i", [0]) * (bs - n), array("i", [-1]) * (bs - n)
        dev = self.staging.upload(
            d.token_ids
            + zeros
            + d.positions
            + zeros
            + d.slots
            + skip
            + d.context_lens
            + zeros
            + d.sample_src
            + skip
            + d.tables
        )
        self.vectors[:, :bs].copy_(dev[: 5 * bs].view(5, bs))
        if d.width:
            self.tables[:n, : d.width].copy_(dev[5 * bs :].view(n, d.width))
        fill_ids(self.vectors[0, :bs], self.vectors[4, :bs])
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
