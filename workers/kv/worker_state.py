"""What a worker's GET /state carries: its load as of its last step. One type for the engine
and the fleet simulator that produce it and the gateway (and the simulator's router) that
reads it; the JSON is its fields, flat."""

from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True)
class WorkerState:
    """`step_*` are the means over the last steps of their time and work (`CostModel.step_ms`
    terms), `decode_step_*` the same over the decode-only ones (`workers/step_stats.py`)."""

    worker_id: str
    role: str = "mixed"
    model: str | None = None
    block_size: int = 16
    total_blocks: int = 0
    free_blocks: int = 0
    shared_blocks: int = 0  # blocks in use by two or more requests (a prefix they share)
    host_blocks: int = 0  # the host tier's size (0: none)
    host_free_blocks: int = 0
    disk_blocks: int = 0  # the disk tier's size (0: none)
    disk_free_blocks: int = 0
    host_gbps: float | None = None  # its host -> device copy rate (--host-kv-gbps); None: not published
    disk_gbps: float | None = None  # its file -> device read rate (--disk-kv-gbps)
    load_every_hit: bool = False  # it copies back every slow-tier hit (--kv-load-every-hit)
    waiting: int = 0
    running: int = 0
    queued_prefill_tokens: int = 0  # prompt tokens not computed yet (a waiting hit counts its miss)
    kv_tokens: int = 0  # tokens whose K/V the running requests hold
    max_batched_tokens: int = 2048
    max_num_seqs: int = 256
    step_ms: float | None = None
    step_prefill_tokens: float = 0.0
    step_prefill_ctx_products: float = 0.0
    step_decode_seqs: float = 0.0
    step_decode_kv_tokens: float = 0.0
    decode_step_ms: float | None = None
    decode_step_seqs: float = 0.0
    decode_step_kv_tokens: float = 0.0
    cost_model: dict | None = None  # the worker's own profile (sim executor), if it has one
    kv_bytes_per_token: int = 0
    kv_seq: int = 0  # its last KV event
    preemptions: int = 0
    pending_kv: int = 0  # P/D decode requests waiting for their blocks
    engine_calls_s: float = 0.0
    max_model_len: int | None = None
    export_batch_blocks: int = 0  # P/D: blocks per export batch mid-prefill (0: one transfer after it)

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(d: dict) -> "WorkerState":
        """The known fields of a /state body (a server adds liveness and transfer fields, and
        an older worker may lack newer ones: their defaults stand)."""
        return WorkerState(**{name: d[name] for name in _FIELDS if name in d})


_FIELDS = tuple(f.name for f in fields(WorkerState))  # `fields` builds its tuple anew each call
