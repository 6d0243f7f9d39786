"""What P/D transfer does to one engine's KV cache: hold blocks for export, reserve and publish
imported ones, and read or write their K/V in the executor.

Bookkeeping on the block pool runs on the engine thread (`Engine.call`), except `hold_for_export`,
which an exporter calls there already; reading and writing K/V runs off it, on blocks held or
reserved, so a transfer never stalls a step.
"""

from concurrent.futures import Future
from typing import TYPE_CHECKING

from workers.transfer import KVPayload, KVSpec, Reservation, executor_spec, publish, reserve

if TYPE_CHECKING:
    from workers.engine import Engine


class KVHost:
    """The transfer services' (workers/transfer_http.py, transfer_nixl.py) view of an engine."""

    def __init__(self, engine: "Engine"):
        self.engine = engine

    @property
    def worker_id(self) -> str:
        return self.engine.worker_id

    @property
    def kv_seed(self) -> int:
        """The block-hash chain's seed: imported hashes are re-derived from it and the tokens."""
        return self.engine.kv.seed

    def hold_for_export(self, block_ids: list[int]) -> list:
        """Engine thread (an exporter): take a reference on blocks until they are sent."""
        self.engine.stats.kv_exported_blocks += len(block_ids)
        return self.engine.pool.hold(block_ids)

    def release(self, blocks: list) -> Future:
        """Let go of held or reserved blocks."""
        return self.engine.call(lambda: self.engine.pool.free(blocks))

    def reserve(self, payload: KVPayload) -> Future:
        """A future of the blocks an import writes into (`workers.transfer.reserve`)."""
        return self.engine.call(lambda: reserve(self.engine.pool, payload))

    def publish(self, payload: KVPayload, res: Reservation) -> Future:
        """A future of (imported, present) once the written blocks enter the prefix cache."""

        def run() -> tuple[int, int]:
            imported, present = publish(self.engine.pool, payload, res)
            self.engine.stats.kv_imported_blocks += imported
            return imported, present

        return self.engine.call(run)

    def spec(self, model: str) -> KVSpec:
        """The layout of this worker's K/V blocks as transfer headers describe it."""
        return executor_spec(model, self.engine.config.block_size, self.engine.executor)

    def cache_tensor(self) -> object | None:
        """The executor's whole KV cache tensor (what NIXL registers), None without one (sim)."""
        return getattr(self.engine.executor, "kv_cache", None)

    def read_blocks(self, block_ids: list[int]) -> object:
        """The K/V of held blocks: a device tensor, or bytes where the executor has no tensor."""
        return self.engine.executor.read_blocks(block_ids)

    def to_bytes(self, kv: object) -> bytes:
        """The bytes of what `read_blocks` gave, as the HTTP transport streams them."""
        return self.engine.executor.to_bytes(kv)

    def write_blocks(self, block_ids: list[int], data: object, positions: list[int], num_blocks: int) -> None:
        """Write an import's K/V into reserved blocks (before `publish` makes them visible)."""
        self.engine.executor.import_blocks(block_ids, data, positions, num_blocks)
