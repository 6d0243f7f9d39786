"""The disk tier (workers/kv/disk_pool.py, disk_io.py): blocks stored in the host tier are written
through to files by hash, LRU within the tier, and a prefix hit reads them back into fresh device
blocks. Residency, copies and file jobs are checked against a shadow of the bytes under random
operations; the I/O thread keeps order, re-checks tokens and cleans up its files."""

from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import example, given, settings
from hypothesis import strategies as st

from workers.kv.block_pool import BlockPool
from workers.kv.disk_io import DiskIO, decode, header
from workers.kv.disk_pool import DiskDelete, DiskPool, DiskRead, DiskWrite
from workers.kv.events import DISK, HOST, REMOVED, STORED, EventLog
from workers.kv.host_pool import SWAP_OUT, HostPool
from tests.tier_events import replay
from tests.tier_shadow import TierShadow

B = 2


def tiers(num_blocks: int, num_slots: int, num_files: int) -> BlockPool:
    log = EventLog("w")
    return BlockPool(num_blocks, B, log, HostPool(num_slots, log), DiskPool(num_files, log))


def cache(pool: BlockPool, h: int) -> None:
    """A block of hash h (tokens (h, h)) filled and let go: cached on the device, evictable."""
    [b] = pool.allocate(1)
    pool.register([b], [h], [(h, h)], None)
    pool.free([b])


@dataclass
class DiskShadow(TierShadow):
    """The shadow with files: disk jobs run in order when `run_io` runs them, and a copy back
    from host waits for its load's reads."""

    files: dict[str, tuple] = field(default_factory=dict)
    jobs: list = field(default_factory=list)  # disk jobs handed over, not run yet
    swap_in: dict[int, int] = field(default_factory=dict)  # device block -> host slot, copies back not run yet

    def flush(self) -> None:
        for batch in self.pool.take_copies():
            for bid, slot in zip(batch.block_ids, batch.slots):
                if batch.direction == SWAP_OUT:
                    self.host[slot] = self.device.get(bid)
                else:
                    self.swap_in[bid] = slot
        self.jobs.extend(self.pool.take_disk_jobs())

    def run_io(self, n: int) -> None:
        for job in self.jobs[:n]:
            name = job.entry.name
            if isinstance(job, DiskWrite):
                self.files[name] = (job.entry.hash, job.entry.token_ids, self.host.get(job.slot))
            elif isinstance(job, DiskRead):
                got = self.files.get(name)
                if got is None or got[:2] != (job.entry.hash, job.entry.token_ids):
                    self.pool.disk_done(job)
                    continue
                self.device[job.block_id] = got[2]
            else:
                self.files.pop(name, None)
            job.ok = True
            self.pool.disk_done(job)
        del self.jobs[:n]
        self.flush()

    def copy_back(self, load) -> None:
        self.run_io(len(self.jobs))
        assert load.reads_left == 0
        for b in load.blocks:
            if b.block_id in self.swap_in:
                self.device[b.block_id] = self.host.get(self.swap_in.pop(b.block_id))
        load.done = True

    def drain(self) -> None:
        super().drain()
        self.run_io(len(self.jobs))


def test_the_disk_tier_is_lru_and_announces_its_changes():
    log = EventLog("w")
    disk = DiskPool(2, log)
    made, dropped = disk.store([(1, (1,)), (2, (2,))])
    assert [e.hash for e in made if e] == [1, 2] and not dropped
    disk.touch(disk.lookup(1, (1,)))
    made, dropped = disk.store([(3, (3,)), (1, (1,))])
    assert made[1] is None, "a hash held already is not written again"
    assert [e.hash for e in dropped] == [2] and disk.hashes() == [3, 1]
    assert disk.lookup(3, (9,)) is None, "tokens are re-checked: a collision is a miss"
    made, dropped = disk.store([(4, (4,)), (5, (5,)), (6, (6,))])
    assert [e and e.hash for e in made] == [None, 5, 6], "4 was pushed out by 6 within the call: not written"
    assert {e.hash for e in dropped} == {3, 1}
    again, _ = disk.store([(5, (5,))])
    assert again == [None]
    first = disk.lookup(6, (6,))
    disk.store([(7, (7,)), (8, (8,)), (6, (6,))])
    assert first is not None and disk.lookup(6, (6,)).name != first.name, "a hash stored again gets a file of its own"
    kinds = [(e.kind, e.hashes) for e in log.after(0).events if e.medium == DISK]
    assert kinds[3:5] == [(REMOVED, (3, 1)), (STORED, (5, 6))]
    assert replay(log.after(0).events, DISK) == set(disk.hashes())


