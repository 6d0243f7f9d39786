"""The disk tier's files, written, read and deleted by one I/O thread off the engine thread.

Jobs (workers/kv/disk_pool.py) run in the order they were handed over, so a block is never read
before its write is done, and each job's result comes back to the engine thread (`take_done`),
which applies it to the pool (`BlockPool.disk_done`). A write waits for its batch's `fence` (the
executor's copies into the host slots it reads) before reading the slot.

A file is the block's hash, its token ids and its K/V bytes; a read re-checks the hash and the
tokens against the entry before the bytes go into the device block. Files live in a directory
of this run's own under `root` (`kvgate-<worker id>-<pid>-<nonce>`): `close` removes it, and a
worker starting on a `root` holding earlier runs' directories of its worker id removes them
(the index is in memory, so their files could never be served anyway).
"""

import logging
import os
import queue
import re
import shutil
import struct
import threading
import uuid
from pathlib import Path

from workers.kv.disk_pool import DiskJob, DiskRead, DiskWrite

log = logging.getLogger("kvgate.disk")

MAGIC = b"KVGD1\n"
HEADER = struct.Struct("<6sQI")  # magic, hash (64 bits), number of tokens; then int64 tokens, K/V


def header(h: int, tokens: tuple[int, ...]) -> bytes:
    """What a block's file holds before its K/V bytes."""
    return HEADER.pack(MAGIC, h & (2**64 - 1), len(tokens)) + struct.pack(f"<{len(tokens)}q", *tokens)


def decode(data: bytearray, h: int, tokens: tuple[int, ...]) -> memoryview | None:
    """The K/V bytes of a file's `data` if it holds block `h` with `tokens`, else None (a view:
    the bytes go into the device block without another copy)."""
    if len(data) < HEADER.size:
        return None
    magic, got, n = HEADER.unpack_from(data)
    end = HEADER.size + 8 * n
    if magic != MAGIC or got != h & (2**64 - 1) or n != len(tokens) or len(data) < end:
        return None
    if struct.unpack_from(f"<{n}q", data, HEADER.size) != tokens:
        return None
    return memoryview(data)[end:]


def read(path: Path) -> bytearray:
    """A file's bytes, read into one writable buffer."""
    with open(path, "rb", buffering=0) as f:
        data = bytearray(os.fstat(f.fileno()).st_size)
        f.readinto(data)
    return data


def run_dir_prefix(worker_id: str) -> str:
    return "kvgate-" + re.sub(r"[^A-Za-z0-9_.-]", "_", worker_id) + "-"


def is_run_dir(name: str, worker_id: str) -> bool:
    """Whether `name` is a run directory of worker `worker_id` (not of one whose id it prefixes)."""
    return re.fullmatch(re.escape(run_dir_prefix(worker_id)) + r"\d+-[0-9a-f]{8}", name) is not None


class DiskIO:
    """One thread running disk jobs in order against `root` and an executor: `host_bytes(slot)`
    reads a host slot's K/V, `import_blocks` writes a device block, `copy_done(fence, wait)`."""

    def __init__(self, root: str, worker_id: str, executor):
        base = Path(root)
        base.mkdir(parents=True, exist_ok=True)
        prefix = run_dir_prefix(worker_id)
        for stale in [d for d in base.iterdir() if is_run_dir(d.name, worker_id)]:
            log.warning("removing %s: KV files of an earlier run of worker %s", stale, worker_id)
            shutil.rmtree(stale, ignore_errors=True)
        self.dir = base / f"{prefix}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.dir.mkdir()
        self.executor = executor
        self._jobs: queue.SimpleQueue[tuple[object, list[DiskJob]] | None] = queue.SimpleQueue()
        self._done: list[DiskJob] = []
        self._lock = threading.Lock()
        self._finished = threading.Condition(self._lock)
        self._queued = 0  # jobs handed over and not yet finished
        self._closing = False  # jobs still queued are skipped: their files are about to go
        self._thread = threading.Thread(target=self._loop, name="kv-disk", daemon=True)
        self._thread.start()

    def submit(self, jobs: list[DiskJob], fence: object | None) -> None:
        """Run `jobs` in order after every job handed over before, their writes after `fence`."""
        if jobs:
            with self._lock:
                self._queued += len(jobs)
            self._jobs.put((fence, jobs))

    def take_done(self, wait: bool = False) -> list[DiskJob]:
        """The jobs finished since the last call, in order (`wait`: at least one, if any is queued)."""
        with self._lock:
            if wait and not self._done and self._queued:
                self._finished.wait_for(lambda: bool(self._done) or not self._queued)
            done, self._done = self._done, []
            return done

    def _loop(self) -> None:
        while (item := self._jobs.get()) is not None:
            fence, jobs = item
            if fence is not None:
                self.executor.copy_done(fence, True)
            for job in jobs:
                try:
                    if not self._closing:
                        self._run(job)
                except Exception:
                    log.exception("disk tier: %s of %s failed", type(job).__name__, job.entry.name)
                with self._lock:
                    self._done.append(job)
                    self._queued -= 1
                    self._finished.notify_all()

    def _run(self, job: DiskJob) -> None:
        path = self.dir / job.entry.name
        if isinstance(job, DiskWrite):
            with open(path, "wb") as f:
                f.write(header(job.entry.hash, job.entry.token_ids))
                f.write(self.executor.host_bytes(job.slot))
        elif isinstance(job, DiskRead):
            kv = decode(read(path), job.entry.hash, job.entry.token_ids) if path.exists() else None
            if kv is None:
                log.warning("disk tier: %s does not hold its block; it is recomputed", path)
                return
            self.executor.import_blocks([job.block_id], kv, [0], 1)
        else:
            path.unlink(missing_ok=True)
        job.ok = True

    def close(self) -> None:
        """Stop the thread (the jobs still queued are skipped) and remove this run's files."""
        self._closing = True
        self._jobs.put(None)
        self._thread.join(timeout=30)
        shutil.rmtree(self.dir, ignore_errors=True)
