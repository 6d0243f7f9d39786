"""When a P/D transfer's blocks land on the decode worker: one model, batch by batch for the
fleet simulator and in closed form for the routing predictor.

The prefill worker exports a prompt's blocks in batches as its prefill steps compute them
(workers/export_batch.py). A batch pays the link's fixed cost (reserve and commit round trips),
then its bytes go on the wire after the batches before it: a sender's exports share its link.
So the wire time still left when the prefill ends, at least the last batch's, is all that adds
to TTFT; the rest hid behind the prefill.
"""

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    """A transport as measured (bench/transfer_model.py): a fixed cost per transfer, then bytes
    at `gbps` (1e9 bytes per second)."""

    latency_s: float
    gbps: float

    def wire_s(self, nbytes: float) -> float:
        return nbytes / (self.gbps * 1e9)

    def lands_s(self, ready_s: float, wire_free_s: float, nbytes: float) -> float:
        """When a batch exported at `ready_s` has landed: its fixed cost runs beside the wire,
        its bytes wait for the wire to be free (at `wire_free_s`)."""
        return max(ready_s + self.latency_s, wire_free_s) + self.wire_s(nbytes)


def num_batches(blocks: int, chunk: int, block_size: int, batch_blocks: int) -> int:
    """Batches `export_span` makes of a prefill that computes `blocks` full blocks in steps of
    `chunk` tokens: one per run of steps that computes at least `batch_blocks` blocks, the last
    run's with the final one; one batch when `batch_blocks` is 0 (all after the prefill)."""
    if batch_blocks <= 0 or blocks <= 0:
        return 1
    chunk = max(1, chunk)
    steps = math.ceil(blocks * block_size / chunk)
    per = math.ceil(batch_blocks * block_size / chunk)
    return math.ceil(steps / per)


def exposed(
    prefill: float, wire: float, computed_wire: float, batches: int, latency: float, backlog: float = 0.0
) -> float:
    """How long after a prefill taking `prefill` its last batch lands (times in any one unit): `Link.lands_s` over
    `batches` batches ready at even intervals of the prefill, the last as it ends. The blocks
    computed during it (`computed_wire` of the `wire` total) are spread evenly over the
    batches; the rest (blocks the prefill worker had cached) go with the first. The link is busy
    with earlier transfers for `backlog` after the prefill starts. In closed form: the chain of
    batches is longest from the first batch or from the last, as the batches in between are
    alike, or from the backlog. Why: a routing decision prices every pair, it cannot replay the
    batches.
    """
    m = max(1, batches)
    computed = min(max(0.0, computed_wire), wire)
    return max(latency + max(computed / m, wire - prefill * (m - 1) / m), backlog + wire - prefill)
