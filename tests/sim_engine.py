"""A sim-executor engine stepped by hand, for fast engine and scheduler tests."""

from workers.config import EngineConfig
from workers.engine import Engine
from workers.executors.sim import SimExecutor
from workers.kv.cost_model import CostModel


class CharTokenizer:
    """Token i decodes to one letter; enough for detokenization and stop strings."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids if not (skip_special_tokens and i == 2))


class SlowCopies:
    """An executor's copies back complete `copy_steps` steps after they were issued (the bytes,
    if any, move at once): the engine must keep stepping other requests meanwhile. The executor
    calls `tick` once per step."""

    def __init__(self, *args, copy_steps: int = 3, **kw):
        super().__init__(*args, **kw)
        self.copy_steps = copy_steps
        self.copies: list[list[int]] = []

    def swap_in(self, block_ids: list[int], slots: list[int]) -> list[int]:
        super().swap_in(block_ids, slots)  # type: ignore[misc]
        handle = [self.copy_steps]
        self.copies.append(handle)
        return handle

    def copy_done(self, handle: list[int], wait: bool = False) -> bool:
        if wait:
            handle[0] = 0
        return handle[0] <= 0

    def tick(self) -> None:
        for handle in self.copies:
            handle[0] -= 1


class SlowCopySim(SlowCopies, SimExecutor):
    def execute(self, chunks):
        self.tick()
        return super().execute(chunks)


def sim_engine(num_blocks=64, block_size=4, max_batched_tokens=32, max_num_seqs=8, copy_steps=0, **kw) -> Engine:
    """`copy_steps`: copies back (with a host tier: host_blocks=N) complete that many steps late."""
    args = dict(vocab_size=1000, eos_token_ids=(2,), max_model_len=4096, wait=lambda s: None, first_token_id=3)
    ex = SlowCopySim(CostModel(), copy_steps=copy_steps, **args) if copy_steps else SimExecutor(CostModel(), **args)
    return Engine(
        ex,
        CharTokenizer(),
        EngineConfig(
            "m",
            block_size=block_size,
            num_blocks=num_blocks,
            max_batched_tokens=max_batched_tokens,
            max_num_seqs=max_num_seqs,
            **kw,
        ),
    )


def drain(engine: Engine, limit: int = 100000) -> int:
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
        assert steps < limit, "engine did not drain: deadlock?"
    return steps
