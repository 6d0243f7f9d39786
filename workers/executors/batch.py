"""What the scheduler hands an executor each step: plain data, tensorised once by the executor."""
from dataclasses import dataclass
from typing import Protocol

from workers.sampling_params import SamplingParams


@dataclass
class SeqChunk:
    """One sequence's share of a step.

    The executor computes K/V for `token_ids` at positions start_pos.., writes it into the
    blocks of `block_table`, and, when `sample` is set, returns the next token.
    """
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool
    params: SamplingParams
    output_index: int = 0


class Executor(Protocol):
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_model_len: int

    def execute(self, chunks: list[SeqChunk]) -> list[int | None]:
        """Run one step; one entry per chunk: the sampled token, or None when not sampling."""
        ...

    def read_blocks(self, block_ids: list[int]):
        """K/V of these blocks as one tensor [layers, 2, len(block_ids), block_size, kv_heads, head_dim]."""
        ...

    def write_blocks(self, block_ids: list[int], kv) -> None:
        """Write a tensor shaped as `read_blocks` returns into these blocks (P/D import)."""
        ...
