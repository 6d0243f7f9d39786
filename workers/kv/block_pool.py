"""The paged KV block pool with a hash-indexed prefix cache.

Blocks are fixed-size (B tokens) and ref-counted. A block whose ref count drops to zero keeps
its hash and contents ("cached but free") until it is reused; reuse evicts the least recently
freed cached block, after first using blocks that never held a full hashed block. Every change
of residency (a hash registered, a hash evicted, the cache cleared) goes to the event log.

Block objects are created on first use, in id order (the order a fresh pool hands them out
anyway), so a pool of many blocks costs nothing until it fills: the fleet simulator builds
hundreds of them.

With a host tier (`host`), a cached block evicted from the device is stored there by hash
instead of vanishing, and a prefix hit that runs on into host-resident blocks takes fresh device
blocks for them and copies them back (`load_prefix`). The copies are queued in order and leave
in batches through `take_copies`: the engine hands them to its executor before the next step,
which is the first that could overwrite an evicted block. A copy back may take several steps:
its blocks (a `Load`) stay held and out of the prefix cache, and the host slots it reads stay
pinned, until it is done (`land`): only then can a step read them or another request hit them.

With a disk tier under the host (`disk`, workers/kv/disk_pool.py), every block stored in the
host is also queued for a file, its host slot pinned until the write is done; a prefix hit runs
on through host- and disk-resident blocks alike, a disk block read straight into its fresh
device block. Disk jobs leave in order through `take_disk_jobs` (after `take_copies`: a write
reads what the copies out put in the host, a read overwrites a block a copy out reads), and
their results come back through `disk_done`; a load is done once its copies and reads are.
"""

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import chain

from workers.kv.disk_pool import DiskDelete, DiskEntry, DiskJob, DiskPool, DiskRead, DiskWrite
from workers.kv.events import CLEARED, DISK, HOST, REMOVED, STORED, EventLog
from workers.kv.host_pool import SWAP_IN, SWAP_OUT, CopyBatch, HostEntry, HostPool, batches


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = field(default=())


@dataclass(eq=False)
class Load:
    """A copy back from the host and disk tiers: fresh device blocks (held, not yet in the prefix
    cache) that host `slots` are copied into and `reads_left` disk reads are still to fill, with
    the hashes and tokens they get once `done`."""

    blocks: list[Block]
    hashes: list[int]
    tokens: list[tuple[int, ...]]
    parent: int | None
    slots: list[int]
    done: bool = False
    reads_left: int = 0

    def cut(self, index: int) -> None:
        """Block `index` did not come back: it and the blocks after it never enter the cache."""
        del self.hashes[index:], self.tokens[index:]


def tier_runs(entries: list[HostEntry | DiskEntry]) -> list[tuple[str, int]]:
    """Slow-tier entries in chain order as (tier, count) runs of one tier each."""
    runs: list[tuple[str, int]] = []
    for e in entries:
        tier = HOST if isinstance(e, HostEntry) else DISK
        if runs and runs[-1][0] == tier:
            runs[-1] = (tier, runs[-1][1] + 1)
        else:
            runs.append((tier, 1))
    return runs


