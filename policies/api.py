"""The routing plugin API: a policy is a pure function of (request view, fleet view) -> route.

Policies do no I/O. The gateway builds the views from its residency index, its worker
registry and shared in-flight counts, calls `Policy.route`, and acts on the `Route`.
"""

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from workers.kv.cost_model import CostModel

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


@dataclass(frozen=True)
class TierCredits:
    """What a matched block saves, in device blocks, by the tier it lies in: a host or disk block
    is copied back before the prefill that uses it, so it saves that prefill less the copy.
    `host`: 1 - copy-back time / prefill time (`for_rates`); `disk`: Dynamo's credit for its
    disk tier (kvgate has no disk tier yet)."""

    host: float = 0.75
    disk: float = 0.25

    @staticmethod
    def for_rates(
        copy_gbps: float, kv_bytes_per_token: int, prefill_token_ms: float, disk: float = 0.25
    ) -> "TierCredits":
        """The host credit of a worker that copies back at `copy_gbps` (GB/s) and prefills at
        `prefill_token_ms` per token: a block's copy and its prefill both scale with its tokens."""
        copy_token_ms = kv_bytes_per_token / (copy_gbps * 1e6)
        return TierCredits(
            round(max(0.0, 1.0 - copy_token_ms / prefill_token_ms), 3) if prefill_token_ms > 0 else 0.0, disk
        )


# Llama-3-8B on one H200: prefill 0.0104 ms/token (bench/profiles/h200-llama8b-kvgate-eager.json), 128 KiB
# of KV per token copied back at 50 GB/s (pinned PCIe Gen5; bench/host_copy.py --device cuda measures
# it): host credit 0.75. On this CPU host with SmolLM2, bench/results/host_copy_cpu_smollm2.json: 0.99.
DEFAULT_TIER_CREDITS = TierCredits.for_rates(50.0, 131072, 0.0104)


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
    url: str = ""

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


@runtime_checkable
class Policy(Protocol):
    name: str

    def route(self, req: RequestView, fleet: FleetView) -> Route:
        """Choose where `req` runs. Must not block or do I/O."""
        ...
