"""The garbage collector after start-up, one rule for gateways and workers.

What start-up builds (modules, the tokenizer, the model, the block pool, starlette, aiohttp,
prometheus: ~200k tracked objects in a gateway) lives as long as the process, and every full
collection walked it all: a gateway paused ~100 ms every several thousand requests, a worker
with 256 sequences decoding ~110 ms (experiments/host_step_cost.py), long enough to leave the
GPU idle for dozens of decode steps. Frozen, it is never walked again. Serving leaves few
objects in reference cycles (most die by reference count), so young collections at Python's
threshold of 700 allocations mostly find nothing: at 10,000 one runs every few hundred
requests or engine steps (~5 ms, less time in all: a worker's host time per step 1.09-1.20 ->
1.02-1.05 ms), rare enough to stay out of a routing decision's p99 and a step's budget.
"""

import gc

GC_THRESHOLDS = (10_000, 10, 10)


def settle_gc() -> None:
    """Freeze what is alive now and collect young objects less often; once per process, when
    start-up is done, by the process's entry point (tests run several engines and gateways in
    one process, which is the test runner's to decide)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
