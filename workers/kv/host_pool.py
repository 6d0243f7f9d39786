"""The host tier of the KV cache: blocks evicted from device memory, kept by hash in host slots.

An entry is a block's hash, its token ids and the host slot holding its K/V. LRU within the
tier: a stored or reloaded entry becomes the newest; storing into a full tier drops the oldest,
whose slot is then overwritten, so a dropped hash is never found again. The tier keeps a copy
of a block it has reloaded (an inclusive cache): evicting that block again costs no copy.

The pool only decides residency; bytes move through the executor, in batches the engine hands
it before the step that needs them (`CopyBatch`, from `BlockPool.take_copies`). A copy back runs
while later steps do (workers/kv/block_pool.py: `Load`), so the slots it reads are pinned until
it is done: LRU drops the oldest unpinned entry, and a pinned slot whose entry is dropped (a
clear) is reused only once unpinned. Every change goes to the event log with medium `host`.
"""

from collections import OrderedDict
from dataclasses import dataclass, field

from workers.kv.events import HOST, REMOVED, STORED, EventLog

SWAP_OUT, SWAP_IN = "out", "in"  # device block -> host slot; host slot -> device block


@dataclass(slots=True)
class HostEntry:
    hash: int
    token_ids: tuple[int, ...]
    slot: int


@dataclass
class CopyBatch:
    """Copies of one direction, in order: block_ids[i] <-> slots[i]."""

    direction: str
    block_ids: list[int]
    slots: list[int]


class HostPool:
    """Host slots indexed by block hash, LRU-ordered (oldest first)."""

    def __init__(self, num_slots: int, events: EventLog):
        self.num_slots = num_slots
        self.events = events
        self._entries: OrderedDict[int, HostEntry] = OrderedDict()
        self._free_slots = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self._pins: dict[int, int] = {}  # slot -> copies back reading it now
        self._draining: set[int] = set()  # pinned slots whose entry was dropped: free once unpinned

    @property
    def num_free(self) -> int:
        return len(self._free_slots)

    @property
    def num_draining(self) -> int:
        """Slots neither free nor holding an entry: dropped while a copy back read them."""
        return len(self._draining)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, h: int) -> bool:
        return h in self._entries

    def hashes(self) -> list[int]:
        return list(self._entries)

    def lookup(self, h: int, token_ids: tuple[int, ...]) -> HostEntry | None:
        """The entry for hash `h` whose tokens really are `token_ids` (a 64-bit collision is a miss)."""
        entry = self._entries.get(h)
        return entry if entry is not None and entry.token_ids == token_ids else None

    def touch(self, entry: HostEntry) -> None:
        """Make an entry the newest (it was just used)."""
        self._entries.move_to_end(entry.hash)

    def pin(self, slots: list[int]) -> None:
        """Keep slots from reuse while a copy back reads them (until `unpin`)."""
        for slot in slots:
            self._pins[slot] = self._pins.get(slot, 0) + 1

    def unpin(self, slots: list[int]) -> None:
        for slot in slots:
            n = self._pins.pop(slot) - 1
            if n:
                self._pins[slot] = n
            elif slot in self._draining:
                self._draining.remove(slot)
                self._free_slots.append(slot)

    def _drop_oldest(self) -> HostEntry | None:
        """Drop the least recently used entry whose slot is not pinned; None if every one is."""
        h = next((h for h, e in self._entries.items() if e.slot not in self._pins), None)
        return None if h is None else self._entries.pop(h)

    def store(self, blocks: list[tuple[int, tuple[int, ...]]]) -> list[int | None]:
        """Take (hash, token ids) of blocks leaving device memory; per block, the slot to copy
        its K/V into, or None when none is copied: the tier holds it already (it is made the
        newest instead), or every slot is being read by a copy back (it is dropped). Drops the
        oldest unpinned entries to make room; one `removed` and one `stored` event per call."""
        if not self.num_slots:
            return [None] * len(blocks)
        entries = self._entries
        slots: list[int | None] = []
        stored: list[int] = []
        removed: list[int] = []
        for h, tokens in blocks:
            if h in entries:
                entries.move_to_end(h)
                slots.append(None)
                continue
            if not self._free_slots:
                old = self._drop_oldest()
                if old is None:
                    slots.append(None)
                    continue
                self._free_slots.append(old.slot)
                if old.hash in stored:  # stored and dropped within this call: never announced
                    stored.remove(old.hash)
                else:
                    removed.append(old.hash)
            slot = self._free_slots.pop()
            entries[h] = HostEntry(h, tokens, slot)
            stored.append(h)
            slots.append(slot)
        if removed:
            self.events.append(REMOVED, tuple(removed), medium=HOST)
        if stored:
            self.events.append(STORED, tuple(stored), medium=HOST)
        return slots

    def clear(self) -> int:
        """Forget every entry (the K/V no longer matches the weights); returns how many."""
        n = len(self._entries)
        if n:
            self.events.append(REMOVED, tuple(self._entries), medium=HOST)
            for e in self._entries.values():
                (self._draining.add if e.slot in self._pins else self._free_slots.append)(e.slot)
            self._entries.clear()
        return n


def batches(copies: list[tuple[str, int, int]]) -> list[CopyBatch]:
    """Queued (direction, block id, slot) copies as batches of one direction each, order kept:
    a store into a slot must land before a later load from it, and the reverse."""
    out: list[CopyBatch] = []
    for direction, block_id, slot in copies:
        if not out or out[-1].direction != direction:
            out.append(CopyBatch(direction, [], []))
        out[-1].block_ids.append(block_id)
        out[-1].slots.append(slot)
    return out


@dataclass
class CopyRun:
    """Copies handed to an executor: blocks copied out and back, and the executor's handles of
    the copies back still running (`executor.copy_done` says when each is)."""

    out: int = 0
    back: int = 0
    handles: list = field(default_factory=list)


def run_copies(batches_: list[CopyBatch], executor) -> CopyRun:
    """Hand queued copies to an executor's swap_out/swap_in, in order: evicted blocks out before
    anything overwrites them (the step stream's order), copies back issued after every copy out
    before them; a copy back may still run when this returns (its handle says when it is done)."""
    run = CopyRun()
    for batch in batches_:
        if batch.direction == SWAP_OUT:
            executor.swap_out(batch.block_ids, batch.slots)
            run.out += len(batch.block_ids)
        else:
            handle = executor.swap_in(batch.block_ids, batch.slots)
            run.back += len(batch.block_ids)
            if handle is not None:
                run.handles.append(handle)
    return run
