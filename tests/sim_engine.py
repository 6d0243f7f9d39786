"""A sim-executor engine stepped by hand, for fast engine and scheduler tests."""

from workers.engine import Engine, EngineConfig
from workers.executors.sim import SimExecutor
from workers.kv.cost_model import CostModel


class CharTokenizer:
    """Token i decodes to one letter; enough for detokenization and stop strings."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids if not (skip_special_tokens and i == 2))


def sim_engine(num_blocks=64, block_size=4, max_batched_tokens=32, max_num_seqs=8, **kw) -> Engine:
    ex = SimExecutor(
        CostModel(), vocab_size=1000, eos_token_ids=(2,), max_model_len=4096, wait=lambda s: None, first_token_id=3
    )
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
