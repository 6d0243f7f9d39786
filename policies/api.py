"""The routing plugin API: a policy is a pure function of (request view, fleet view) -> route.

Policies do no I/O. The gateway builds the views from its residency index, its worker
registry and shared in-flight counts, calls `Policy.route`, and acts on the `Route`.
"""

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from policies.ledger import Ledger, checked_count
from workers.kv.cost_model import CostModel
from workers.kv.read_back import DISK_GBPS, HOST_GBPS

MIXED, PREFILL, DECODE = "mixed", "prefill", "decode"


@dataclass(frozen=True)
class RequestView:
    """What a policy may know of a request."""

    request_id: str
    num_tokens: int
    block_hashes: tuple[int, ...]
    max_tokens: int = 256
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    session_id: str | None = None
    priority: int = 0
    model: str = ""
    choices: int = 1  # sequences asked for (prompts x n): a P/D handoff carries one, so only such are split


@dataclass(frozen=True)
class TierCredits:
    """What a matched block saves, in device blocks of prefill, by the tier it lies in, and how
    fast a block of each slower tier comes back. A host block is copied back, and a disk block
    read back, beside the worker's steps (workers/scheduler.py: the request waits for it, nothing
    else does), so it saves its whole prefill (`host`, `disk` 1.0) and delays only its own
    request, by its bytes (the worker's `kv_bytes_per_token`) at `host_gbps` or `disk_gbps`
    where the copy outlasts that request's wait in the queue (`predict.ttft_tpot_ms`). A lower
    credit makes routing prefer faster tiers' hits whatever the load. The credits are the
    gateway's; the rates and `load_every_hit` are each worker's own, as its /state publishes
    them (`gateway.worker_view.tier_rates`), the gateway's flags standing in where it does not."""

    host: float = 1.0
    disk: float = 1.0
    host_gbps: float = HOST_GBPS  # the measurements behind both: workers/kv/read_back.py
    disk_gbps: float = DISK_GBPS
    load_every_hit: bool = False  # the worker copies back every slow-tier hit, never recomputes


DEFAULT_TIER_CREDITS = TierCredits()


@dataclass(frozen=True)
class WorkerView:
    """One candidate worker as the gateway sees it at decision time.

    `step_ms` is the worker's mean recent step time and the `step_*` fields the mean work of
    those same steps (in `CostModel.step_ms` terms): a time means little without the work it
    took, and a worker's current queue need not look like its recent steps. `decode_step_*`
    are the same for the recent steps that only decoded.
    """

    worker_id: str
    role: str = MIXED
    matched_blocks: int = 0  # the request's leading blocks it holds, in any tier
    matched_host_blocks: int = 0  # of those, the ones only in its host tier
    matched_disk_blocks: int = 0  # and only in its disk tier
    tier_credits: TierCredits = DEFAULT_TIER_CREDITS
    block_size: int = 16
    waiting: int = 0
    running: int = 0
    in_flight: int = 0
    free_blocks: int = 0
    shared_blocks: int = 0  # of the blocks in use, those two or more requests read (a prefix they share)
    resident_blocks: int = 0  # blocks holding cached K/V, in use or free (the gateway's residency index)
    residency_epoch: int = 0  # moves when the index replaces or drops its residency (cleared, resynced)
    total_blocks: int = 0
    queued_prefill_tokens: int = 0
    kv_tokens: int = 0
    max_batched_tokens: int = 2048
    max_num_seqs: int = 256
    step_ms: float | None = None
    step_prefill_tokens: float = 0.0
    step_prefill_ctx_products: float = 0.0
    step_decode_seqs: float = 0.0
    step_decode_kv_tokens: float = 0.0
    decode_step_ms: float | None = None
    decode_step_seqs: float = 0.0
    decode_step_kv_tokens: float = 0.0
    cost: CostModel | None = None
    transfer_gbps: float = 1.0
    kv_bytes_per_token: int = 0
    export_batch_blocks: int = 0  # as a prefill worker: its export batch (workers/export_batch.py)
    export_backlog_bytes: int = 0  # exports handed to its link and not sent yet
    url: str = ""
    # what this router has in flight there, live (not a snapshot): `policies.ledger`
    ledger: Ledger | None = field(default=None, compare=False)

    @property
    def load(self) -> int:
        """Requests this worker is busy with: the max of its own count and the gateways' count."""
        return max(self.waiting + self.running, self.in_flight)


@dataclass(frozen=True)
class FleetView:
    workers: tuple[WorkerView, ...]
    now: float = 0.0

    def by_role(self, *roles: str) -> tuple[WorkerView, ...]:
        return tuple(w for w in self.workers if w.role in roles)


@dataclass(frozen=True)
class Tally:
    """What one routing decision adds to its policy's windows over recent traffic: whether it
    refused, the pool tokens the request takes at least (0: not sized), and the prefix it counted
    as demand (its best holder's last block hash; None: none). Gateway replicas send theirs to
    each other (`Tallied`), so each one's windows count the fleet's traffic, not its own share."""

    refused: bool
    footprint: int = 0
    prefix: int | None = None

    def to_json(self) -> dict:
        return {"refused": self.refused, "footprint": self.footprint, "prefix": self.prefix}

    @classmethod
    def from_json(cls, d: object) -> "Tally":
        """The tally `to_json` wrote; ValueError for anything else (it comes from another
        replica, through Redis)."""
        if not isinstance(d, dict) or not isinstance(d.get("refused"), bool):
            raise ValueError("a tally is an object whose 'refused' is true or false")
        prefix = d.get("prefix")
        footprint = checked_count(d.get("footprint"), "a tally's footprint")
        return cls(d["refused"], footprint, None if prefix is None else checked_count(prefix, "a tally's prefix"))


@dataclass(frozen=True)
class Route:
    """A decision: one worker, a (prefill, decode) pair, or a rejection with a reason.
    `reason` says in a few words why this worker: the gateway sends it to clients as
    x-kvgate-route-reason, so an operator can read a routing decision without a debugger."""

    worker: str | None = None
    prefill: str | None = None
    reject: str | None = None
    predicted_cached_tokens: int = 0
    predicted_ttft_ms: float | None = None
    predicted_tpot_ms: float | None = None
    info: dict = field(default_factory=dict)
    reason: str = field(default="", compare=False)  # an explanation, not part of the decision
    tally: Tally | None = field(default=None, compare=False)  # for the other replicas (`Tallied`)


@runtime_checkable
class Policy(Protocol):
    name: str

    def route(self, req: RequestView, fleet: FleetView) -> Route:
        """Choose where `req` runs. Must not block or do I/O."""
        ...


@runtime_checkable
class Observer(Protocol):
    """A policy that also hears where other gateway replicas sent prompts (through Redis), so
    what it remembers of its own sends (`policies.routed`) covers theirs: without it a new
    prefix's second request, at the other replica, found no holder and made a second copy."""

    def observe(self, req: RequestView, w: WorkerView, now: float) -> None:
        """Another replica sent `req`'s prompt to `w` at `now`. Must not block or do I/O."""
        ...


@runtime_checkable
class Tallied(Protocol):
    """A policy whose decisions feed windows over recent traffic (its refusals, the requests'
    sizes, each prefix's demand) and say what they added (`Route.tally`). Behind several
    gateway replicas each window would count only its replica's share: with two, a hot
    prefix's demand looked half what it was, and a replica sent only small requests ranked
    them as the largest. So each decision's tally goes to the others (through Redis)."""

    def add_tally(self, tally: Tally, now: float) -> None:
        """Count another replica's decision, heard at `now`. Must not block or do I/O."""
        ...