def test_a_block_spilled_to_host_is_written_through_and_comes_back_from_disk():
    pool = tiers(2, 1, 4)
    cache(pool, 11)
    taken = pool.allocate(2)  # evicts 11 to host, which writes it to disk
    [out] = pool.take_copies()
    assert out.direction == SWAP_OUT
    [write] = pool.take_disk_jobs()
    assert isinstance(write, DiskWrite) and write.slot == out.slots[0] and pool.disk_hashes() == [11]
    pool.free(taken)
    cache(pool, 12)
    pool.allocate(2)
    pool.take_copies()
    assert pool.take_disk_jobs() == [], "the only host slot is pinned by 11's write: 12 is dropped"
    write.ok = True
    pool.disk_done(write)
    pool.free(pool.blocks)
    cache(pool, 13)
    pool.allocate(2)  # 13 takes the slot: 11 is now on disk alone
    pool.take_copies()
    pool.take_disk_jobs()
    assert pool.host_hashes() == [13] and pool.disk_hashes() == [11, 13]
    pool.free(pool.blocks)
    assert pool.load_prefix([11], [11, 12], 0, None) is None, "tokens are re-checked"
    load = pool.load_prefix([11], [11, 11], 0, None)
    assert load is not None and load.slots == [] and load.reads_left == 1
    [read] = [j for j in pool.take_disk_jobs() if isinstance(j, DiskRead)]
    assert read.block_id == load.blocks[0].block_id
    read.ok = True
    pool.disk_done(read)
    load.done = True
    pool.land(load)
    assert pool.lookup(11, (11, 11)) is load.blocks[0]


def test_a_failed_read_cuts_the_load_and_a_failed_write_drops_the_entry():
    pool = tiers(4, 4, 4)
    for h in (1, 2):
        cache(pool, h)
    pool.free(pool.allocate(4))
    pool.take_copies()
    writes = pool.take_disk_jobs()
    pool.disk_done(writes[0])  # not ok: the disk is full, say
    assert pool.disk_hashes() == [2]
    assert [type(j) for j in pool.take_disk_jobs()] == [DiskDelete], "its partial file is deleted"
    pool.host.clear()  # 2 is on disk alone now
    load = pool.load_prefix([2], [2, 2], 0, None)
    assert load is not None
    [read] = pool.take_disk_jobs()
    pool.disk_done(read)  # the file did not hold the block
    load.done = True
    pool.land(load)
    assert pool.lookup(2, (2, 2)) is None, "a block that did not come back never enters the cache"


def test_files_hold_hash_and_tokens_and_the_io_thread_cleans_up(tmp_path):
    data = bytearray(header(-5, (1, 2, 70000)) + b"kv")
    assert decode(data, -5, (1, 2, 70000)) == b"kv"
    assert decode(data, -5, (1, 2, 3)) is None and decode(data, 4, (1, 2, 70000)) is None
    assert decode(data[:10], -5, (1, 2, 70000)) is None
    stale = tmp_path / "kvgate-w_1-1-0123abcd"
    stale.mkdir()
    (stale / "1-1.kv").write_bytes(header(1, (1, 1)))
    other = tmp_path / "kvgate-w_1-2-1-0123abcd"  # worker w/1-2's
    other.mkdir()

    class Ex:
        def __init__(self):
            self.written: list = []

        def host_bytes(self, slot):
            return bytes([slot])

        def import_blocks(self, ids, data, positions, total):
            self.written.append((ids, data))

        def copy_done(self, fence, wait):
            return True

    ex = Ex()
    io = DiskIO(str(tmp_path), "w/1", ex)
    assert not stale.exists() and other.exists(), "an earlier run's files of this worker id are removed"
    entry = DiskPool(4, EventLog("w")).store([(7, (7, 7))])[0][0]
    assert entry is not None
    jobs = [DiskWrite(entry, 3), DiskRead(entry, 2, None, 0), DiskDelete(entry), DiskRead(entry, 1, None, 0)]
    io.submit(jobs, None)
    done: list = []
    while len(done) < len(jobs):
        done += io.take_done(wait=True)
    assert done == jobs and [j.ok for j in jobs] == [True, True, True, False], "in order: read after write"
    assert ex.written == [([2], bytes([3]))]
    io.submit([DiskWrite(entry, 1)] * 100, None)
    io.close()
    assert not io.dir.exists() and list(Path(tmp_path).iterdir()) == [other], "a run's files go at shutdown"


