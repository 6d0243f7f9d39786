"""What the scheduler hands an executor each step: plain data, tensorised once by the executor."""
from dataclasses import dataclass
from typing import Protocol

from workers.sampling_params import SamplingParams


@dataclass
class SeqChunk:
    """One sequence's share of a step.

    The executor computes K/V for `token_ids` at positions start_pos.., writes it into the
    blocks of `block_table`, and, when `sample` is set, returns the next token. `block_table`
    is the sequence's own list and may hold blocks past the chunk: read only the first
    ceil((start_pos + len(token_ids)) / block_size), and never keep or change it.
    """
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool
    params: SamplingParams
    output_index: int = 0
    prev_sample: int = -1  # >= 0: token_ids[0] is a placeholder for row prev_sample of the last step's samples


class Executor(Protocol):
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_model_len: int

    def execute(self, chunks: list[SeqChunk]) -> list[int | None]:
        """Run one step; one entry per chunk: the sampled token, or None when not sampling."""
        ...

    def read_blocks(self, block_ids: list[int]):
        """A copy of these blocks' K/V, [layers, 2, n, block_size, kv_heads, head_dim] (P/D export)."""
        ...

    def to_bytes(self, kv) -> bytes:
        """`read_blocks`' result in the transfer payload layout (workers/transfer.py)."""
        ...

    def import_blocks(self, block_ids: list[int], data, positions: list[int], total: int) -> None:
        """Write blocks `positions` of a `total`-block payload (bytes, or a tensor shaped as
        read_blocks returns) into `block_ids` (P/D import); safe off the engine thread for
        blocks no step reads."""
        ...
