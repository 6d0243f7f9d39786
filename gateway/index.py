"""The residency index: which worker holds which KV block, mirrored from the workers' KV events.

Two maps kept in step: hash -> bitmask of workers (for matching a prompt) and worker -> hashes
(for dropping or resyncing one worker). Each worker owns one bit while it is indexed, so
narrowing "who still matches" along a prompt is one integer AND per block. Each worker's
events are applied strictly in `seq` order; anything else (a gap, a restart that reset its
numbering) tells the caller to resync that worker from a snapshot. Everything runs on the
gateway's event loop, so no locks.
"""
from collections.abc import Iterable

from workers.kv.events import CLEARED, DEVICE, REMOVED, STORED, EventBatch, KVEvent

RESYNC = "resync"


class ResidencyIndex:
    def __init__(self) -> None:
        self._where: dict[int, int] = {}
        self._held: dict[str, set[int]] = {}
        self._seq: dict[str, int] = {}
        self._bit: dict[str, int] = {}
        self._ids: list[str] = []  # worker id by bit; "" for a free bit

    def seq(self, worker_id: str) -> int | None:
        """The last event applied for `worker_id`; None when it has never been synced."""
        return self._seq.get(worker_id)

    def workers(self) -> list[str]:
        return list(self._seq)

    def num_blocks(self, worker_id: str | None = None) -> int:
        """Resident blocks of one worker, or distinct hashes over the fleet."""
        if worker_id is None:
            return len(self._where)
        return len(self._held.get(worker_id, ()))

    def holds(self, worker_id: str, h: int) -> bool:
        return h in self._held.get(worker_id, ())

    def reset(self, worker_id: str, hashes: Iterable[int], seq: int) -> None:
        """Replace a worker's residency by a snapshot current to `seq`."""
        self.drop(worker_id)
        held = set(hashes)
        self._held[worker_id] = held
        self._seq[worker_id] = seq
        self._add(self._claim_bit(worker_id), held)

    def drop(self, worker_id: str) -> None:
        """Forget a worker entirely (it left the fleet or must be resynced)."""
        held = self._held.pop(worker_id, None)
        self._seq.pop(worker_id, None)
        bit = self._bit.pop(worker_id, None)
        if bit is not None:
            self._remove(bit, held or ())
            self._ids[bit] = ""

    def _claim_bit(self, worker_id: str) -> int:
        bit = next((i for i, w in enumerate(self._ids) if not w), len(self._ids))
        if bit == len(self._ids):
            self._ids.append(worker_id)
        else:
            self._ids[bit] = worker_id
        self._bit[worker_id] = bit
        return bit

    def apply(self, batch: EventBatch) -> str | None:
        """Apply a batch of one worker's events; returns RESYNC when a snapshot is needed.

        Events at or below the applied seq are skipped (the same event may arrive from Redis
        and from the worker). A worker never synced, a `gap` flag, a missing seq, or a worker
        whose numbering went backwards (it restarted) all need a resync.
        """
        wid = batch.worker_id
        seq = self._seq.get(wid)
        if seq is None or batch.gap or batch.last_seq < seq:
            return RESYNC
        for ev in batch.events:
            if ev.seq <= seq:
                continue
            if ev.seq != seq + 1:
                return RESYNC
            self._apply_event(wid, ev)
            seq = self._seq[wid] = ev.seq
        return None

    def _apply_event(self, wid: str, ev: KVEvent) -> None:
        if ev.medium != DEVICE and ev.kind != CLEARED:
            return  # the index holds device residency only
        held, bit = self._held[wid], self._bit[wid]
        if ev.kind == STORED:
            fresh = [h for h in ev.hashes if h not in held]
            held.update(fresh)
            self._add(bit, fresh)
        elif ev.kind == REMOVED:
            gone = [h for h in ev.hashes if h in held]
            held.difference_update(gone)
            self._remove(bit, gone)
        elif ev.kind == CLEARED:
            self._remove(bit, held)
            self._held[wid] = set()

    def _add(self, bit: int, hashes: Iterable[int]) -> None:
        where, mask = self._where, 1 << bit
        for h in hashes:
            where[h] = where.get(h, 0) | mask

    def _remove(self, bit: int, hashes: Iterable[int]) -> None:
        where, keep = self._where, ~(1 << bit)
        for h in hashes:
            m = where.get(h, 0) & keep
            if m:
                where[h] = m
            else:
                where.pop(h, None)

    def match(self, hashes: list[int] | tuple[int, ...]) -> dict[str, int]:
        """Per worker, how many leading blocks of `hashes` it holds (workers with 0 omitted).

        Walks the chain once, narrowing the bitmask of workers still matching: one dict
        lookup and one AND per block, so 512 blocks x 64 workers costs tens of microseconds.
        """
        out: dict[str, int] = {}
        if not hashes:
            return out
        where = self._where
        live = where.get(hashes[0], 0)
        for i in range(1, len(hashes)):
            if not live:
                return out
            m = where.get(hashes[i], 0) & live
            if m != live:
                self._emit(live & ~m, i, out)
                live = m
        self._emit(live, len(hashes), out)
        return out

    def _emit(self, mask: int, n: int, out: dict[str, int]) -> None:
        ids = self._ids
        while mask:
            low = mask & -mask
            out[ids[low.bit_length() - 1]] = n
            mask ^= low
