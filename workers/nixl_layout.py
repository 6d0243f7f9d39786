"""Where a worker's KV cache lives, for a NIXL peer to WRITE into its blocks: what `GET /kv/nixl`
serves and a Redis AgentRecord carries (workers/transfer_nixl.py, workers/nixl_peers.py)."""

from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class CacheLayout:
    """Where a worker's KV cache lives, for a peer to address its blocks: the cache tensor is
    [layers, 2, num_blocks, ...] contiguous, so block b of slice s (layer*2 + K/V) starts at
    base + (s * num_blocks + b) * slice_bytes."""

    agent: str
    metadata: str  # the agent's NIXL metadata, base64
    mem: str  # DRAM or VRAM
    device: int
    base: int
    num_blocks: int
    num_slices: int
    slice_bytes: int

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "CacheLayout":
        """Raises ValueError for anything but a layout."""
        try:
            layout = cls(
                str(d["agent"]),
                str(d["metadata"]),
                str(d["mem"]),
                *(int(d[k]) for k in ("device", "base", "num_blocks", "num_slices", "slice_bytes")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a NIXL cache layout: {e!r}") from None
        if layout.mem not in ("DRAM", "VRAM") or min(layout.num_blocks, layout.num_slices, layout.slice_bytes) <= 0:
            raise ValueError("a NIXL cache layout names DRAM or VRAM and has positive sizes")
        return layout

    def descs(self, runs: list[tuple[int, int]], run_lengths: np.ndarray) -> np.ndarray:
        """Nx3 (address, length, device) for runs of blocks starting at `runs[i]`, in every slice."""
        starts = np.asarray(runs, dtype=np.uint64)
        slices = np.arange(self.num_slices, dtype=np.uint64)[:, None]
        addr = self.base + (slices * self.num_blocks + starts[None, :]) * self.slice_bytes
        out = np.empty((addr.size, 3), dtype=np.uint64)
        out[:, 0] = addr.ravel()
        out[:, 1] = np.tile(run_lengths.astype(np.uint64) * self.slice_bytes, self.num_slices)
        out[:, 2] = self.device
        return out
