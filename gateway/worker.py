"""The gateway's record of one worker: where it is, what it last said, what the gateways have
in flight there, and the load rules read from it between polls (`gateway.fleet` keeps the
registry and the polls)."""

import asyncio
from dataclasses import dataclass, field

from gateway.breaker import Breaker
from policies.api import WorkerView
from policies.ledger import Ledger
from workers.generation_defaults import NEUTRAL, GenerationDefaults

KVGATE = "kvgate"  # the kind of kvgate's own workers (others: gateway/vllm_worker.py)


@dataclass(eq=False)
class Worker:
    url: str
    static: bool = True
    worker_id: str = ""  # set by its first /state poll
    state: dict = field(default_factory=dict)
    healthy: bool = False
    out: str | None = None  # why a worker that answers /state takes no requests
    refused: bool = False  # it answered 403 to /state (said once in the log)
    probe_failures: int = 0  # /state polls that failed: the worker unreachable, for the error panel
    malformed_kv: int = 0  # KV-event lines and snapshots it sent that were malformed (gateway.kv_tail)
    suspect: bool = False
    epoch: int = 0
    in_flight: int = 0
    shared_in_flight: int = 0
    sent_since_poll: int = 0  # requests the gateways sent and finished since its last state
    done_since_poll: int = 0
    state_at: float = 0.0  # time.monotonic() of its last state, polled or riding on KV events
    tried: float = 0.0  # time.monotonic() of its last /state poll tried
    woken_at: float = 0.0  # time.monotonic() of the last request sent to it while it was idle
    state_rides: bool = False  # its last /kv/events answer carried its state
    redis_residency: bool = False
    kind: str = KVGATE
    generation_defaults: GenerationDefaults = NEUTRAL  # its model's sampling defaults, from its state
    hash_ratio: int = 1  # index blocks per block of the worker's own size
    ledger: Ledger = field(default_factory=Ledger)  # what this gateway has in flight there
    base: WorkerView | None = None
    tasks: list = field(default_factory=list)
    breaker: Breaker = field(default_factory=Breaker)
    lost: asyncio.Future | None = None
    nap: asyncio.Future | None = None  # its poller's wait (`Fleet._nap`), moved by `Fleet._rearm`
    nap_timer: asyncio.TimerHandle | None = None  # what ends the nap when its next poll is due

    @property
    def available(self) -> bool:
        return (
            self.healthy and self.out is None and not self.suspect and self.base is not None and self.breaker.allows()
        )

    @property
    def model(self) -> str | None:
        return self.state.get("model")

    def held(self) -> int:
        """Requests at the worker now, as far as its last state and the gateways' traffic since
        tell: what it reported waiting or running, plus what was sent to it since, less what
        finished since."""
        s = self.state
        return s.get("waiting", 0) + s.get("running", 0) + self.sent_since_poll - self.done_since_poll

    def queued(self) -> int:
        """Requests waiting at the worker now beyond its running batch (`max_num_seqs`): what it
        holds (`held`), at least what the gateways have open on it. Exact between polls for the
        gateways' traffic (another replica's within a pub/sub round trip), where the report
        alone would lag by up to a poll interval both ways."""
        return max(0, max(self.held(), self.in_flight + self.shared_in_flight) - self.state.get("max_num_seqs", 256))


DRAINING = "it is draining"


def out_of_service(state: dict, stall_s: float) -> str | None:
    """Why a worker whose /state answers must get no requests, or None when it may. Fields a
    worker does not report (older workers, other engines) count as fine."""
    if state.get("engine_alive") is False:
        return "its engine is not running"
    if state.get("draining"):
        return DRAINING
    stall = state.get("engine_stall_s") or 0.0
    if stall > stall_s:
        return f"its engine has made no progress for {stall:.1f} s"
    return None


def idle(w: Worker) -> bool:
    """Whether `w` holds no request now: nothing `held` there and nothing in flight on it. A
    request reaching it from elsewhere shows in its next KV-event answer (its prefill stores
    blocks)."""
    return w.healthy and w.out is None and w.held() <= 0 and not (w.in_flight or w.shared_in_flight)


def less_held(base: WorkerView, ended: int) -> dict[str, int]:
    """`base`'s waiting and running less `ended` requests (running ones first) that its state
    counted and that have ended since. A state is up to a poll old, an idle worker's up to a
    long poll: without this a request that had ended kept its worker looking busy, and new
    ones queued behind a running one while other workers stood idle."""
    if ended <= 0:
        return {}
    running = max(0, base.running - ended)
    return {"running": running, "waiting": max(0, base.waiting - (ended - (base.running - running)))}
