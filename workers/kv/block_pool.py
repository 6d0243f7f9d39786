"""The paged KV block pool with a hash-indexed prefix cache.

Blocks are fixed-size (B tokens) and ref-counted. A block whose ref count drops to zero keeps
its hash and contents ("cached but free") until it is reused; reuse evicts the least recently
freed cached block, after first using blocks that never held a full hashed block. Every change
of residency (a hash registered, a hash evicted, the cache cleared) goes to the event log.
"""
from collections import OrderedDict
from dataclasses import dataclass, field

from workers.kv.events import CLEARED, REMOVED, STORED, EventLog


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = field(default=())


class BlockPool:
    """Ref-counted blocks, an O(1) free list, and the hash -> block prefix-cache map."""

    def __init__(self, num_blocks: int, block_size: int, events: EventLog):
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.events = events
        self._free_plain: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self._by_hash: dict[int, int] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self._free_plain) + len(self._free_cached)

    def lookup(self, h: int, token_ids: tuple[int, ...]) -> Block | None:
        """The cached block for hash `h` whose tokens really are `token_ids`, if any."""
        bid = self._by_hash.get(h)
        if bid is None:
            return None
        block = self.blocks[bid]
        return block if block.token_ids == token_ids else None

    def touch(self, block: Block) -> None:
        """Take a reference on a cached block (a prefix hit)."""
        if block.ref_count == 0:
            del self._free_cached[block.block_id]
        block.ref_count += 1

    def can_allocate(self, n: int) -> bool:
        return self.num_free >= n

    def allocate(self, n: int) -> list[Block]:
        """n fresh blocks (ref 1); evicts cached-free blocks LRU-first when plain ones run out."""
        if n > self.num_free:
            raise RuntimeError(f"out of KV blocks: need {n}, have {self.num_free}")
        out, evicted = [], []
        for _ in range(n):
            if self._free_plain:
                bid, _ = self._free_plain.popitem(last=False)
            else:
                bid, _ = self._free_cached.popitem(last=False)
                evicted.append(self._evict(self.blocks[bid]))
            block = self.blocks[bid]
            block.ref_count = 1
            out.append(block)
        if evicted:
            self.events.append(REMOVED, tuple(evicted))
        return out

    def _evict(self, block: Block) -> int:
        h = block.hash
        del self._by_hash[h]
        block.hash, block.token_ids = None, ()
        return h

    def free(self, blocks: list[Block]) -> None:
        """Drop one reference from each block; a sequence's tail goes first in eviction order."""
        for block in reversed(blocks):
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block.block_id} freed twice"
            if block.ref_count == 0:
                if block.hash is None:
                    self._free_plain[block.block_id] = None
                else:
                    self._free_cached[block.block_id] = None

    def register(self, blocks: list[Block], hashes: list[int], tokens: list[tuple[int, ...]],
                 parent: int | None) -> None:
        """Record newly filled blocks in the prefix cache and emit `stored` events.

        A hash already owned by another block stays with that block (the duplicate is simply
        not cached), so the map and the published residency never disagree; each event holds
        one unbroken run of the chain and names the hash before it as `parent`.
        """
        run: list[int] = []
        run_parent, prev = parent, parent
        for block, h, toks in zip(blocks, hashes, tokens):
            if block.hash is None and h not in self._by_hash:
                block.hash, block.token_ids = h, toks
                self._by_hash[h] = block.block_id
                if not run:
                    run_parent = prev
                run.append(h)
            elif run:
                self.events.append(STORED, tuple(run), run_parent)
                run = []
            prev = h
        if run:
            self.events.append(STORED, tuple(run), run_parent)

    def resident_hashes(self) -> list[int]:
        return list(self._by_hash)

    def clear_cache(self) -> int:
        """Forget every cached-but-free block (e.g. after a weight reload); returns how many."""
        evicted = []
        while self._free_cached:
            bid, _ = self._free_cached.popitem(last=False)
            evicted.append(self._evict(self.blocks[bid]))
            self._free_plain[bid] = None
        if not self._by_hash:
            self.events.append(CLEARED)
        elif evicted:
            self.events.append(REMOVED, tuple(evicted))
        return len(evicted)
