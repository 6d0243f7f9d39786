"""An engine's load as GET /state reports it: one `WorkerState` read off its scheduler, block
pool, step stats and config on the engine thread after each step. The engine keeps the last one
(`Engine.state`), so a poll from the server's loop reads a whole step's numbers, never a step's
half, and never waits for one."""

from typing import TYPE_CHECKING

from workers.kv.worker_state import WorkerState
from workers.step_stats import step_means

if TYPE_CHECKING:
    from workers.engine import Engine


def engine_state(engine: "Engine", pending_kv: int) -> WorkerState:
    """The engine's state now; `pending_kv` is how many P/D decode requests wait for their
    blocks (the engine's own count: they are neither waiting nor running yet)."""
    s, c, pool = engine.scheduler, engine.config, engine.pool
    return WorkerState(
        worker_id=c.worker_id,
        role=c.role,
        model=c.model_id,
        block_size=c.block_size,
        total_blocks=pool.num_blocks,
        free_blocks=pool.num_free,
        shared_blocks=pool.num_shared,
        waiting=len(s.waiting) + len(s.loading),
        host_blocks=c.host_blocks,
        host_free_blocks=pool.host.num_free if pool.host else 0,
        disk_blocks=pool.disk.num_blocks if pool.disk else 0,
        disk_free_blocks=pool.disk.num_free if pool.disk else 0,
        host_gbps=c.host_gbps,
        disk_gbps=c.disk_gbps,
        load_every_hit=c.load_every_hit or c.cost_model is None,  # as `Engine._read_back` decides
        running=len(s.running),
        queued_prefill_tokens=s.queued_prefill_tokens,
        kv_tokens=sum(r.num_computed for r in s.running),
        max_batched_tokens=s.max_batched_tokens,
        max_num_seqs=s.max_num_seqs,
        **step_means(engine.stats.last()),
        cost_model=c.cost_model.to_json() if c.cost_model else None,
        kv_bytes_per_token=getattr(engine.executor, "kv_bytes_per_token", 0),
        kv_seq=engine.events.last_seq,
        preemptions=engine.stats.preemptions,
        pending_kv=pending_kv,
        engine_calls_s=engine.stats.calls_s,
        max_model_len=engine.max_model_len,
        export_batch_blocks=c.export_batch_blocks,
        generation_defaults=c.generation_defaults.to_json() or None,
    )
