"""A request as the engine tracks it: plain data that the scheduler and KV manager mutate."""

import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

from workers.kv.block_pool import Block, Load
from workers.sampling_params import SamplingParams

WAITING, RUNNING, FINISHING, FINISHED = "waiting", "running", "finishing", "finished"


@dataclass(eq=False, slots=True)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_cached: int = -1
    blocks: list[Block] = field(default_factory=list)
    block_ids: array = field(default_factory=lambda: array("i"))  # blocks' ids beside them: the steps' table rows
    block_hashes: list[int] = field(default_factory=list)
    num_registered: int = 0
    queued_tokens: int = 0  # the prefill work it adds while waiting (set when queued)
    status: str = WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    scheduled_at: float | None = None  # first admitted to the running batch
    first_token_at: float | None = None
    chunks: list | None = None  # (launched, resolved, tokens) of its prefill chunks, kept when traced
    kv_deadline: float | None = None
    export: Callable | None = None
    num_exported: int = 0  # full prompt blocks handed to `export` so far
    cache_salt: str | None = None  # folded into the block-hash seed: salts never share blocks
    unresolved: int = 0  # trailing tokens sampled by launched steps, not read yet (workers/inflight.py)
    sample_row: int = -1  # this request's row among the last launched step's sampled tokens
    load: Load | None = None  # its prefix's copy back from the host tier, until it lands
    # its resolved token ids (prompt, then output; no placeholder), kept only when a penalty or a
    # bad word reads them: a step copies it (or its tail) without a Python loop, the history grows
    # by its resolved tokens
    history: array | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)
        if self.history is None and self.params.reads_history:
            self.history = array("q", self.token_ids)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt :]

    @property
    def num_output(self) -> int:
        """Output tokens known so far (placeholders of launched steps not counted)."""
        return len(self.token_ids) - len(self.prompt_ids) - self.unresolved

    @property
    def num_remaining(self) -> int:
        """Tokens whose K/V is not computed yet (prompt, or recompute after preemption)."""
        return len(self.token_ids) - self.num_computed

    @property
    def is_prefilling(self) -> bool:
        """Whether the next step computes prompt tokens (or recomputes after preemption).
        Asked of every running request every step, so it reads the fields directly."""
        done = self.num_computed
        return len(self.token_ids) - done > 1 or done < len(self.prompt_ids)
