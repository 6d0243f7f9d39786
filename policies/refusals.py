"""How much of its recent traffic a router has refused: how far past capacity the fleet is."""

from collections import deque


class RecentRefusals:
    """The share of the requests routed in the last `window_s` seconds that were refused.

    A prediction from a polled view errs by how over-committed the pools are, which the view
    does not show: at capacity (a few refusals) the pool wait was 2x pessimistic, at 5x
    capacity (most refused) as short of the truth. The router's own refusals tell the two
    apart, whatever the rate."""

    def __init__(self, window_s: float = 5.0) -> None:
        self.window_s = window_s
        self.seen: deque[tuple[float, bool]] = deque()
        self.refused = 0

    def share(self, now: float) -> float:
        """Refused / routed within the window ending at `now` (0 with nothing routed)."""
        self.expire(now)
        return self.refused / len(self.seen) if self.seen else 0.0

    def record(self, now: float, refused: bool) -> None:
        """Count a decision at `now` (no earlier than the last: another replica's arrive late).
        What left the window goes first: a replica that only hears the others' decisions
        holds no more than its window of them."""
        self.expire(now)
        self.seen.append((max(now, self.seen[-1][0]) if self.seen else now, refused))
        self.refused += refused

    def expire(self, now: float) -> None:
        while self.seen and self.seen[0][0] < now - self.window_s:
            self.refused -= self.seen.popleft()[1]
