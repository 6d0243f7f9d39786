"""What an engine is built with: its model, KV pool and tiers, step budget and role."""

from dataclasses import dataclass

from workers.generation_defaults import NEUTRAL, GenerationDefaults
from workers.kv.cost_model import CostModel
from workers.kv.read_back import DISK_GBPS, HOST_GBPS


@dataclass
class EngineConfig:
    model_id: str
    block_size: int = 16
    num_blocks: int = 1024
    max_batched_tokens: int = 2048
    max_num_seqs: int = 256
    worker_id: str = "worker-0"
    role: str = "mixed"
    enable_prefix_caching: bool = True
    cost_model: CostModel | None = None
    export_batch_blocks: int = 16  # P/D: ship prompt blocks mid-prefill once this many are new; 0: at the end
    host_blocks: int = 0  # the host tier's blocks (--host-kv-gb); 0: evicted blocks are dropped
    disk_blocks: int = 0  # the disk tier's blocks under the host's (--disk-kv-gb); 0: none
    disk_dir: str = ""  # where the disk tier's files go (--disk-kv-dir)
    host_gbps: float = HOST_GBPS  # host -> device copy rate (--host-kv-gbps): read or recompute
    disk_gbps: float = DISK_GBPS  # file -> device read rate (--disk-kv-gbps): read or recompute
    load_every_hit: bool = False  # copy back every slow-tier hit, even where recomputing is faster
    generation_defaults: GenerationDefaults = NEUTRAL  # what a request's absent sampling fields take
