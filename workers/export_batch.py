"""P/D block-batch export: which of a prefilling request's blocks go to its exporter now. One
rule for the engine (`Engine._export`) and the fleet simulator, so the simulated transfer
overlaps the prefill exactly as the worker's does (timing: workers/kv/transfer_time.py)."""

from workers.request import Request


def export_span(req: Request, block_size: int, batch_blocks: int, final: bool) -> tuple[int, int] | None:
    """The full prompt blocks [start, end) to hand over now, continuing the last handed block,
    or None. Mid-prefill (not `final`) only a batch of at least `batch_blocks` new ones (none
    when it is 0): a batch's transfer overlaps the prefill of later blocks, and pays where its
    bytes outweigh a transfer's fixed cost."""
    end = min(req.num_prompt // block_size, req.num_registered // block_size, len(req.block_hashes))
    start = req.num_exported
    if end <= start or (not final and (batch_blocks <= 0 or end - start < batch_blocks)):
        return None
    return start, end