class BlockPool:
    """Ref-counted blocks, an O(1) free list, and the hash -> block prefix-cache map."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        events: EventLog,
        host: HostPool | None = None,
        disk: DiskPool | None = None,
    ):
        assert disk is None or host is not None, "the disk tier is written through the host tier"
        self.block_size = block_size
        self.host = host
        self.disk = disk
        self._to_disk: list[tuple[int, tuple[int, ...], int]] = []  # (hash, tokens, host slot) spilled
        self._disk_jobs: list[DiskJob] = []  # reads queued by loads, in order
        self._copies: list[tuple[str, int, int]] = []  # (direction, block id, host slot), in order
        self._loads: list[Load] = []  # loads whose copies are queued, not yet taken
        self._released: list[Load] = []  # loads whose request ended before they were done
        self._flying: dict[int, Load] = {}  # every load not landed yet, by id
        self.num_blocks = num_blocks
        self.blocks: list[Block] = []  # the blocks used so far; block i is blocks[i]
        self.events = events
        self._free_plain: OrderedDict[int, None] = OrderedDict()  # freed, never hashed or cleared
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self._by_hash: dict[int, int] = {}
        self.num_shared = 0  # blocks in use by two or more references (a prefix its requests share)

    @property
    def num_free(self) -> int:
        return self.num_blocks - len(self.blocks) + len(self._free_plain) + len(self._free_cached)

    def lookup(self, h: int, token_ids: tuple[int, ...]) -> Block | None:
        """The cached block for hash `h` whose tokens really are `token_ids`, if any."""
        bid = self._by_hash.get(h)
        if bid is None:
            return None
        block = self.blocks[bid]
        return block if block.token_ids == token_ids else None

    def touch(self, block: Block) -> None:
        """Take a reference on a cached block (a prefix hit)."""
        if block.ref_count == 0:
            del self._free_cached[block.block_id]
        elif block.ref_count == 1:
            self.num_shared += 1
        block.ref_count += 1

    def resident_prefix(self, hashes: list[int]) -> tuple[int, list[tuple[str, int]]]:
        """How many leading `hashes` are cached on the device, and the slow-tier blocks that
        follow them as (tier, count) runs, by hash alone and taking nothing: an estimate of a
        prefix hit as `touch_prefix` and `load_prefix` take it (they also check the tokens)."""
        by_hash, host, disk = self._by_hash, self.host, self.disk
        n = next((i for i, h in enumerate(hashes) if h not in by_hash), len(hashes))
        runs: list[tuple[str, int]] = []
        for h in hashes[n:]:
            tier = HOST if host is not None and h in host else DISK if disk is not None and h in disk else None
            if tier is None:
                break
            if runs and runs[-1][0] == tier:
                runs[-1] = (tier, runs[-1][1] + 1)
            else:
                runs.append((tier, 1))
        return n, runs

    def touch_prefix(self, hashes: list[int], token_ids: list[int]) -> list[Block]:
        """`lookup` and `touch` along a chain until the first miss: the cached blocks of the
        longest prefix of `hashes`, block i holding token_ids[i*B:(i+1)*B]. Prompts run to
        hundreds of blocks, so the tokens of all hash hits are compared in one go, block by
        block only when that finds a difference (a 64-bit hash collision)."""
        B, by_hash, blocks = self.block_size, self._by_hash, self.blocks
        found = []
        for h in hashes:
            bid = by_hash.get(h)
            if bid is None:
                break
            found.append(blocks[bid])
        if list(chain.from_iterable([b.token_ids for b in found])) != token_ids[: len(found) * B]:
            del found[next(i for i, b in enumerate(found) if b.token_ids != tuple(token_ids[i * B : (i + 1) * B])) :]
        cached = self._free_cached
        for block in found:
            if block.ref_count == 0:
                del cached[block.block_id]
            elif block.ref_count == 1:
                self.num_shared += 1
            block.ref_count += 1
        return found

    def hold(self, block_ids: list[int]) -> list[Block]:
        """One more reference on blocks in use, so they outlive their request until `free`:
        a P/D export reads a finished prefill's blocks off the engine thread."""
        held = [self.blocks[i] for i in block_ids]
        for block in held:
            assert block.ref_count > 0, f"block {block.block_id} is not in use"
            self.num_shared += block.ref_count == 1
            block.ref_count += 1
        return held

    def can_allocate(self, n: int) -> bool:
        return self.num_free >= n

    def allocate(self, n: int) -> list[Block]:
        """n fresh blocks (ref 1); evicts cached-free blocks LRU-first when plain ones run out."""
        if n > self.num_free:
            raise RuntimeError(f"out of KV blocks: need {n}, have {self.num_free}")
        out, evicted, spilled, blocks = [], [], [], self.blocks
        for _ in range(n):
            if len(blocks) < self.num_blocks:
                block = Block(len(blocks))
                blocks.append(block)
            elif self._free_plain:
                block = blocks[self._free_plain.popitem(last=False)[0]]
            else:
                block = blocks[self._free_cached.popitem(last=False)[0]]
                spilled.append((block.block_id, block.hash, block.token_ids))
                evicted.append(self._evict(block))
            block.ref_count = 1
            out.append(block)
        if evicted:
            self.events.append(REMOVED, tuple(evicted))
        if spilled and self.host is not None:
            self._spill(spilled)
        return out

    def _spill(self, spilled: list) -> None:
        """Store evicted blocks in the host tier and queue their copies (before any reuse)."""
        assert self.host is not None
        slots = self.host.store([(h, toks) for _, h, toks in spilled])
        self._copies += [(SWAP_OUT, bid, slot) for (bid, _, _), slot in zip(spilled, slots) if slot is not None]
        if self.disk is not None:
            self._to_disk += [(h, toks, slot) for (_, h, toks), slot in zip(spilled, slots) if slot is not None]

    def load_prefix(
        self,
        hashes: list[int],
        token_ids: list[int],
        start: int,
        parent: int | None,
        choose: Callable[[list[tuple[str, int]]], int] | None = None,
    ) -> Load | None:
        """Continue a prefix hit from block `start` (hashes[0] is block start's) into the slower
        tiers: fresh device blocks (ref 1) for the leading host- or disk-resident blocks whose
        tokens match, their host slots pinned and their copies back and disk reads queued; the
        blocks enter the prefix cache when the load lands. Stops early where the device pool
        has no room, and where `choose` (given the found blocks as runs of one tier, it says how
        many to load: workers/kv/read_back.py) cuts it; the blocks cut are left in their tiers
        untouched, to be recomputed."""
        host, disk, B = self.host, self.disk, self.block_size
        if host is None:
            return None
        found: list[HostEntry | DiskEntry] = []
        for i, h in enumerate(hashes[: self.num_free]):
            tokens = tuple(token_ids[(start + i) * B : (start + i + 1) * B])
            entry: HostEntry | DiskEntry | None = host.lookup(h, tokens)
            if entry is None and disk is not None:
                entry = disk.lookup(h, tokens)
            if entry is None:
                break
            found.append(entry)
        if found and choose is not None:
            del found[choose(tier_runs(found)) :]
        if not found:
            return None
        for e in found:
            if isinstance(e, HostEntry):
                host.touch(e)
            else:
                assert disk is not None
                disk.touch(e)
        slots = [e.slot for e in found if isinstance(e, HostEntry)]
        host.pin(slots)  # before allocating: what it spills cannot drop them
        fresh = self.allocate(len(found))
        load = Load(fresh, [e.hash for e in found], [e.token_ids for e in found], parent, slots)
        for i, (b, e) in enumerate(zip(fresh, found)):
            if isinstance(e, HostEntry):
                self._copies.append((SWAP_IN, b.block_id, e.slot))
            else:
                self._disk_jobs.append(DiskRead(e, b.block_id, load, i))
                load.reads_left += 1
        self._loads.append(load)
        self._flying[id(load)] = load
        return load

    def take_copies(self) -> list[CopyBatch]:
        """The queued host copies, as batches in order; the queue is emptied."""
        copies, self._copies = self._copies, []
        return batches(copies)

    def take_disk_jobs(self) -> list[DiskJob]:
        """The disk jobs queued since the last call, in order (after `take_copies`): the reads of
        loads, then the writes of the blocks spilled to host since (their host slots pinned until
        `disk_done`) and the deletes of the files that the writes push out of the tier."""
        jobs, self._disk_jobs = self._disk_jobs, []
        spilled, self._to_disk = self._to_disk, []
        host, disk = self.host, self.disk
        if disk is None or host is None or not spilled:
            return jobs
        # a block stored and pushed out of the host by a later one before now is not written
        live = [(h, t, slot) for h, t, slot in spilled if (e := host.lookup(h, t)) is not None and e.slot == slot]
        made, dropped = disk.store([(h, t) for h, t, _ in live])
        writes = [DiskWrite(entry, slot) for entry, (_, _, slot) in zip(made, live) if entry is not None]
        host.pin([w.slot for w in writes])
        return jobs + writes + [DiskDelete(e) for e in dropped]

    def disk_done(self, job: DiskJob) -> None:
        """Apply a finished disk job: a write lets its host slot go (a failed one drops its entry),
        a read counts toward its load (a failed one cuts the load there)."""
        if isinstance(job, DiskWrite):
            assert self.host is not None and self.disk is not None
            self.host.unpin([job.slot])
            if not job.ok and self.disk.discard(job.entry):
                self._disk_jobs.append(DiskDelete(job.entry))
        elif isinstance(job, DiskRead):
            job.load.reads_left -= 1
            if not job.ok:
                job.load.cut(job.index)

    def take_loads(self) -> list[Load]:
        """The loads whose copies `take_copies` has handed out since the last call."""
        loads, self._loads = self._loads, []
        return loads

    def land(self, load: Load) -> None:
        """A done load's blocks enter the prefix cache (they stay held) and its slots are unpinned."""
        assert load.done and self.host is not None
        del self._flying[id(load)]
        self.host.unpin(load.slots)
        self.register(load.blocks, load.hashes, load.tokens, load.parent)

    def release(self, load: Load) -> None:
        """Its request ended: the blocks are freed once the copy into them is done."""
        self._released.append(load)
        self.land_released()

    def land_released(self) -> None:
        """Land and free the released loads that are done."""
        for load in [ld for ld in self._released if ld.done]:
            self._released.remove(load)
            self.land(load)
            self.free(load.blocks)

    @property
    def releasing(self) -> bool:
        """Whether released loads still hold blocks."""
        return bool(self._released)

    def _evict(self, block: Block) -> int:
        h = block.hash
        assert h is not None, "only cached (hashed) blocks are evicted"
        del self._by_hash[h]
        block.hash, block.token_ids = None, ()
        return h

    def free(self, blocks: list[Block]) -> None:
        """Drop one reference from each block; a sequence's tail goes first in eviction order."""
        plain, cached = self._free_plain, self._free_cached
        for block in reversed(blocks):
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block.block_id} freed twice"
            self.num_shared -= block.ref_count == 1
            if block.ref_count == 0:
                if block.hash is None:
                    plain[block.block_id] = None
                else:
                    cached[block.block_id] = None

    def register(
        self, blocks: list[Block], hashes: list[int], tokens: list[tuple[int, ...]], parent: int | None
    ) -> None:
        """Record newly filled blocks in the prefix cache and emit `stored` events.

        A hash already owned by another block stays with that block (the duplicate is simply
        not cached), so the map and the published residency never disagree; each event holds
        one unbroken run of the chain and names the hash before it as `parent`.
        """
        run: list[int] = []
        run_parent, prev = parent, parent
        for block, h, toks in zip(blocks, hashes, tokens):
            if block.hash is None and h not in self._by_hash:
                block.hash, block.token_ids = h, toks
                self._by_hash[h] = block.block_id
                if not run:
                    run_parent = prev
                run.append(h)
            elif run:
                self.events.append(STORED, tuple(run), run_parent)
                run = []
            prev = h
        if run:
            self.events.append(STORED, tuple(run), run_parent)

    def resident_hashes(self) -> list[int]:
        return list(self._by_hash)

    def host_hashes(self) -> list[int]:
        return [] if self.host is None else self.host.hashes()

    def disk_hashes(self) -> list[int]:
        return [] if self.disk is None else self.disk.hashes()

    def tier_hashes(self) -> dict[str, list[int]]:
        """The hashes of the tiers below the device, by medium (a snapshot's `tiers`)."""
        tiers = {} if self.host is None else {HOST: self.host.hashes()}
        if self.disk is not None:
            tiers[DISK] = self.disk.hashes()
        return tiers

    def clear_cache(self) -> int:
        """Forget every cached-but-free block and the slower tiers (e.g. after a weight reload);
        returns how many device blocks."""
        if self.host is not None:
            self.host.clear()
        if self.disk is not None:
            self._to_disk = []
            self._disk_jobs += [DiskDelete(e) for e in self.disk.clear()]
        for load in self._flying.values():  # copies of K/V from before: they never enter the cache
            load.hashes, load.tokens = [], []
        evicted = []
        while self._free_cached:
            bid, _ = self._free_cached.popitem(last=False)
            evicted.append(self._evict(self.blocks[bid]))
            self._free_plain[bid] = None
        if not self._by_hash:
            self.events.append(CLEARED)
        elif evicted:
            self.events.append(REMOVED, tuple(evicted))
        return len(evicted)
