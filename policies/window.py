"""Counts of what a router saw over the last few seconds, kept in time order."""

from collections import Counter, deque
from typing import Generic, TypeVar

K = TypeVar("K")


class TimedCounts(Generic[K]):
    """How many times each key was added in the last `window_s` seconds.

    Another gateway replica's additions arrive a little late, so one is counted at the latest
    time already seen when its own is earlier: the window stays in time order, expiring from
    its front. Expiry runs before each addition, so a router that only hears the others holds
    no more than its window of them."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.seen: deque[tuple[float, K]] = deque()
        self.count: Counter[K] = Counter()

    def __len__(self) -> int:
        return len(self.seen)

    def add(self, key: K, now: float) -> None:
        """Count `key` at `now`, or at the last time counted if that is later."""
        self.expire(now)
        self.seen.append((max(now, self.seen[-1][0]) if self.seen else now, key))
        self.count[key] += 1

    def expire(self, now: float) -> None:
        """Forget what was added before `now - window_s`."""
        while self.seen and self.seen[0][0] < now - self.window_s:
            _, key = self.seen.popleft()
            self.count[key] -= 1
            if not self.count[key]:
                del self.count[key]
