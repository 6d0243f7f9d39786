"""What the scheduler hands an executor each step: plain data, tensorised once by the executor."""

from array import array
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Protocol

from workers.kv.cost_model import StepWork
from workers.sampling_params import SamplingParams


@dataclass
class SeqChunk:
    """One sequence's share of a step.

    The executor computes K/V for `token_ids` at positions start_pos.., writes it into the
    blocks of `block_table`, and, when `sample` is set, returns the next token. `block_table`
    is the sequence's own list and may hold blocks past the chunk: read only the first
    ceil((start_pos + len(token_ids)) / block_size), and never keep or change it.
    `history` is the request's own array of resolved token ids (prompt, then output) where a
    penalty or a bad word reads them (workers/request.py): the sequence so far, less the
    placeholder of `prev_sample`. Read it, never keep or change it.
    """

    token_ids: list[int]
    start_pos: int
    block_table: Sequence[int]  # the request's own int32 array (lists in tests)
    sample: bool
    params: SamplingParams
    output_index: int = 0
    prev_sample: int = -1  # >= 0: token_ids[0] is a placeholder for row prev_sample of the last step's samples
    history: array | None = None

    @property
    def num_prompt(self) -> int:
        """The request's prompt length (a sampling chunk ends its sequence so far)."""
        return self.start_pos + len(self.token_ids) - self.output_index


def is_decode(chunk: SeqChunk) -> bool:
    """Decode work is one token that samples after at least one output token; every other chunk
    computes prompt (or recomputed) tokens and costs a prefill row, even a one-token one (a
    prompt cached but for its last token). The one rule for the step log and the sim's cost."""
    return len(chunk.token_ids) == 1 and chunk.sample and chunk.output_index > 0


def step_work(chunks: list[SeqChunk]) -> StepWork:
    """What a step computes, in the cost model's terms."""
    prefill_tokens, ctx, seqs, kv = 0, 0.0, 0, 0
    for c in chunks:
        n = len(c.token_ids)
        if is_decode(c):
            seqs += 1
            kv += c.start_pos + 1
        else:
            prefill_tokens += n
            ctx += n * (c.start_pos + n / 2)
    return StepWork(prefill_tokens, ctx, seqs, kv)


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

    def allocate_host_cache(self, num_slots: int) -> None:
        """Room for the host tier's `num_slots` blocks (workers/kv/host_pool.py)."""
        ...

    def swap_out(self, block_ids: list[int], slots: list[int]) -> None:
        """Copy device blocks into host slots, block_ids[i] -> slots[i], before any later step."""
        ...

    def swap_in(self, block_ids: list[int], slots: list[int]) -> object | None:
        """Start copying host slots into device blocks, slots[i] -> block_ids[i], after every
        copy and step handed over before it; a handle for `copy_done`, or None when it is done."""
        ...

    def host_fence(self) -> object | None:
        """A handle for `copy_done` of every copy out handed over so far (None: they are done)."""
        ...

    def host_bytes(self, slot: int) -> bytes | memoryview:
        """A host slot's K/V in the layout `import_blocks` takes for one block (the disk tier)."""
        ...

    def copy_done(self, handle: object, wait: bool = False) -> bool:
        """Whether the copy behind a `swap_in` handle has completed (`wait`: block until it has)."""
        ...
