"""The residency index: which worker holds which KV block, mirrored from the workers' KV events.

Two maps kept in step: hash -> bitmask of workers holding it in any tier (for matching a
prompt) and worker -> hashes (for dropping or resyncing one worker), the latter per tier:
device, and the slower `host` and `disk` tiers (events' `medium`), with a hash -> bitmask map
per slower tier, so a match can say how much of each worker's prefix lies there. Each worker owns one bit while it is indexed, so
narrowing "who still matches" along a prompt is one integer AND per block. Each worker's
events are applied strictly in `seq` order; anything else (a gap, a restart that reset its
numbering) tells the caller to resync that worker from a snapshot. Everything runs on the
gateway's event loop, so no locks.
"""

from collections.abc import Iterable, Mapping

from workers.kv.events import CLEARED, DEVICE, DISK, HOST, REMOVED, STORED, EventBatch, KVEvent

SLOW = (HOST, DISK)

RESYNC = "resync"


class ResidencyIndex:
    def __init__(self) -> None:
        self._where: dict[int, int] = {}
        self._held: dict[str, set[int]] = {}  # device
        self._slow_held: dict[str, dict[str, set[int]]] = {}  # worker -> medium -> hashes
        self._slow_where: dict[str, dict[int, int]] = {m: {} for m in SLOW}
        self._seq: dict[str, int] = {}
        self._bit: dict[str, int] = {}
        self._ids: list[str] = []  # worker id by bit; "" for a free bit
        self._epoch: dict[str, int] = {}  # how often a worker's residency was replaced or dropped

    def epoch(self, worker_id: str) -> int:
        """How often `worker_id`'s residency was replaced (a cleared cache, a resync after a gap
        or a restart) or dropped: what a router remembers of a worker is stale once it moves."""
        return self._epoch.get(worker_id, 0)

    def seq(self, worker_id: str) -> int | None:
        """The last event applied for `worker_id`; None when it has never been synced."""
        return self._seq.get(worker_id)

    def workers(self) -> list[str]:
        return list(self._seq)

    def num_blocks(self, worker_id: str | None = None, medium: str = DEVICE) -> int:
        """One worker's blocks in one tier, or distinct hashes in any tier over the fleet."""
        if worker_id is None:
            return len(self._where)
        if medium != DEVICE:
            return len(self._slow_held.get(worker_id, {}).get(medium, ()))
        return len(self._held.get(worker_id, ()))

    def holds(self, worker_id: str, h: int) -> bool:
        return h in self._held.get(worker_id, ())

    def reset(
        self, worker_id: str, hashes: Iterable[int], seq: int, tiers: Mapping[str, Iterable[int]] | None = None
    ) -> None:
        """Replace a worker's residency by a snapshot current to `seq` (`tiers`: the slower
        tiers' hashes by medium)."""
        self.drop(worker_id)
        held = set(hashes)
        self._held[worker_id] = held
        self._slow_held[worker_id] = {}
        self._seq[worker_id] = seq
        bit = self._claim_bit(worker_id)
        self._add(bit, held)
        for medium, tier in (tiers or {}).items():
            if medium in SLOW:
                self._store_slow(worker_id, bit, medium, list(tier))

    def drop(self, worker_id: str) -> None:
        """Forget a worker entirely (it left the fleet or must be resynced)."""
        self._epoch[worker_id] = self._epoch.get(worker_id, 0) + 1
        held = self._held.pop(worker_id, None)
        slow = self._slow_held.pop(worker_id, {})
        self._seq.pop(worker_id, None)
        bit = self._bit.pop(worker_id, None)
        if bit is not None:
            self._remove(bit, set().union(held or (), *slow.values()))
            for medium, tier in slow.items():
                self._remove(bit, tier, self._slow_where[medium])
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
        held, bit = self._held[wid], self._bit[wid]
        if ev.kind == CLEARED:
            self.reset(wid, (), ev.seq)
        elif ev.medium in SLOW:
            if ev.kind == STORED:
                self._store_slow(wid, bit, ev.medium, ev.hashes)
            elif ev.kind == REMOVED:
                tier = self._slow_held[wid].get(ev.medium, set())
                gone = [h for h in ev.hashes if h in tier]
                tier.difference_update(gone)
                self._remove(bit, gone, self._slow_where[ev.medium])
                self._remove(bit, [h for h in gone if not self._elsewhere(wid, h)])
        elif ev.medium == DEVICE:
            if ev.kind == STORED:
                fresh = [h for h in ev.hashes if h not in held]
                held.update(fresh)
                self._add(bit, fresh)
            elif ev.kind == REMOVED:
                gone = [h for h in ev.hashes if h in held]
                held.difference_update(gone)
                self._remove(bit, [h for h in gone if not self._elsewhere(wid, h)] if self._slow_held[wid] else gone)

    def _store_slow(self, wid: str, bit: int, medium: str, hashes: Iterable[int]) -> None:
        tier = self._slow_held[wid].setdefault(medium, set())
        fresh = [h for h in hashes if h not in tier]
        tier.update(fresh)
        self._add(bit, fresh, self._slow_where[medium])
        self._add(bit, fresh)

    def _elsewhere(self, wid: str, h: int) -> bool:
        """Whether worker `wid` still holds `h` in some tier."""
        return h in self._held[wid] or any(h in tier for tier in self._slow_held[wid].values())

    def _add(self, bit: int, hashes: Iterable[int], where: dict[int, int] | None = None) -> None:
        where, mask = self._where if where is None else where, 1 << bit
        for h in hashes:
            where[h] = where.get(h, 0) | mask

    def _remove(self, bit: int, hashes: Iterable[int], where: dict[int, int] | None = None) -> None:
        where, keep = self._where if where is None else where, ~(1 << bit)
        for h in hashes:
            m = where.get(h, 0) & keep
            if m:
                where[h] = m
            else:
                where.pop(h, None)

    def match(self, hashes: list[int] | tuple[int, ...]) -> dict[str, int]:
        """Per worker, how many leading blocks of `hashes` it holds in any tier (workers with 0
        omitted; `slow_blocks` says how many of them are not on its device).

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

    def slow_blocks(self, hashes: list[int] | tuple[int, ...], matches: dict[str, int]) -> dict[str, tuple[int, int]]:
        """Per worker of `matches` (from `match`), how many blocks of its matched prefix lie in
        its host and disk tiers and not on its device: (host, disk), workers with none omitted.
        Costs nothing while no worker reports a slower tier."""
        host_where, disk_where = self._slow_where[HOST], self._slow_where[DISK]
        if not (host_where or disk_where) or not matches:
            return {}
        counts: dict[str, list[int]] = {}
        ids = self._ids
        for i in range(max(matches.values())):
            h = hashes[i]
            mask = host_where.get(h, 0) | disk_where.get(h, 0)
            while mask:
                low = mask & -mask
                mask ^= low
                wid = ids[low.bit_length() - 1]
                if matches.get(wid, 0) > i and h not in self._held[wid]:
                    c = counts.setdefault(wid, [0, 0])
                    c[0 if host_where.get(h, 0) & low else 1] += 1
        return {wid: (c[0], c[1]) for wid, c in counts.items()}
