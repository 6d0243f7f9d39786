"""How large a request is among the ones routed lately, by what it takes from a KV pool."""

import bisect
from collections import deque


class Footprints:
    """The pool footprints (tokens) of the last `window` requests, to tell the largest apart.

    A full pool frees room at the pace its running requests end, so one large request admitted
    holds the room of several small ones for its whole life: refusing the largest first keeps
    the most requests within their SLOs when some must be refused."""

    def __init__(self, window: int = 200, warmup: int = 50) -> None:
        self.window, self.warmup = window, warmup
        self.recent: deque[int] = deque()
        self.ordered: list[int] = []

    def share_below(self, tokens: int) -> float:
        """The share of the recent footprints smaller than `tokens` (0 until `warmup` are seen)."""
        if len(self.ordered) < self.warmup:
            return 0.0
        return bisect.bisect_left(self.ordered, tokens) / len(self.ordered)

    def add(self, tokens: int) -> None:
        bisect.insort(self.ordered, tokens)
        self.recent.append(tokens)
        if len(self.recent) > self.window:
            old = self.recent.popleft()
            del self.ordered[bisect.bisect_left(self.ordered, old)]
