"""A step between its launch and its tokens: placeholders, so the next step can be planned first.

An executor that `overlaps` (the torch runner on CUDA) returns from `launch` as soon as the step
is queued on the device. The engine then plans and launches the next step before it reads this
one's tokens, so the host's scheduling and bookkeeping run while the device computes, as vLLM's
async scheduling does. To plan without the tokens, launching a step appends a PLACEHOLDER for
each token it samples (the request then counts as decoding it), and the next step's chunk for
that request names the row of this step's sampled tokens its input comes from (`prev_sample`:
the runner copies it on the device). Resolving the step (`Scheduler.update_from_output`) writes
the real tokens over the placeholders, oldest first. A request whose sampled token will be its last (max_tokens, context)
is FINISHING from launch: the scheduler gives it no more steps.

Executors without `launch` run the step at launch and resolve right away: the same bookkeeping
with nothing in between.
"""

import time
from dataclasses import dataclass

from workers.executors.batch import SeqChunk
from workers.kv.cost_model import StepWork
from workers.request import FINISHING
from workers.scheduler import StepPlan

PLACEHOLDER = -1  # a token sampled by a step not resolved yet


@dataclass
class InFlight:
    """A launched step: its plan, the executor's handle, its work (for the step log), and when
    the engine iteration that launched it began."""

    plan: StepPlan
    handle: object
    work: StepWork
    start: float
    launched: float


class SyncLaunch:
    """`launch`/`collect` for an executor that only has `execute`: the step runs at launch."""

    overlaps = False

    def __init__(self, executor):
        self.executor = executor

    def launch(self, chunks: list[SeqChunk]) -> tuple[list[int | None], float]:
        t0 = time.perf_counter()
        tokens = self.executor.execute(chunks)
        return tokens, (time.perf_counter() - t0) * 1000

    @staticmethod
    def collect(handle: tuple[list[int | None], float]) -> tuple[list[int | None], float]:
        return handle


def chunks_of(plan: StepPlan) -> list[SeqChunk]:
    """The step's chunks; each hands the request's own block-id list and history (no copy per step). A
    chunk whose one token is a placeholder names the previous step's sampled row it comes from."""
    chunks = []
    for req, n in plan.scheduled:
        start = req.num_computed
        end = start + n
        total = len(req.token_ids)
        chunk = SeqChunk(
            req.token_ids[start:end],
            start,
            req.block_ids,
            end == total,
            req.params,
            total - len(req.prompt_ids),
            history=req.history,
        )
        if req.unresolved:
            assert n == 1 and end == total, "only a decode's input token can be unresolved"
            chunk.prev_sample = req.sample_row
        chunks.append(chunk)
    return chunks


def advance(plan: StepPlan, max_model_len: int) -> None:
    """Count the launched step's tokens as computed and append a placeholder per sampled token."""
    row = 0
    for req, n in plan.scheduled:
        req.num_computed += n
        if req.num_computed == len(req.token_ids):
            req.token_ids.append(PLACEHOLDER)
            req.unresolved += 1
            req.sample_row = row
            row += 1
            if req.num_output + req.unresolved >= req.params.max_tokens or len(req.token_ids) >= max_model_len:
                req.status = FINISHING
