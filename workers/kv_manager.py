"""Per-request view of the block pool: prefix matching, slot allocation, hashing, freeing.

The engine calls these around every step: `match_prefix` when a request is first scheduled,
`allocate_slots` before computing tokens, `commit` after computing them (newly full blocks
are hashed and published), `free` when it finishes, is aborted or is preempted.
"""

from array import array
from workers.kv.block_pool import BlockPool
from workers.kv.hashing import block_hash, salted_seed
from workers.kv.read_back import ReadBack
from workers.request import Request


class KVCacheManager:
    def __init__(
        self, pool: BlockPool, seed: int, enable_prefix_caching: bool = True, read_back: ReadBack | None = None
    ):
        """`read_back` decides how much of a slow-tier hit to copy back rather than recompute;
        without it every such hit is copied back."""
        self.pool = pool
        self.block_size = pool.block_size
        self.seed = seed
        self.enable_prefix_caching = enable_prefix_caching
        self.read_back = read_back

    def _hashes(self, req: Request, n_blocks: int) -> list[int]:
        """The request's chain, extended to at least `n_blocks` hashes (it may hold more: read
        only the first `n_blocks`)."""
        B = self.block_size
        hs = req.block_hashes
        while len(hs) < n_blocks:
            i = len(hs)
            parent = hs[-1] if hs else salted_seed(self.seed, req.cache_salt)
            hs.append(block_hash(parent, req.token_ids[i * B : (i + 1) * B]))
        return hs

    def _prefix_hashes(self, req: Request) -> list[int]:
        """The hashes a prefix hit may cover: every full block but the one holding the last
        token, which is always computed (it yields the first output's logits)."""
        limit = (req.num_tokens - 1) // self.block_size
        return self._hashes(req, limit)[:limit]

    def match_prefix(self, req: Request) -> int:
        """Take the longest cached prefix (never the whole prompt), on from the device into the
        host and disk tiers as far as `read_back` finds copying cheaper than recomputing (those
        blocks' copy back is queued: `req.load`, and the request must not run before it lands);
        returns the tokens it covers."""
        assert not req.blocks and req.num_computed == 0
        if not self.enable_prefix_caching:
            return 0
        hashes = self._prefix_hashes(req)
        req.blocks = self.pool.touch_prefix(hashes, req.token_ids)
        n = len(req.blocks)
        if n < len(hashes) and self.pool.host is not None:
            rb, tokens = self.read_back, req.num_tokens
            choose = None if rb is None else lambda runs: rb.blocks(runs, n, tokens)
            req.load = self.pool.load_prefix(hashes[n:], req.token_ids, n, hashes[n - 1] if n else None, choose)
            if req.load is not None:
                req.blocks += req.load.blocks
        req.block_ids = array("i", [b.block_id for b in req.blocks])
        req.num_computed = req.num_registered = len(req.blocks) * self.block_size
        return req.num_computed

    def uncached_estimate(self, req: Request) -> int:
        """Tokens `req` would compute if admitted now: what its cached prefix does not cover,
        less the slow-tier part of it that `read_back` would recompute (as `match_prefix` takes
        it), so a worker's queued prefill reads as the work it will do."""
        if not self.enable_prefix_caching or req.blocks:
            return req.num_tokens - req.num_computed
        device, runs = self.pool.resident_prefix(self._prefix_hashes(req))
        slow = sum(n for _, n in runs)
        if runs and self.read_back is not None:
            slow = self.read_back.blocks(runs, device, req.num_tokens)
        return req.num_tokens - (device + slow) * self.block_size

    def prefix_resident(self, req: Request) -> bool:
        """Whether every block a prefix hit could cover for `req` is in the cache now."""
        B = self.block_size
        return all(
            self.pool.lookup(h, tuple(req.token_ids[i * B : (i + 1) * B])) is not None
            for i, h in enumerate(self._prefix_hashes(req))
        )

    def blocks_needed(self, req: Request, n_new: int) -> int:
        return max(0, -(-(req.num_computed + n_new) // self.block_size) - len(req.blocks))

    def allocate_slots(self, req: Request, n_new: int) -> bool:
        """Grow the block table to hold `n_new` more tokens; False when the pool is short."""
        need = self.blocks_needed(req, n_new)
        if need:
            if not self.pool.can_allocate(need):
                return False
            new = self.pool.allocate(need)
            req.blocks.extend(new)
            req.block_ids.extend(b.block_id for b in new)
        return True

    def commit(self, req: Request) -> None:
        """Hash and publish the blocks that the last step filled."""
        B = self.block_size
        first, full = req.num_registered // B, req.num_computed // B
        if full <= first or not self.enable_prefix_caching:
            req.num_registered = max(req.num_registered, full * B)
            return
        hashes = self._hashes(req, full)
        tokens = [tuple(req.token_ids[i * B : (i + 1) * B]) for i in range(first, full)]
        parent = hashes[first - 1] if first else None
        self.pool.register(req.blocks[first:full], hashes[first:full], tokens, parent)
        req.num_registered = full * B

    def land(self, req: Request) -> None:
        """The request's copy back is done: its loaded blocks join the prefix cache, and it lets
        go of its whole prefix, to take it again as an ordinary prefix hit when admitted (as a
        P/D decode request does after its import): a queued request holds no blocks."""
        assert req.load is not None
        self.pool.land(req.load)
        req.load = None
        self.free(req)

    def free(self, req: Request) -> None:
        """Let go of the request's blocks; those a copy back is still writing are released to
        the pool, which frees them when it is done."""
        load, req.load = req.load, None
        if load is None:
            self.pool.free(req.blocks)
        else:
            self.pool.free(req.blocks[: len(req.blocks) - len(load.blocks)])
            self.pool.release(load)
        req.blocks, req.block_ids = [], array("i")
        req.num_computed = req.num_registered = 0
