"""What an engine's steps did and how long they took: counters, the step log, and the means
the gateway and `kvgate calibrate` read from it."""

from bisect import bisect_left
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import islice

from workers.kv.cost_model import StepWork

STEP_LOG = 4096  # steps a worker keeps for /steps: minutes of traffic at CPU speed
# upper bounds (s) of the step-time histogram; the last bucket (+Inf) is implied
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.024, 2.048)
MEANS_OVER = 32  # /state's means are over this many last steps


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One logged step: `ms` is the executor's time, `wall_ms` the whole step's (scheduling,
    commits, detokenizing, any wait for a core or the GIL), `work` what it computed. The
    simulator logs the same record with `wall_ms` = `ms` (it has no host overhead)."""

    ms: float
    work: StepWork
    wall_ms: float

    def to_json(self, step: int) -> dict:
        """As GET /steps gives it: numbered, the work's fields inline."""
        return {"step": step, "ms": self.ms, **self.work.to_json(), "wall_ms": self.wall_ms}

    @staticmethod
    def from_json(d: dict) -> "StepRecord":
        return StepRecord(float(d["ms"]), StepWork.from_json(d), float(d.get("wall_ms", d["ms"])))


@dataclass
class StepStats:
    """What the last steps did and how long they took (for /state, metrics and calibrate).

    `recent` holds the last STEP_LOG step records, step `steps` last. /state gives the means of
    the last MEANS_OVER, and GET /steps all it holds (calibration probes read their steps there,
    and `kvgate calibrate --rescale` rescales a profile to them).
    """

    recent: deque[StepRecord] = field(default_factory=lambda: deque(maxlen=STEP_LOG))
    steps: int = 0
    preemptions: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    finished: int = 0
    failed: int = 0
    kv_arrived: int = 0
    kv_fallbacks: int = 0
    kv_imported_blocks: int = 0
    kv_exported_blocks: int = 0
    host_stored_blocks: int = 0  # copied out to the host tier
    host_loaded_blocks: int = 0  # copied back from it for a prefix hit
    disk_stored_blocks: int = 0  # written to the disk tier
    disk_loaded_blocks: int = 0  # read back from it for a prefix hit
    calls_s: float = 0.0  # engine-thread time in `call` functions and exporters: no step ran
    step_counts: list[int] = field(default_factory=lambda: [0] * (len(STEP_BUCKETS) + 1))
    step_seconds: float = 0.0  # executor (device) time of all steps

    def record(self, step: StepRecord) -> None:
        """Log a step; its executor time also goes into the step-time histogram (plain counts,
        read at scrape time, so the engine thread never takes a metrics lock)."""
        self.steps += 1
        self.step_counts[bisect_left(STEP_BUCKETS, step.ms / 1000.0)] += 1
        self.step_seconds += step.ms / 1000.0
        self.recent.append(step)

    def after(self, seq: int) -> list[dict]:
        """The steps numbered above `seq` that are still held, as GET /steps gives them."""
        held = len(self.recent)
        first = self.steps - held + 1
        skip = max(0, seq + 1 - first)
        return [step.to_json(first + skip + i) for i, step in enumerate(islice(self.recent, skip, None))]

    def last(self, n: int = MEANS_OVER) -> list[StepRecord]:
        log = self.recent
        return [log[i] for i in range(-min(n, len(log)), 0)]


def step_means(recent: Iterable[StepRecord]) -> dict:
    """Mean time and work per step of `recent` steps, in `CostModel.step_ms` terms: the gateway
    rescales its cost model by the measured time against the model's time for the same work.
    The decode-only steps' means are given apart (`decode_step_*`): prefill and decode differ
    from the model's shape by different factors, and these let the gateway tell them apart."""
    steps = list(recent)
    if not steps:
        return {"step_ms": None}
    out = {
        "step_ms": _mean(s.ms for s in steps),
        "step_prefill_tokens": _mean(s.work.prefill_tokens for s in steps),
        "step_prefill_ctx_products": _mean(s.work.prefill_ctx_products for s in steps),
        "step_decode_seqs": _mean(s.work.decode_seqs for s in steps),
        "step_decode_kv_tokens": _mean(s.work.decode_kv_tokens for s in steps),
    }
    decodes = [s for s in steps if s.work.prefill_tokens == 0 and s.work.decode_seqs > 0]
    if decodes:
        out.update(
            decode_step_ms=_mean(s.ms for s in decodes),
            decode_step_seqs=_mean(s.work.decode_seqs for s in decodes),
            decode_step_kv_tokens=_mean(s.work.decode_kv_tokens for s in decodes),
        )
    return out


def _mean(xs: Iterable[float]) -> float:
    values = list(xs)
    return sum(values) / len(values)
