"""Read or recompute: how much of a prefix hit in the host and disk tiers a worker copies back.

A block in a slower tier comes back at its tier's rate (its bytes at `host_gbps` or `disk_gbps`)
while its request waits; recomputing it costs its share of the request's prefill on the worker's
cost model. A worker loads the leading part of its slow-tier hit whose copy plus the prefill of
what follows takes least time, and recomputes the rest, leaving those tiers' copies as they are:
at 0.5 GB/s a disk block of Llama-3-8B takes ~4 ms to read and ~0.5 ms to recompute on an H200.
The router prices a slow-tier hit with the same `copy_ms` (policies/predict.py), the simulator
decides through the same block pool (bench/sim_worker.py).
"""

from collections.abc import Sequence
from dataclasses import dataclass

from workers.kv.cost_model import CostModel
from workers.kv.events import DISK

# pinned host -> device on one H200: 44-48 GB/s from 16 blocks (bench/results/host_copy_h200_llama8b.json)
HOST_GBPS = 50.0
# block file -> device block through the worker's disk thread, page cache dropped, on a CPU VM:
# 0.44-0.62 GB/s over three runs (bench/results/disk_copy_cpu.json); measure yours: bench/disk_copy.py
DISK_GBPS = 0.5


def copy_ms(host_blocks: float, disk_blocks: float, block_bytes: float, host_gbps: float, disk_gbps: float) -> float:
    """Milliseconds to bring `host_blocks` and `disk_blocks` of `block_bytes` each back to the
    device, one tier after the other (a bound: on a worker the two run side by side)."""
    return block_bytes * (host_blocks / host_gbps + disk_blocks / disk_gbps) / 1e6


def all_pay(
    runs: Sequence[tuple[str, int]], block_bytes: float, block_token_ms: float, host_gbps: float, disk_gbps: float
) -> bool:
    """Whether each block of every tier in `runs` comes back faster than its tokens' prefill
    alone (`block_token_ms`; attention and the steps' fixed costs only add to a recompute): then
    the whole hit is loaded, found without pricing a prefill (the router asks of every worker)."""
    return all(
        copy_ms(tier != DISK, tier == DISK, block_bytes, host_gbps, disk_gbps) < block_token_ms for tier, _ in runs
    )


@dataclass(frozen=True)
class ReadBack:
    """A worker's read-or-recompute choice: its cost model and step budget (`chunk`, the
    max batched tokens), its blocks' bytes and its tiers' rates."""

    cost: CostModel
    block_size: int
    kv_bytes_per_token: int
    chunk: int
    host_gbps: float = HOST_GBPS
    disk_gbps: float = DISK_GBPS

    def blocks(self, runs: Sequence[tuple[str, int]], start: int, prompt_tokens: int) -> int:
        """How many of the slow-tier blocks that follow `start` cached device blocks of a
        `prompt_tokens` prompt to load: `runs` are those blocks in chain order, as (tier, count)
        runs of one tier each. The cut is where loading the blocks before it and prefilling the
        rest takes least time, found at 0 and at the end of each run: within a run the copy grows
        linearly and the prefill it saves at least linearly (later tokens attend to more), so no
        cut inside a run beats both its ends (up to a step's fixed cost). Ties recompute."""
        B, bytes_ = self.block_size, self.block_size * self.kv_bytes_per_token
        if all_pay(runs, bytes_, B * self.cost.prefill_token_ms, self.host_gbps, self.disk_gbps):
            return sum(n for _, n in runs)
        done = start * B
        best_at, best = 0, self.cost.prefill_ms(prompt_tokens - done, done, self.chunk)
        at = host = disk = 0
        for tier, n in runs:
            at += n
            if tier == DISK:
                disk += n
            else:
                host += n
            cached = (start + at) * B
            t = copy_ms(host, disk, bytes_, self.host_gbps, self.disk_gbps)
            t += self.cost.prefill_ms(prompt_tokens - cached, cached, self.chunk)
            if t < best:
                best_at, best = at, t
        return best_at
