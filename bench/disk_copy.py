"""Disk KV tier: write and read-back rates of the worker's disk I/O thread with the torch executor.

N host slots of a real model's K/V are written to block files by `DiskIO` (workers/kv/disk_io.py)
as the engine hands them over, then read back into device blocks: cold (each file synced and
dropped from the page cache first, so reads go to the device under the filesystem) and warm
(straight after, from the page cache). Each rate is N blocks' bytes over the time from handing
the jobs over to the last one done. The cold read rate is the default of gateway
--disk-kv-gbps. JSON out.
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from workers.executors.torch_runner import TorchRunner
from workers.kv.disk_io import DiskIO
from workers.kv.disk_pool import DiskJob, DiskPool, DiskRead, DiskWrite
from workers.kv.events import EventLog
from workers.model_store import resolve


def timed(io: DiskIO, jobs: list[DiskJob]) -> float:
    """Seconds from handing `jobs` over until the last is done; every one must succeed."""
    t0 = time.perf_counter()
    io.submit(jobs, None)
    done: list[DiskJob] = []
    while len(done) < len(jobs):
        done += io.take_done(wait=True)
    seconds = time.perf_counter() - t0
    assert all(j.ok for j in done), "a disk job failed"
    return seconds


def drop_cache(directory: Path) -> None:
    for path in directory.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def measure(model: str, blocks: int, block_size: int, root: str) -> dict:
    runner = TorchRunner(str(resolve(model)), blocks, block_size)
    runner.allocate_host_cache(blocks)
    with torch.inference_mode():
        runner.kv_cache.normal_()
    runner.swap_out(list(range(blocks)), list(range(blocks)))
    entries = DiskPool(blocks, EventLog("bench")).store([(h, (h,) * block_size) for h in range(1, blocks + 1)])[0]
    io = DiskIO(root, "disk-copy-bench", runner)
    try:
        block_bytes = len(runner.host_bytes(0))
        total = blocks * block_bytes
        write_s = timed(io, [DiskWrite(e, i) for i, e in enumerate(entries) if e is not None])
        drop_cache(io.dir)
        reads = [DiskRead(e, blocks - 1 - i, None, 0) for i, e in enumerate(entries) if e is not None]  # type: ignore[arg-type]
        cold_s = timed(io, reads)
        warm_s = timed(io, [DiskRead(r.entry, r.block_id, None, 0) for r in reads])  # type: ignore[arg-type]
        same = torch.equal(runner.kv_cache[:, :, blocks - 1], runner.host_cache[0])
    finally:
        io.close()
    return {
        "model": model,
        "device": str(runner.device),
        "blocks": blocks,
        "block_size": block_size,
        "block_bytes": block_bytes,
        "write_gbps": total / write_s / 1e9,
        "read_cold_gbps": total / cold_s / 1e9,
        "read_warm_gbps": total / warm_s / 1e9,
        "round_trip_bit_identical": same,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--blocks", type=int, default=256, help="blocks written and read back")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dir", default=tempfile.gettempdir(), help="the disk tier's directory (--disk-kv-dir)")
    p.add_argument("--out", required=True, help="JSON report")
    args = p.parse_args(argv)
    result = measure(args.model, args.blocks, args.block_size, args.dir)
    result["command"] = " ".join(["python -m bench.disk_copy", *(argv if argv is not None else sys.argv[1:])])
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