@settings(max_examples=400, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["alloc", "free", "cache", "load", "land", "abort", "clear", "io", "io"]),
            st.integers(0, 6),
        ),
        max_size=80,
    ),
    st.integers(0, 3),
    st.integers(0, 5),
)
@example(  # a host slot whose write to disk is pending, wanted by LRU for a block spilled meanwhile
    [("cache", 0), ("alloc", 6), ("free", 6), ("cache", 1), ("alloc", 6), ("free", 6), ("load", 0), ("land", 0)], 1, 2
)
@example(  # a hash cached again after a clear while its old file's jobs are still queued
    [("cache", 0), ("alloc", 6), ("free", 6), ("io", 6), ("clear", 0), ("cache", 0), ("alloc", 6)]
    + [("free", 6), ("cache", 1), ("alloc", 6), ("free", 6), ("load", 0), ("land", 0)],
    1,
    3,
)
def test_three_tiers_keep_totals_and_never_serve_a_stale_block(ops, num_slots, num_files):
    """A shadow of every device block's, host slot's and file's bytes follows the copies (out at
    once, back when the load lands) and the disk jobs (in order, when `io` runs them). A hash is
    cached again after a clear with other bytes (new weights): a landed block must hold its
    hash's bytes of now, whichever tier it came back from; every tier's count adds up."""
    pool = tiers(6, num_slots, num_files)
    s = DiskShadow(pool, num_slots)
    epoch = 0  # bumped by a clear: the bytes a hash's block holds from then on differ

    for op, n in ops:
        h = n % 4 + 1  # few hashes: each is cached, evicted and cached again many times
        if op == "alloc":
            s.alloc(n)
        elif op == "free":
            s.free(n)
        elif op == "cache" and pool.can_allocate(1) and pool.lookup(h, (h, h)) is None:
            [b] = pool.allocate(1)
            s.flush()
            s.device[b.block_id] = (h, epoch)
            pool.register([b], [h], [(h, h)], None)
            pool.free([b])
        elif op == "load" and pool.lookup(h, (h, h)) is None:
            load = pool.load_prefix([h], [h, h], 0, None)
            s.flush()
            if load is not None:
                s.loading.append(load)
        elif op == "land" and (s.loading or s.released):
            load = s.land(n)
            for b, lh in zip(load.blocks, load.hashes):
                assert s.device[b.block_id] == (lh, epoch), "a block came back with other bytes"
        elif op == "abort":
            s.abort(n)
        elif op == "clear":
            pool.clear_cache()
            s.flush()
            if not any(b.hash for b in s.held):  # blocks in use keep their hash through a clear
                epoch += 1
        elif op == "io":
            s.run_io(n + 1)
        s.check_totals()
        assert len(pool.disk) <= num_files
    s.drain()
    assert pool.num_free == pool.num_blocks and not pool.releasing, "device blocks return to the total"
    assert pool.host.num_free + len(pool.host) == num_slots and not pool.host.num_draining, "no slot stays pinned"
    assert set(s.files) == {e.name for e in pool.disk._entries.values()}, "a file for every disk entry, no other"
    events = pool.events.after(0).events
    assert replay(events, "device") == set(pool.resident_hashes())
    assert replay(events, HOST) == set(pool.host_hashes())
    assert replay(events, DISK) == set(pool.disk_hashes()), "disk events replay to the disk tier"
