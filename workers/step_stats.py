"""What an engine's steps did and how long they took: counters, the step log, and the means
the gateway and `kvgate calibrate` read from it."""
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field
from itertools import islice

from workers.scheduler import StepPlan

STEP_LOG = 4096  # steps a worker keeps for /steps: minutes of traffic at CPU speed
# upper bounds (s) of the step-time histogram; the last bucket (+Inf) is implied
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.024, 2.048)


@dataclass
class StepStats:
    """What the last steps did and how long they took (for /state, metrics and calibrate).

    `recent` holds (ms, prefill tokens, decode seqs, decode KV tokens, prefill ctx products,
    wall ms) per step, step `steps` last: `ms` is the executor's time, `wall ms` the whole
    step's (scheduling, commits, detokenizing, and any wait for a core or the GIL). /state
    gives the means of the last 32, and GET /steps all it holds (calibration probes read their
    steps there, and `kvgate calibrate --rescale` rescales a profile to them).
    """
    recent: deque = field(default_factory=lambda: deque(maxlen=STEP_LOG))
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
    calls_s: float = 0.0  # engine-thread time in `call` functions and exporters: no step ran
    step_counts: list[int] = field(default_factory=lambda: [0] * (len(STEP_BUCKETS) + 1))
    step_seconds: float = 0.0  # executor (device) time of all steps

    def record(self, ms: float, prefill_tokens: int, decode_seqs: int, kv_tokens: int,
               prefill_ctx_products: float, wall_ms: float) -> None:
        """Log a step; its executor time also goes into the step-time histogram (plain counts,
        read at scrape time, so the engine thread never takes a metrics lock)."""
        self.steps += 1
        self.step_counts[bisect_left(STEP_BUCKETS, ms / 1000.0)] += 1
        self.step_seconds += ms / 1000.0
        self.recent.append((ms, prefill_tokens, decode_seqs, kv_tokens, prefill_ctx_products, wall_ms))

    def after(self, seq: int) -> list[list[float]]:
        """[step number, *step] for the steps numbered above `seq` that are still held."""
        held = len(self.recent)
        first = self.steps - held + 1
        skip = max(0, seq + 1 - first)
        return [[first + skip + i, *step] for i, step in enumerate(islice(self.recent, skip, None))]


def step_work(plan: StepPlan) -> tuple[int, int, int, float]:
    """(prefill tokens, decode seqs, decode KV tokens, prefill ctx products) of a step about to
    run: the work `CostModel.step_ms` prices. The fleet simulator's workers report the same."""
    prefill = [(r, n) for r, n in plan.scheduled if n > 1 or r.is_prefilling]
    decodes = [r for r, n in plan.scheduled if n == 1 and not r.is_prefilling]
    return (sum(n for _, n in prefill), len(decodes), sum(r.num_tokens for r in decodes),
            sum(n * (r.num_computed + n / 2) for r, n in prefill))


def step_means(recent: list[tuple]) -> dict:
    """Mean time and work per step of `recent` steps, in `CostModel.step_ms` terms: the gateway
    rescales its cost model by the measured time against the model's time for the same work.
    The decode-only steps' means are given apart (`decode_step_*`): prefill and decode differ
    from the model's shape by different factors (on a CPU, ~29x and ~14x the default's), and
    these let the gateway tell them apart. Each step's first five columns are read (the
    engine logs a sixth, the step's wall time, for `kvgate calibrate --rescale`)."""
    if not recent:
        return {"step_ms": None}
    ms, prefill, seqs, kv, ctx = (sum(col) / len(recent) for col in list(zip(*recent))[:5])
    out = {"step_ms": ms, "step_prefill_tokens": prefill, "step_prefill_ctx_products": ctx,
           "step_decode_seqs": seqs, "step_decode_kv_tokens": kv}
    decodes = [r for r in recent if r[1] == 0 and r[2] > 0]
    if decodes:
        ms, _, seqs, kv, _ = (sum(col) / len(decodes) for col in list(zip(*decodes))[:5])
        out.update(decode_step_ms=ms, decode_step_seqs=seqs, decode_step_kv_tokens=kv)
    return out
