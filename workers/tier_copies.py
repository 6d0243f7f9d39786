"""The host and disk tiers' copies in flight: handed to the executor and the disk thread before
each step, and a copy back's blocks marked loaded once every copy and read under it is done."""

from workers.executors.batch import Executor
from workers.kv.block_pool import BlockPool, Load
from workers.kv.disk_io import DiskIO
from workers.kv.disk_pool import DiskRead, DiskWrite
from workers.kv.host_pool import run_copies
from workers.step_stats import StepStats


class TierCopies:
    """A copy back is done when its device copies and its disk reads have all landed; loads are
    marked done oldest first, since a later one may wait on blocks an earlier one brings."""

    def __init__(self, pool: BlockPool, disk_io: DiskIO | None, stats: StepStats) -> None:
        self.pool, self.disk_io, self.stats = pool, disk_io, stats
        self.copying: list[tuple[list, list[Load]]] = []  # (executor handles, the loads they carry)

    @property
    def busy(self) -> bool:
        """Whether a copy back or a disk job may be outstanding."""
        return bool(self.copying) or self.disk_io is not None

    def start(self, executor: Executor) -> None:
        """Hand the host tier's queued copies to `executor` (before the step or the KV import
        that could overwrite an evicted block); the copies back may still run after this, and
        their loads are done when the executor says their copies are."""
        loads = self.pool.take_loads()
        run = run_copies(self.pool.take_copies(), executor)
        self.stats.host_stored_blocks += run.out
        self.stats.host_loaded_blocks += run.back
        if loads:
            self.copying.append((run.handles, loads))
        if self.disk_io is not None:
            jobs = self.pool.take_disk_jobs()
            writes = sum(isinstance(j, DiskWrite) for j in jobs)
            self.disk_io.submit(jobs, executor.host_fence() if writes else None)
            self.stats.disk_stored_blocks += writes
            self.stats.disk_loaded_blocks += sum(isinstance(j, DiskRead) for j in jobs)

    def poll(self, executor: Executor, wait: bool = False) -> None:
        """Apply the finished disk jobs, then mark done the loads whose copies and disk reads have
        completed, oldest first (`wait`: for the oldest)."""
        self._take_disk_done()
        while self.copying:
            handles, loads = self.copying[0]
            if not all(executor.copy_done(h, wait) for h in handles):
                return
            while any(load.reads_left for load in loads):
                if not (wait and self._take_disk_done(wait=True)):
                    return
            for load in loads:
                load.done = True
            self.copying.pop(0)
            wait = False

    def close(self) -> None:
        if self.disk_io is not None:
            self.disk_io.close()

    def _take_disk_done(self, wait: bool = False) -> int:
        """Apply the disk jobs finished so far (`wait`: at least one, if any is queued); how many."""
        done = self.disk_io.take_done(wait) if self.disk_io is not None else []
        for job in done:
            self.pool.disk_done(job)
        return len(done)
