"""How much of its recent traffic a router has refused: how far past capacity the fleet is."""

from policies.window import TimedCounts


class RecentRefusals:
    """The share of the requests routed in the last `window_s` seconds that were refused.

    A prediction from a polled view errs by how over-committed the pools are, which the view
    does not show: at capacity (a few refusals) the pool wait was 2x pessimistic, at 5x
    capacity (most refused) as short of the truth. The router's own refusals tell the two
    apart, whatever the rate."""

    def __init__(self, window_s: float = 5.0) -> None:
        self.decisions: TimedCounts[bool] = TimedCounts(window_s)

    def share(self, now: float) -> float:
        """Refused / routed within the window ending at `now` (0 with nothing routed)."""
        self.decisions.expire(now)
        return self.decisions.count[True] / len(self.decisions) if self.decisions else 0.0

    def record(self, now: float, refused: bool) -> None:
        """Count a decision at `now` (this router's or another replica's, `TimedCounts.add`)."""
        self.decisions.add(refused, now)
