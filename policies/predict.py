"""TTFT, TPOT and KV-transfer predictions for one request on one candidate worker.

Every prediction is a closed form of the worker's view: a routing decision scores every worker
(and every P/D pair) for every request, so nothing here may loop over chunks or blocks.
Times come from the worker's calibrated `CostModel` when it has one; otherwise the default
model's shape is rescaled to the worker's measured mean step time for the work those steps did;
with neither, the default model alone gives a crude per-token estimate.
"""
import math

from policies.api import RequestView, WorkerView
from workers.kv.cost_model import CostModel

DEFAULT_COST = CostModel()


def cached_tokens(req: RequestView, w: WorkerView) -> int:
    """Prompt tokens `w` already holds as prefix-cached blocks."""
    return min(w.matched_blocks * w.block_size, req.num_tokens)


def uncached_tokens(req: RequestView, w: WorkerView) -> int:
    """Prompt tokens `w` must prefill; at least one, since the last token is always computed."""
    return max(1, req.num_tokens - w.matched_blocks * w.block_size)


def unseen_requests(w: WorkerView) -> int:
    """Requests the gateways sent to `w` that its last reported state does not show yet."""
    return max(0, w.in_flight - w.waiting - w.running)


def queued_tokens(req: RequestView, w: WorkerView) -> int:
    """Prefill tokens ahead of `req` on `w`.

    The reported queue counts at least one token per waiting request; requests not yet reported
    are assumed to be the size of this one's uncached part (the best guess at their size).
    """
    return max(w.queued_prefill_tokens, w.waiting) + unseen_requests(w) * uncached_tokens(req, w)


def chunk_tokens(w: WorkerView) -> int:
    """Prefill tokens per step: the token budget left after one token for each running decode."""
    return max(1, w.max_batched_tokens - w.running)


def queued_requests(w: WorkerView) -> int:
    """Requests the prefill queue ahead is made of (at least one, to share its tokens among)."""
    return max(1, w.waiting + unseen_requests(w))


def ttft_ms(req: RequestView, w: WorkerView, uncached: int | None = None,
            cached: int | None = None) -> float:
    """Time until `w` emits `req`'s first token: drain the prefill queue ahead, then prefill
    `uncached` tokens after `cached` ones (default: what `w` lacks and holds), in chunks that
    share every step with `w`'s running decodes."""
    model, scale = _model(w)
    own = uncached_tokens(req, w) if uncached is None else uncached
    ctx = cached_tokens(req, w) if cached is None else cached
    return scale * _ttft(model, w, queued_tokens(req, w), queued_requests(w), own, ctx)


def tpot_ms(req: RequestView, w: WorkerView) -> float:
    """Time per output token of `req` on `w`: a decode step with `req` joining the running batch,
    plus the queued prefill chunks that share those steps, amortised over `req`'s output."""
    model, scale = _model(w)
    return scale * _tpot(model, req, w, queued_tokens(req, w), queued_requests(w))


def ttft_tpot_ms(req: RequestView, w: WorkerView) -> tuple[float, float]:
    """`ttft_ms` and `tpot_ms` of `req` on `w` at once: a decision asks both of every worker, and
    computing their shared terms once makes that ~30% cheaper."""
    model, scale = _model(w)
    queued, requests = queued_tokens(req, w), queued_requests(w)
    return (scale * _ttft(model, w, queued, requests, uncached_tokens(req, w), cached_tokens(req, w)),
            scale * _tpot(model, req, w, queued, requests))


def _ttft(model: CostModel, w: WorkerView, queued: int, requests: int, own: int, ctx: int) -> float:
    steps = math.ceil((queued + own) / chunk_tokens(w))
    per_step = (model.base_ms + model.decode_seq_ms * w.running
                + model.decode_kv_token_ms * w.kv_tokens)
    attn = queued * queued / (2 * requests) + own * (ctx + own / 2)
    return (steps * per_step + model.prefill_token_ms * (queued + own)
            + model.prefill_attn_ms * attn / 1000.0)


def _tpot(model: CostModel, req: RequestView, w: WorkerView, queued: int, requests: int) -> float:
    decode = model.decode_ms(w.running + 1, w.kv_tokens + req.num_tokens)
    out = max(1, req.max_tokens)
    shared = min(queued, chunk_tokens(w) * out)
    interference = (model.prefill_token_ms * shared
                    + model.prefill_attn_ms * shared * shared / (2 * requests) / 1000.0)
    return decode + interference / out


def transfer_ms(req: RequestView, p: WorkerView, d: WorkerView) -> float:
    """Time to move the full blocks `d` lacks from `p` to `d`. `transfer_gbps` is in gigabytes
    (1e9 bytes) per second over the slower end of the link; unknown KV size means free."""
    lacking = max(0, len(req.block_hashes) - d.matched_blocks)
    size = lacking * d.block_size * max(p.kv_bytes_per_token, d.kv_bytes_per_token)
    if size == 0:
        return 0.0
    gbps = min(p.transfer_gbps, d.transfer_gbps)
    return size / (gbps * 1e6) if gbps > 0 else math.inf


def import_ttft_ms(req: RequestView, d: WorkerView) -> float:
    """Time for `d`, once it holds every full block of `req`, to compute the partial last block
    and emit the first token (P/D admits the request as an ordinary prefix-cache hit)."""
    full = len(req.block_hashes) * d.block_size
    return ttft_ms(req, d, uncached=max(1, req.num_tokens - full), cached=min(full, req.num_tokens))


def pd_ttft_ms(req: RequestView, p: WorkerView, d: WorkerView) -> float:
    """TTFT of `req` prefilled on `p` and decoded on `d`."""
    return ttft_ms(req, p) + transfer_ms(req, p, d) + import_ttft_ms(req, d)


def _model(w: WorkerView) -> tuple[CostModel, float]:
    """The cost model to predict `w` by and a factor scaling its times to `w`'s speed.

    The factor compares `w`'s mean step time with the default model's time for the mean work of
    those same steps: a prefill worker's steps are whole chunks even while its queue is empty
    now. A step time without the work it took says nothing about speed, so it is not used.
    """
    if w.cost is not None:
        return w.cost, 1.0
    reference = DEFAULT_COST.step_ms(w.step_prefill_tokens, w.step_prefill_ctx_products,
                                     w.step_decode_seqs, w.step_decode_kv_tokens)
    if not w.step_ms or not reference:
        return DEFAULT_COST, 1.0
    return DEFAULT_COST, w.step_ms / reference
