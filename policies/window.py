"""What a router saw over the last few seconds, kept in time order."""

from collections import Counter, deque
from typing import Generic, TypeVar

K = TypeVar("K")
T = TypeVar("T")


class TimedWindow(Generic[T]):
    """Items added over the last `window_s` seconds, oldest first.

    Another gateway replica's additions arrive a little late, or from a clock behind this
    one's, so one is stamped at the latest time already seen when its own is earlier: the
    window stays in time order, expiring from its front."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.items: deque[tuple[float, T]] = deque()

    def __len__(self) -> int:
        return len(self.items)

    def add(self, item: T, now: float) -> float:
        """Add `item` at `now`, or at the last time added if that is later; that time."""
        at = max(now, self.items[-1][0]) if self.items else now
        self.items.append((at, item))
        return at

    def expire(self, now: float) -> list[T]:
        """Take out and return what was added before `now - window_s`, oldest first."""
        gone = []
        while self.items and self.items[0][0] < now - self.window_s:
            gone.append(self.items.popleft()[1])
        return gone


class TimedCounts(Generic[K]):
    """How many times each key was added in the last `window_s` seconds (a `TimedWindow` of
    them). Expiry runs before each addition, so a router that only hears the others holds no
    more than its window of them."""

    def __init__(self, window_s: float) -> None:
        self.window: TimedWindow[K] = TimedWindow(window_s)
        self.count: Counter[K] = Counter()

    def __len__(self) -> int:
        return len(self.window)

    @property
    def window_s(self) -> float:
        return self.window.window_s

    def add(self, key: K, now: float) -> None:
        """Count `key` at `now` (`TimedWindow.add`)."""
        self.expire(now)
        self.window.add(key, now)
        self.count[key] += 1

    def expire(self, now: float) -> None:
        """Forget what was added before `now - window_s`."""
        for key in self.window.expire(now):
            self.count[key] -= 1
            if not self.count[key]:
                del self.count[key]
