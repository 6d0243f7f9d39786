"""Replaying a worker's KV events per tier, for tier tests."""

from workers.kv.events import CLEARED, REMOVED, STORED


def replay(events, medium: str) -> set[int]:
    """The hashes that `events` leave resident in tier `medium` (a clear empties every tier)."""
    held: set[int] = set()
    for e in events:
        if e.medium != medium and e.kind != CLEARED:
            continue
        if e.kind == STORED:
            held |= set(e.hashes)
        elif e.kind == REMOVED:
            held -= set(e.hashes)
        else:
            held.clear()
    return held
