"""The `sim` executor: no model; each step takes the time the cost model predicts.

It runs the real scheduler, block pool and events, so fleets of realistic workers fit on a
CPU, and the fleet simulator drives it in virtual time by passing its own `wait`.
"""

import time
from collections.abc import Callable

from workers.executors.batch import SeqChunk, step_work
from workers.kv.cost_model import CostModel


class SimExecutor:
    """Emits deterministic token ids (never EOS) after waiting the modelled step time. It has no
    logits: penalties, logit_bias, min_p, allowed_token_ids and bad_words change none of its
    tokens (the requests are still checked as a real worker checks them); min_tokens holds back
    an early stop token of its in the scheduler (`check_stop`) and stop strings in the
    detokenizer."""

    def __init__(
        self,
        cost: CostModel,
        vocab_size: int,
        eos_token_ids: tuple[int, ...] = (),
        max_model_len: int = 8192,
        wait: Callable[[float], None] = time.sleep,
        first_token_id: int = 256,
        kv_bytes_per_token: int = 36864,
        token: Callable[[SeqChunk], int] | None = None,
    ):
        """`token` replaces the default rule for the sampled token (the fleet simulator's, when
        a test compares the engine with it)."""
        self.cost = cost
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.wait = wait
        self.first_token_id = min(first_token_id, vocab_size // 2)
        self.kv_bytes_per_token = kv_bytes_per_token
        self.last_step_ms = 0.0
        self.token = token or self._token

    def step_ms(self, chunks: list[SeqChunk]) -> float:
        return self.cost.work_ms(step_work(chunks))

    def _token(self, chunk: SeqChunk) -> int:
        pos = chunk.start_pos + len(chunk.token_ids)
        x = (chunk.token_ids[-1] * 1103515245 + pos * 12345 + (chunk.params.seed or 0)) & 0x7FFFFFFF
        span = self.vocab_size - self.first_token_id
        tok = self.first_token_id + x % span
        while tok in self.eos_token_ids:
            tok = self.first_token_id + (tok + 1 - self.first_token_id) % span
        return tok

    def execute(self, chunks: list[SeqChunk]) -> list[int | None]:
        self.last_step_ms = self.step_ms(chunks)
        self.wait(self.last_step_ms / 1000.0)
        return [self.token(c) if c.sample else None for c in chunks]

    def read_blocks(self, block_ids: list[int]) -> bytes:
        """Sim blocks carry no K/V data; P/D between sim workers moves hashes and tokens only."""
        return b""

    @staticmethod
    def to_bytes(kv: bytes) -> bytes:
        return kv

    def import_blocks(self, block_ids: list[int], data, positions: list[int], total: int) -> None:
        return None

    def allocate_host_cache(self, num_slots: int) -> None:
        """Sim blocks carry no K/V: the host tier is residency only (its cost is the simulator's)."""

    def swap_out(self, block_ids: list[int], slots: list[int]) -> None:
        return None

    def swap_in(self, block_ids: list[int], slots: list[int]) -> None:
        return None

    def host_fence(self) -> None:
        return None

    def host_bytes(self, slot: int) -> bytes:
        return b""

    @staticmethod
    def copy_done(handle: object, wait: bool = False) -> bool:
        return True
