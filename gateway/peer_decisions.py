"""Another gateway replica's routing decisions, told to this replica's policy: the prompts it
sent (`routed` notes on `kvgate:share`, for a policy that remembers its own sends,
`policies.api.Observer`) and what each decision added to its windows (`tally` notes, for a
policy that keeps them, `policies.api.Tallied`), so every replica's policy sees the fleet's
traffic, not its own share of it. A policy's failure here is logged, never the Redis state's end."""

import logging
import time

from gateway.fleet import Fleet
from gateway.shared_ledger import LedgerNote
from policies.api import Observer, Policy, RequestView, Tallied, Tally

log = logging.getLogger("kvgate.gateway")


class PeerDecisions:
    """The shared ledger's `on_routed` and `on_tally` hooks (gateway/shared_ledger.py)."""

    def __init__(self, fleet: Fleet, policy: Policy):
        self.fleet = fleet
        self.policy = policy

    def observe_routed(self, note: LedgerNote) -> None:
        """Another replica sent a prompt to a worker: the policy, where it remembers its own
        sends, remembers it too, as a decision here would have seen the worker."""
        w = self.fleet.by_id(note.worker_id)
        if not isinstance(self.policy, Observer) or w is None or w.base is None or note.at is None:
            return
        view = RequestView(note.request_id, note.num_tokens, note.prompt)
        (seen,) = self.fleet.views([w], {})  # the worker as a decision here would see it
        try:
            self.policy.observe(view, seen, note.at)
        except Exception:
            log.exception("policy %s failed to observe another replica's routing", self.policy.name)

    def add_tally(self, tally: Tally) -> None:
        """Another replica's decision: into the policy's windows, where it keeps them."""
        if isinstance(self.policy, Tallied):
            try:
                self.policy.add_tally(tally, time.time())
            except Exception:
                log.exception("policy %s failed to count another replica's decision", self.policy.name)
