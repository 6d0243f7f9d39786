"""A block pool under random operations, for the tier state-machine tests: a shadow of the bytes
every device block and host slot holds follows the pool's copies, so a block that comes back
holding other bytes shows. The operations both tier tests run (alloc, free, land, abort, and
draining what is left) live here once; each test adds its own."""

from dataclasses import dataclass, field

from workers.kv.block_pool import BlockPool
from workers.kv.host_pool import SWAP_OUT


@dataclass
class TierShadow:
    """Copies out run at once (`flush`), a copy back as late as it may (when its load lands)."""

    pool: BlockPool
    num_slots: int
    device: dict[int, tuple] = field(default_factory=dict)
    host: dict[int, tuple] = field(default_factory=dict)
    held: list = field(default_factory=list)
    loading: list = field(default_factory=list)  # loads in flight, their request waiting
    released: list = field(default_factory=list)  # loads in flight, their request gone

    def flush(self) -> None:
        for batch in self.pool.take_copies():
            if batch.direction == SWAP_OUT:
                for bid, slot in zip(batch.block_ids, batch.slots):
                    self.host[slot] = self.device.get(bid)

    def copy_back(self, load) -> None:
        for b, slot in zip(load.blocks, load.slots):
            self.device[b.block_id] = self.host.get(slot)
        load.done = True

    def alloc(self, n: int) -> None:
        """Take `n` blocks, when there is room; a step writes other K/V there."""
        if self.pool.can_allocate(n):
            new = self.pool.allocate(n)
            self.flush()
            for b in new:
                self.device[b.block_id] = ("garbage", b.block_id)
            self.held += new

    def free(self, n: int) -> None:
        if self.held:
            k = min(len(self.held), n + 1)
            self.pool.free(self.held[:k])
            self.held = self.held[k:]

    def land(self, n: int):
        """Copy back and land one load in flight (its request waiting or gone); returns it."""
        load = (self.loading + self.released)[n % len(self.loading + self.released)]
        self.copy_back(load)
        if load in self.released:
            self.released.remove(load)
            self.pool.land_released()
        else:
            self.loading.remove(load)
            self.pool.land(load)
            self.held += load.blocks
        return load

    def abort(self, n: int) -> None:
        """The request of a load in flight goes away."""
        if self.loading:
            load = self.loading.pop(n % len(self.loading))
            self.pool.release(load)
            self.released.append(load)

    def check_totals(self) -> None:
        """Both tiers' counts add up, with loads in flight and loads whose request ended."""
        loads = self.loading + self.released
        in_use = {b.block_id for b in self.held} | {b.block_id for ld in loads for b in ld.blocks}
        assert self.pool.num_free + len(in_use) == self.pool.num_blocks
        assert self.pool.host.num_free + len(self.pool.host) + self.pool.host.num_draining == self.num_slots

    def drain(self) -> None:
        """Land every load in flight and free every block held."""
        for load in self.loading + self.released:
            self.copy_back(load)
            if load in self.loading:
                self.pool.land(load)
                self.held += load.blocks
        self.pool.land_released()
        self.pool.free(self.held)
