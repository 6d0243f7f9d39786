"""The disk tier of the KV cache: blocks of the host tier, kept by hash in files, LRU, bounded.

The tier is written through from the host tier: a block stored in a host slot is also queued
for a file (a `DiskWrite`), and its host slot stays pinned until the write is done, so the host
copy is freed only once the disk holds it (or the write failed and the entry was dropped). When
host LRU drops the block later, nothing is left to write and the slot is reused at once; a
write at drop time would have to wait for the disk on the engine thread.

The pool only decides residency; files are written, read and deleted by whoever runs the jobs
(`DiskJob`, from `BlockPool.take_disk_jobs`): the worker's I/O thread (workers/kv/disk_io.py),
or the simulator in virtual time. Jobs run one after another in the order they were made, so
a read never comes before its file's write, and a file is deleted only after every read of it
queued before. Each stored entry gets a file of its own (`name`: hash and a per-run sequence
number): a hash stored again after a drop or a clear never reads the older file. Every change
goes to the event log with medium `disk`.
"""

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from workers.kv.events import DISK, REMOVED, STORED, EventLog

if TYPE_CHECKING:
    from workers.kv.block_pool import Load


@dataclass(slots=True)
class DiskEntry:
    hash: int
    token_ids: tuple[int, ...]
    name: str  # the file holding its K/V, unique within the run


@dataclass(eq=False)
class DiskWrite:
    """Write host slot `slot`'s K/V (and the entry's hash and tokens) to the entry's file."""

    entry: DiskEntry
    slot: int
    ok: bool = False


@dataclass(eq=False)
class DiskRead:
    """Read the entry's file into device block `block_id`, block `index` of `load`; `ok` only
    when the file holds the entry's hash and tokens."""

    entry: DiskEntry
    block_id: int
    load: "Load"
    index: int
    ok: bool = False


@dataclass(eq=False)
class DiskDelete:
    entry: DiskEntry
    ok: bool = False


DiskJob = DiskWrite | DiskRead | DiskDelete


class DiskPool:
    """Disk entries indexed by block hash, LRU-ordered (oldest first), at most `num_blocks`."""

    def __init__(self, num_blocks: int, events: EventLog):
        self.num_blocks = num_blocks
        self.events = events
        self._entries: OrderedDict[int, DiskEntry] = OrderedDict()
        self._made = 0  # entries made so far: the sequence number in each file name

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, h: int) -> bool:
        return h in self._entries

    @property
    def num_free(self) -> int:
        return self.num_blocks - len(self._entries)

    def hashes(self) -> list[int]:
        return list(self._entries)

    def lookup(self, h: int, token_ids: tuple[int, ...]) -> DiskEntry | None:
        """The entry for hash `h` whose tokens really are `token_ids` (a 64-bit collision is a miss)."""
        entry = self._entries.get(h)
        return entry if entry is not None and entry.token_ids == token_ids else None

    def touch(self, entry: DiskEntry) -> None:
        self._entries.move_to_end(entry.hash)

    def store(self, blocks: list[tuple[int, tuple[int, ...]]]) -> tuple[list[DiskEntry | None], list[DiskEntry]]:
        """Take (hash, token ids) of blocks to write: per block its new entry, or None where none
        is written (the tier holds the hash already: it is made the newest instead; or a later
        block of the same call pushed it out again); and the older entries dropped, oldest first,
        to make room (their files to delete). One `removed` and one `stored` event per call."""
        if not self.num_blocks:
            return [None] * len(blocks), []
        entries = self._entries
        made: list[DiskEntry | None] = []
        dropped: list[DiskEntry] = []
        for h, tokens in blocks:
            if h in entries:
                entries.move_to_end(h)
                made.append(None)
                continue
            if len(entries) >= self.num_blocks:
                dropped.append(entries.popitem(last=False)[1])
            self._made += 1
            entry = entries[h] = DiskEntry(h, tokens, f"{h & (2**64 - 1):016x}-{self._made}.kv")
            made.append(entry)
        fresh = {id(e) for e in made if e is not None}
        made = [e if e is not None and entries.get(e.hash) is e else None for e in made]
        dropped = [e for e in dropped if id(e) not in fresh]
        if dropped:
            self.events.append(REMOVED, tuple(e.hash for e in dropped), medium=DISK)
        stored = tuple(e.hash for e in made if e is not None)
        if stored:
            self.events.append(STORED, stored, medium=DISK)
        return made, dropped

    def discard(self, entry: DiskEntry) -> bool:
        """Drop `entry` if it is still the tier's entry for its hash (its write failed)."""
        if self._entries.get(entry.hash) is not entry:
            return False
        del self._entries[entry.hash]
        self.events.append(REMOVED, (entry.hash,), medium=DISK)
        return True

    def clear(self) -> list[DiskEntry]:
        """Forget every entry (the K/V no longer matches the weights); returns them."""
        dropped = list(self._entries.values())
        if dropped:
            self.events.append(REMOVED, tuple(self._entries), medium=DISK)
            self._entries.clear()
        return dropped
