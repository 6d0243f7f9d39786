"""TTFT, TPOT and KV-transfer predictions for one request on one candidate worker.

Every prediction is a closed form of the worker's view: a routing decision scores every worker
(and every P/D pair) for every request, so nothing here may loop over chunks or blocks.
Times come from the worker's calibrated `CostModel` when it has one; otherwise the default
model's prefill and decode terms are rescaled, each by its own factor, to the worker's measured
step times for the work those steps did; with neither, the default model alone gives a crude
per-token estimate.
"""

import math

from policies.api import PREFILL, RequestView, WorkerView
from policies.ledger import blocks_held
from workers.kv.cost_model import CostModel
from workers.kv.events import DISK, HOST
from workers.kv.read_back import ReadBack, all_pay, copy_ms
from workers.kv.transfer_time import exposed, num_batches

DEFAULT_COST = CostModel()


def hit_blocks(req: RequestView, w: WorkerView) -> int:
    """Blocks `w` will take from its prefix cache, in any tier: the matched blocks, but never the
    block holding the prompt's last token, which is always computed (kvgate's workers and vLLM
    both stop the hit at `num_tokens - 1`, so a fully cached prompt recomputes a whole block)."""
    return min(w.matched_blocks, max(0, req.num_tokens - 1) // w.block_size)


def hit_tokens(req: RequestView, w: WorkerView) -> int:
    """Prompt tokens `w` will report as cached: what a route predicts, whatever the tier (less
    the slow-tier blocks it recomputes: `tier_blocks`)."""
    return tier_blocks(req, w)[0] * w.block_size


def tier_blocks(req: RequestView, w: WorkerView) -> tuple[int, int, int]:
    """The blocks `w` will take from its prefix cache, and how many of them it copies back from
    the host and the disk tier: `hit_blocks`, the blocks cut past the limit being the chain's
    tail, where the slower tiers lie (host before disk), less the slow-tier tail the worker
    recomputes rather than copies back (workers/kv/read_back.py, on `w`'s predicted speed and its
    own tier rates), none where it loads every hit."""
    n = hit_blocks(req, w)
    if not (w.matched_host_blocks or w.matched_disk_blocks):
        return n, 0, 0
    cut = w.matched_blocks - n
    disk = max(0, w.matched_disk_blocks - cut)
    host = max(0, w.matched_host_blocks - max(0, cut - w.matched_disk_blocks))
    c = w.tier_credits
    if w.kv_bytes_per_token <= 0 or c.load_every_hit:
        return n, host, disk
    model, pscale, _ = _model(w)
    bytes_ = w.block_size * w.kv_bytes_per_token
    runs = [(tier, k) for tier, k in ((HOST, host), (DISK, disk)) if k]
    if all_pay(runs, bytes_, pscale * model.prefill_token_ms * w.block_size, c.host_gbps, c.disk_gbps):
        return n, host, disk
    rb = ReadBack(
        model.scaled(pscale), w.block_size, w.kv_bytes_per_token, w.max_batched_tokens, c.host_gbps, c.disk_gbps
    )
    loaded = rb.blocks(runs, n - host - disk, req.num_tokens)
    return n - host - disk + loaded, min(host, loaded), max(0, loaded - host)


def cached_tokens(req: RequestView, w: WorkerView) -> int:
    """Prompt tokens `w`'s cache saves it computing, for scoring: `hit_blocks`, a block in a slower
    tier counted as its tier's credit of a block (`TierCredits`). Every policy's hit goes
    through here, so all credit alike."""
    if not (w.matched_host_blocks or w.matched_disk_blocks):  # `tier_blocks` without its tuple: ~40 calls a decision
        return hit_blocks(req, w) * w.block_size
    n, host, disk = tier_blocks(req, w)
    if not (host or disk):
        return n * w.block_size
    c = w.tier_credits
    return round((n - host - disk + c.host * host + c.disk * disk) * w.block_size)


def copy_back_ms(req: RequestView, w: WorkerView) -> float:
    """How long `req`'s host and disk blocks take to come back on `w` before its prefill may start
    (0 where `w` does not say how many bytes a token's K/V takes)."""
    _, host, disk = tier_blocks(req, w)
    c = w.tier_credits
    return copy_ms(host, disk, w.block_size * w.kv_bytes_per_token, c.host_gbps, c.disk_gbps)


def uncached_tokens(req: RequestView, w: WorkerView) -> int:
    """Prompt tokens `w` must prefill; at least one, since the last token is always computed."""
    return max(1, req.num_tokens - cached_tokens(req, w))


def unseen_requests(w: WorkerView) -> int:
    """Requests the gateways sent to `w` that its last reported state does not show yet."""
    return max(0, w.in_flight - w.waiting - w.running)


def queued_tokens(req: RequestView, w: WorkerView) -> int:
    """Prefill tokens ahead of `req` on `w`.

    The reported queue counts at least one token per waiting request; requests not yet reported
    are assumed to be the size of this one's uncached part (the best guess at their size).
    """
    return max(w.queued_prefill_tokens, w.waiting) + unseen_requests(w) * uncached_tokens(req, w)


def ttft_ms(req: RequestView, w: WorkerView, uncached: int | None = None, cached: int | None = None) -> float:
    """Time until `w` emits `req`'s first token: drain the prefill queue ahead, then prefill
    `uncached` tokens after `cached` ones (default: what `w` lacks and holds), in chunks that
    share every step with `w`'s running decodes."""
    return ttft_tpot_ms(req, w, uncached, cached)[0]


def tpot_ms(req: RequestView, w: WorkerView) -> float:
    """Time per output token of `req` on `w`: a decode step with `req` joining the running batch,
    plus the queued prefill chunks that share those steps, amortised over `req`'s output."""
    return ttft_tpot_ms(req, w)[1]


def ttft_tpot_ms(
    req: RequestView, w: WorkerView, uncached: int | None = None, cached: int | None = None
) -> tuple[float, float]:
    """`ttft_ms` and `tpot_ms` of `req` on `w` at once. A decision asks both of every worker
    (128 of them for every request in a large simulated fleet), so the helpers above are
    inlined here: one call instead of a dozen per worker.

    The queue ahead is `queued_tokens`, made of at least one request; prefill runs in chunks of
    the token budget left after one token per running decode, and each step also pays for the
    running decodes. A copy back of host blocks runs while the queue drains (the queue's share of
    the time is its share of the tokens); only what outlasts the queue delays the prefill. The
    queue's chunks share `req`'s first decode steps."""
    model, pscale, dscale = _model(w)
    n, hit, waiting, running = req.num_tokens, cached_tokens(req, w), w.waiting, w.running
    lacking = max(1, n - hit)
    own = lacking if uncached is None else uncached
    ctx = min(hit, n) if cached is None else cached
    unseen = max(0, w.in_flight - waiting - running)
    queued = max(w.queued_prefill_tokens, waiting) + unseen * lacking
    requests = max(1, waiting + unseen)
    chunk = max(1, w.max_batched_tokens - running)
    per_step = model.base_ms + model.decode_seq_ms * running + model.decode_kv_token_ms * w.kv_tokens
    attn = queued * queued / (2 * requests) + own * (ctx + own / 2)
    ttft = (
        dscale * (math.ceil((queued + own) / chunk) * per_step)
        + pscale * (model.prefill_token_ms * (queued + own))
        + pscale * (model.prefill_attn_ms * attn / 1000.0)
    )
    if w.matched_host_blocks or w.matched_disk_blocks:  # its prefill waits for the queue and its copy back
        ttft += max(0.0, copy_back_ms(req, w) - ttft * queued / (queued + own))
    out = max(1, req.max_tokens)
    ttft += slot_wait_ms(w, running, waiting + unseen, out, model, dscale)
    shared = min(queued, chunk * out)
    interference = model.prefill_token_ms * shared + model.prefill_attn_ms * shared * shared / (2 * requests) / 1000.0
    return ttft, dscale * model.decode_ms(running + 1, w.kv_tokens + n) + pscale * (interference / out)


def slot_wait_ms(w: WorkerView, running: int, queued: int, out: int, model: CostModel, dscale: float) -> float:
    """Time a request waits for room in `w`'s running batch behind `queued` requests.

    Nothing while the batch has room. Full (`max_num_seqs` running), a place frees as a running
    request finishes: the first after about half a request's life, then one every life / batch;
    a life is `out` decode steps of the full batch (the others' lengths are guessed to be this
    one's, as their prompts are). Without this a saturated worker looks free to the
    prefill-queue terms, and an SLO-aware policy admits requests that will wait many times
    their SLO.
    """
    slots = max(1, w.max_num_seqs)
    ahead = running + queued - slots
    if ahead < 0:
        return 0.0
    return (0.5 + ahead / slots) * out * dscale * model.decode_ms(slots, w.kv_tokens)


def prefill_work_ms(req: RequestView, w: WorkerView) -> float:
    """Compute time `w` spends on `req`'s uncached prompt tokens (not the steps' fixed cost,
    which the batch shares): what a cache hit saves the worker."""
    model, pscale, _ = _model(w)
    own, ctx = uncached_tokens(req, w), cached_tokens(req, w)
    return pscale * (model.prefill_token_ms * own + model.prefill_attn_ms * own * (ctx + own / 2) / 1000.0)


def pool_share(req: RequestView, w: WorkerView, own: int | None = None) -> float:
    """The share of `w`'s free KV room `req`'s uncached prompt would take, in [0, 1): its
    tokens over themselves plus the free blocks (cached-but-free count as free) left after
    the prompts queued ahead (`queued_tokens`, unseen ones included). What a copy of a prefix
    costs the worker it lands on; measured against free room, not the whole pool, since a
    copy into a nearly full pool evicts or preempts, and net of the queue since a polled view
    is stale: counting only reported free blocks sent a burst of new sessions to the worker
    that looked emptiest. `own` stands in for the uncached prompt where some of it is paid
    for elsewhere. 0 where the pool size is unknown."""
    if w.total_blocks <= 0:
        return 0.0
    own = uncached_tokens(req, w) if own is None else own
    room = max(0, w.free_blocks * w.block_size - queued_tokens(req, w))
    return own / (own + room)


# The wait leaves out the preemptions of a pool admitted to the brim (the newest running request
# that cannot grow is recomputed, and waits again). In the simulator at vs_peers' configuration
# on shared-prefix, admitted requests waited about the unscaled estimate at 56 req/s (median),
# 2.6x it at 150 req/s where 10-20 requests sent to the worker were not in its last poll; at 5x
# capacity 0.79 / 0.84 / 0.90 of the admitted met their SLOs with a factor of 1.5 / 1.75 / 2.
# At capacity the same factor is pessimistic (multi-turn, 20-24 req/s: requests predicted 2-5 s
# away met their SLOs when admitted anyway): `pool_queue_safety` scales it by how over-committed
# the fleet is.
POOL_QUEUE_SAFETY = 2.0


def pool_queue_safety(refused_share: float) -> float:
    """The factor on `pool_queue_wait_ms` for a router that refused `refused_share` of its recent
    requests: 1 with none refused, `POOL_QUEUE_SAFETY` from half refused (2x capacity refuses
    ~0.3-0.4, 5x ~0.6). No field of a polled view told capacity from overload apart (the
    worker's queue, its share of the batch: at 5x on shared-prefix 0.77-0.81 of the admitted met
    their SLOs), while the router's own refusals grow with the overload whatever the rate."""
    return 1.0 + min(1.0, 2.0 * refused_share) * (POOL_QUEUE_SAFETY - 1.0)


def pool_queue_wait_ms(req: RequestView, w: WorkerView, safety: float = POOL_QUEUE_SAFETY) -> float:
    """Time `req` waits on `w` for its turn in the KV pool, counting every request over its
    whole life (`safety` times this estimate).

    Nothing while the pool holds the blocks in use, the running requests' outputs still to
    grow (half of `req.max_tokens` each, on average), and the queued prompts and `req`'s with
    their whole outputs. Past that the pool is the batch: it holds `fits = room / per`
    requests, `room` the pool less the blocks shared prefixes pin and `per` the larger of
    `req`'s own footprint (uncached prompt and half its output) and a running request's
    private blocks; the requests in flight beyond that start one per `life / fits` (a life:
    `max_tokens` decode steps of the running batch). A refusal wherever the prompts overflowed
    the free blocks refused requests that a full pool served within SLO as its running requests
    ended; a wait for blocks that left the outputs out admitted requests at overload that then
    waited past their SLO behind the preemptions of requests that could not grow. 0 where the
    pool size is unknown."""
    if w.total_blocks <= 0:
        return 0.0
    bs, out = w.block_size, max(1, req.max_tokens)
    queued = w.waiting + unseen_requests(w)
    used = (w.total_blocks - w.free_blocks) * bs + w.running * out / 2
    if used + queued_tokens(req, w) + (queued + 1) * out + uncached_tokens(req, w) <= w.total_blocks * bs:
        return 0.0
    fits, life = pool_batch(req, w)
    ahead = max(w.running + w.waiting, w.in_flight) + 1
    if ahead <= fits:
        return 0.0
    return safety * (ahead - fits) * life / fits


def pool_batch(req: RequestView, w: WorkerView, alike: bool = False) -> tuple[float, float]:
    """(fits, life): how many requests like `req` `w`'s KV pool holds at once (the pool less
    the blocks shared prefixes pin, over the larger of `req`'s own footprint, its uncached
    prompt and half its output, and a running request's private blocks; `alike`: over `req`'s
    alone, as if every request were like it), and how long one lives (`max_tokens` decode
    steps of the running batch), in ms. Needs `total_blocks`."""
    bs, out = w.block_size, max(1, req.max_tokens)
    room = (w.total_blocks - w.shared_blocks) * bs
    private = (w.total_blocks - w.free_blocks - w.shared_blocks) * bs
    per = uncached_tokens(req, w) + out / 2
    if w.running and not alike:
        per = max(per, private / w.running)
    return max(1.0, room / per), out * decode_step_ms(w)


def decode_step_ms(w: WorkerView) -> float:
    """One decode step of `w`'s running batch, in ms."""
    model, _, dscale = _model(w)
    return dscale * model.decode_ms(max(1, w.running), w.kv_tokens)


def ledger_wait_ms(req: RequestView, w: WorkerView, now: float) -> float | None:
    """Time `req` waits on `w` for room in its KV pool by this router's ledger of what it has in
    flight there (`policies.ledger`): the whole prompt and output less what `w` holds of it,
    behind the requests sent before it. None where the ledger does not cover `w`'s load: no
    ledger, the pool size unknown, or its count of requests unlike the router's: more in flight
    (another replica's, a prefill leg's), fewer (an entry left behind), or far more running and
    waiting than it sent (another client's)."""
    led = w.ledger
    if led is None or w.total_blocks <= 0 or w.in_flight != len(led) or w.running + w.waiting > 2 * len(led) + 2:
        return None
    need = blocks_held(req.num_tokens, req.max_tokens, cached_tokens(req, w), w.block_size)
    return 1000.0 * led.start_s(w.total_blocks, need, max(1, req.max_tokens), decode_step_ms(w) / 1000.0, now)


def transfer_ms(req: RequestView, p: WorkerView, d: WorkerView) -> float:
    """Time to move the full blocks `d` lacks from `p` to `d`. `transfer_gbps` is in gigabytes
    (1e9 bytes) per second over the slower end of the link; unknown KV size means free."""
    lacking = max(0, len(req.block_hashes) - d.matched_blocks)
    size = lacking * d.block_size * max(p.kv_bytes_per_token, d.kv_bytes_per_token)
    if size == 0:
        return 0.0
    gbps = min(p.transfer_gbps, d.transfer_gbps)
    return size / (gbps * 1e6) if gbps > 0 else math.inf


def own_prefill_ms(req: RequestView, w: WorkerView) -> float:
    """Time of the steps that prefill `req`'s own uncached tokens on `w` (the queue ahead left
    out): the span over which a prefill worker's export batches leave."""
    model, pscale, dscale = _model(w)
    own, ctx = uncached_tokens(req, w), cached_tokens(req, w)
    chunk = max(1, w.max_batched_tokens - w.running)
    per_step = model.base_ms + model.decode_seq_ms * w.running + model.decode_kv_token_ms * w.kv_tokens
    return dscale * math.ceil(own / chunk) * per_step + pscale * (
        model.prefill_token_ms * own + model.prefill_attn_ms * own * (ctx + own / 2) / 1000.0
    )


def exposed_transfer_ms(req: RequestView, p: WorkerView, d: WorkerView, ttft_p: float | None = None) -> float:
    """What moving the blocks `d` lacks from `p` adds to TTFT once `p`'s prefill is done: `p`
    exports in batches of `export_batch_blocks` as its steps compute them, so the transfer
    overlaps the prefill and only what is left of it adds (`transfer_time.exposed`; all of it
    when `p` ships one payload at the end). Blocks `p` had cached leave with the first batch.
    The link first carries what is ahead on it: `p`'s exports not sent yet and, on a prefill
    worker, the legs queued before this one; a saturated link shows here, not in the prefill.
    `ttft_p` is `ttft_ms(req, p)` when the caller has it."""
    wire = transfer_ms(req, p, d)
    if not 0 < wire < math.inf:
        return wire
    full = len(req.block_hashes)
    held, hit = min(full, d.matched_blocks), min(full, hit_blocks(req, p))
    computed = full - max(held, hit)
    chunk = max(1, p.max_batched_tokens - p.running)
    batches = num_batches(full - hit, chunk, p.block_size, p.export_batch_blocks)
    prefill = own_prefill_ms(req, p)
    ahead = p.export_backlog_bytes + (queued_tokens(req, p) if p.role == PREFILL else 0) * max(
        p.kv_bytes_per_token, d.kv_bytes_per_token
    )
    starts = (ttft_ms(req, p) if ttft_p is None else ttft_p) - prefill
    backlog = ahead / (min(p.transfer_gbps, d.transfer_gbps) * 1e6) - starts
    return exposed(prefill, wire, wire * computed / (full - held), batches, 0.0, backlog)


def import_ttft_ms(req: RequestView, d: WorkerView) -> float:
    """Time for `d`, once it holds every full block of `req`, to compute the partial last block
    and emit the first token (P/D admits the request as an ordinary prefix-cache hit)."""
    return import_ttft_tpot_ms(req, d)[0]


def import_ttft_tpot_ms(req: RequestView, d: WorkerView) -> tuple[float, float]:
    """`import_ttft_ms` and `tpot_ms` of `req` on decode worker `d` in one prediction (pair
    selection asks both of every decode worker)."""
    full = len(req.block_hashes) * d.block_size
    return ttft_tpot_ms(req, d, uncached=max(1, req.num_tokens - full), cached=min(full, req.num_tokens))


def pd_ttft_ms(req: RequestView, p: WorkerView, d: WorkerView) -> float:
    """TTFT of `req` prefilled on `p` and decoded on `d`."""
    head = ttft_ms(req, p)
    return head + exposed_transfer_ms(req, p, d, head) + import_ttft_ms(req, d)


def _model(w: WorkerView) -> tuple[CostModel, float, float]:
    """The cost model to predict `w` by, and factors scaling its prefill terms and its per-step
    (base and decode) terms to `w`'s speed.

    Factors compare measured step times with the default model's time for the mean work of
    those same steps: a prefill worker's steps are whole chunks even while its queue is empty
    now. The decode factor comes from the recent decode-only steps; the prefill factor is what
    the mean step left after its decode part, over its prefill part. Real hardware is not the
    default model scaled by one number (a CPU prefills ~29x slower than it, decodes ~14x), and one
    factor over-predicted whichever side the recent steps held less of. Where a side was not
    seen (or is under a tenth of the work, too little to measure) the overall factor stands in.
    A step time without the work it took says nothing about speed, so it is not used.
    """
    if w.cost is not None:
        return w.cost, 1.0, 1.0
    c = DEFAULT_COST
    reference = c.step_ms(
        w.step_prefill_tokens, w.step_prefill_ctx_products, w.step_decode_seqs, w.step_decode_kv_tokens
    )
    if not w.step_ms or not reference:
        return c, 1.0, 1.0
    overall = w.step_ms / reference
    decode_reference = c.step_ms(0, 0.0, w.decode_step_seqs, w.decode_step_kv_tokens)
    if not w.decode_step_ms or not decode_reference:
        return c, overall, overall
    decode = w.decode_step_ms / decode_reference
    prefill_part = c.prefill_token_ms * w.step_prefill_tokens + c.prefill_attn_ms * w.step_prefill_ctx_products / 1000.0
    left = w.step_ms - decode * (reference - prefill_part)
    if prefill_part < 0.1 * reference or left <= 0:
        return c, overall, decode
    return c, left / prefill_part, decode
