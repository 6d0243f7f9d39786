"""A worker's view for the policies (`policies.api.WorkerView`) from its /state: the one builder
for the gateway's polls and the fleet simulator's, and the cheap copy with changed fields the
routing hot path makes per worker per request."""

from dataclasses import replace
from functools import lru_cache

from policies.api import DEFAULT_TIER_CREDITS, TierCredits, WorkerView
from workers.kv.cost_model import CostModel
from workers.kv.worker_state import WorkerState

# A worker's transfer rate until it has measured its own: HTTP and IPC as measured between two
# H200s, NIXL as measured over UCX/TCP on a 2-core CPU host (bench/results/transfer_payload.json).
TRANSPORT_GBPS = {"http": 0.4, "ipc": 20.0, "nixl": 3.5}


def tier_rates(state: WorkerState, tiers: TierCredits) -> TierCredits:
    """The tier credits a worker's view carries: the gateway's `tiers`, with the copy-back rates
    and `load_every_hit` the worker publishes in its /state in place of the gateway's flags (a
    worker that publishes none, e.g. vLLM, keeps them): the router predicts each worker's
    read-or-recompute choice on the rates that worker decides with."""
    if state.host_gbps is None and state.disk_gbps is None and not state.load_every_hit:
        return tiers
    return _rated(tiers, state.host_gbps, state.disk_gbps, state.load_every_hit)


@lru_cache(maxsize=256)
def _rated(tiers: TierCredits, host_gbps: float | None, disk_gbps: float | None, every: bool) -> TierCredits:
    """`tiers` with a worker's own rates, made once per distinct set: a view is built for every
    KV-event line and poll, and `replace` was a fifth of it."""
    return replace(
        tiers, host_gbps=host_gbps or tiers.host_gbps, disk_gbps=disk_gbps or tiers.disk_gbps, load_every_hit=every
    )


def worker_view(
    state: WorkerState,
    url: str = "",
    transfer_gbps: float = TRANSPORT_GBPS["http"],
    cost: CostModel | None = None,
    export_backlog_bytes: int = 0,
    tiers: TierCredits = DEFAULT_TIER_CREDITS,
) -> WorkerView:
    """The policies' picture of a worker from its /state: the one builder, for the gateway's
    polls and the fleet simulator's. `cost`, when given, stands for the worker's own profile;
    the transfer fields come from the server's `kv_transfer` (the simulator's link); `tiers`
    are the router's tier credits and fallback rates (`tier_rates`)."""
    return WorkerView(
        worker_id=state.worker_id,
        role=state.role,
        block_size=state.block_size,
        waiting=state.waiting,
        running=state.running,
        free_blocks=state.free_blocks,
        shared_blocks=state.shared_blocks,
        total_blocks=state.total_blocks,
        queued_prefill_tokens=state.queued_prefill_tokens,
        kv_tokens=state.kv_tokens,
        max_batched_tokens=state.max_batched_tokens,
        max_num_seqs=state.max_num_seqs,
        step_ms=state.step_ms,
        step_prefill_tokens=state.step_prefill_tokens,
        step_prefill_ctx_products=state.step_prefill_ctx_products,
        step_decode_seqs=state.step_decode_seqs,
        step_decode_kv_tokens=state.step_decode_kv_tokens,
        decode_step_ms=state.decode_step_ms,
        decode_step_seqs=state.decode_step_seqs,
        decode_step_kv_tokens=state.decode_step_kv_tokens,
        cost=cost or (CostModel.from_json(state.cost_model) if state.cost_model else None),
        kv_bytes_per_token=state.kv_bytes_per_token,
        transfer_gbps=transfer_gbps,
        export_batch_blocks=state.export_batch_blocks,
        export_backlog_bytes=export_backlog_bytes,
        tier_credits=tier_rates(state, tiers),
        url=url,
    )


def view_of_state(
    state: dict, url: str, tiers: TierCredits, cost: CostModel | None = None, parsed: WorkerState | None = None
) -> WorkerView:
    """The view from a polled /state body; `cost`: its cost model already parsed; `parsed`: the
    body's `WorkerState.from_json`, which raises ValueError for a body that is not a state
    (its server's fields included), where the caller has it already."""
    parsed = WorkerState.from_json(state) if parsed is None else parsed
    backlog = (state.get("kv_transfer") or {}).get("backlog_bytes") or 0
    return worker_view(parsed, url, transfer_gbps_of(state), cost, backlog, tiers)


def transfer_gbps_of(state: dict) -> float:
    """The worker's measured export rate, else what its transport typically reaches."""
    kv = state.get("kv_transfer") or {}
    return kv.get("gbps") or TRANSPORT_GBPS.get(kv.get("transport", "http"), TRANSPORT_GBPS["http"])


def with_fields(base: WorkerView, **changes) -> WorkerView:
    """A copy of a frozen view with some fields changed, ~10x cheaper than
    `dataclasses.replace`: it runs once per worker per request on the routing hot path."""
    v = object.__new__(WorkerView)
    object.__setattr__(v, "__dict__", base.__dict__ | changes)
    return v
