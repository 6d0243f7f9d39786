"""The torch executor: runs one scheduler step of the model over the paged KV cache.

The scheduler hands plain `SeqChunk`s; here they become tensors once per step (token ids,
positions, cache slots, block tables), the model runs once over all tokens of the step, and
logits are computed only for the last token of each chunk that samples.

On CUDA the fast path runs (`kernels`): Triton kernels read the cache in place and fuse norms,
activation and RoPE (workers/kernels), and decode steps replay CUDA graphs
(workers/executors/cuda_graphs.py) unless `enforce_eager`. Elsewhere, plain torch ops and the
gather attention path: the reference the fidelity tests hold against HF.
"""

import time
from array import array
from collections import deque
from dataclasses import dataclass

import torch
from torch import Tensor

from workers.attention import AttentionBatch, PrefillSeq
from workers.executors.batch import SeqChunk
from workers.executors.cuda_graphs import DecodeGraphs
from workers.executors.kv_copies import KVBlockCopies
from workers.executors.kernel_inputs import Staging, decode_inputs, is_decode, kernel_inputs
from workers.models.llama import ModelConfig
from workers.models.loader import default_dtype, load_config, load_model
from workers.logits_processors import process_logits
from workers.generation_defaults import eos_token_ids, read_generation_config
from workers.outputs import TokenLogprobs
from workers.sampling import sample_tensor, to_device, token_logprobs
from workers.sampling_params import SamplingParams

# Shape buckets for the gather path on CUDA (see workers/attention.py): decode batches pad to a
# multiple of SEQ_BUCKET sequences, block tables to a multiple of BLOCK_BUCKET blocks, prefill
# chunks to a multiple of TOKEN_BUCKET tokens. The CPU has no plans to build, and the kernel
# path no cuDNN plans: neither pads.
SEQ_BUCKET, BLOCK_BUCKET, TOKEN_BUCKET = 8, 8, 64


@dataclass
class Launched:
    """A step queued on the device: its sampled tokens (on the device, and on CUDA a copy on its
    way to pinned host memory), the chunk each came from, and its timing (CUDA events, or the
    host time where the step ran in `launch`). `logprobs` is `token_logprobs`' result until
    `collect` turns it into one TokenLogprobs (or None) per chunk."""

    tokens: Tensor | None
    host_tokens: Tensor | None
    rows: list[int]
    num_chunks: int
    events: tuple | None
    host_ms: float
    logprobs: tuple | list | None = None
    replayed: bool = False  # a decode graph replay


@dataclass(frozen=True, slots=True)
class DeviceTiming:
    """One CUDA step's device time, split where its inputs were complete on the device: `waited`
    covers the input copies and any time the device idled for the host to queue them, `computed`
    the forward, sampling and token copy. Steps waiting on the host show as `waited`, not as a
    slower forward."""

    replayed: bool
    waited_ms: float
    computed_ms: float


class TorchRunner(KVBlockCopies):
    """`kernels`: the Triton path (default: on where workers.kernels can run, i.e. CUDA);
    `enforce_eager`: no CUDA graphs; `max_num_seqs`: the largest decode batch a graph covers."""

    computes_logprobs = True  # `collect` fills Launched.logprobs for rows whose params ask

    def __init__(
        self,
        model_dir: str,
        num_blocks: int,
        block_size: int,
        device: str = "cpu",
        dtype: torch.dtype | None = None,
        kernels: bool | None = None,
        enforce_eager: bool = False,
        max_num_seqs: int = 256,
        eos_ids: tuple[int, ...] | None = None,
    ):
        hf_config = load_config(model_dir)
        self.config = ModelConfig.from_hf(hf_config)
        self.device = torch.device(device)
        self.dtype = dtype or default_dtype(self.device)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.vocab_size = self.config.vocab_size
        self.max_model_len = self.config.max_position_embeddings
        self.num_layers = self.config.num_layers
        self.num_kv_heads = self.config.num_kv_heads
        self.head_dim = self.config.head_dim
        self.kv_bytes_per_token = kv_bytes_per_token(self.config, self.dtype)
        self.eos_token_ids = eos_ids if eos_ids is not None else default_eos_ids(model_dir, hf_config)
        cuda = self.device.type == "cuda"
        self.kernels = kernels_available(self.device) if kernels is None else kernels
        gather_on_cuda = cuda and not self.kernels
        self.seq_bucket, self.block_bucket, self.token_bucket = (
            (SEQ_BUCKET, BLOCK_BUCKET, TOKEN_BUCKET) if gather_on_cuda else (1, 1, 1)
        )
        self.model = load_model(model_dir, self.config, self.device, self.dtype, self.kernels)
        # One tensor for the whole cache, so read_blocks/write_blocks are single index ops.
        self.kv_cache = torch.zeros(
            self.num_layers,
            2,
            num_blocks,
            block_size,
            self.num_kv_heads,
            self.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        for i, attn in enumerate(self.model.attention_layers()):
            attn.k_cache, attn.v_cache = self.kv_cache[i, 0], self.kv_cache[i, 1]
        self.staging = Staging(self.device) if self.kernels else None
        self._last_sampled: Tensor | None = None
        self.graphs: DecodeGraphs | None = None
        self.timings: deque[DeviceTiming] = deque(maxlen=1 << 16)  # the latest CUDA steps' device time
        if self.kernels and cuda:
            self.warmup()
        if self.kernels and cuda and not enforce_eager:
            with torch.inference_mode():
                max_blocks = min(num_blocks, -(-self.max_model_len // block_size))
                self.graphs = DecodeGraphs(self._decode_logits, max_num_seqs, max_blocks, self.device, lambda bs: None)

    @property
    def overlaps(self) -> bool:
        """`launch` returns before the device has run the step (CUDA): the engine may plan the
        next step meanwhile (workers/inflight.py)."""
        return self.device.type == "cuda"

    def execute(self, chunks: list[SeqChunk]) -> list[int | None]:
        """Run one step; one entry per chunk: the sampled token, or None when not sampling."""
        return self.collect(self.launch(chunks))[0]

    def launch(self, chunks: list[SeqChunk]) -> Launched:
        """Queue one step on the device and return without waiting for it. A chunk with
        `prev_sample` >= 0 takes its input token from that row of the previous launch's samples."""
        t0 = time.perf_counter()
        sampled = [i for i, c in enumerate(chunks) if c.sample]
        cuda = self.device.type == "cuda"
        events = tuple(torch.cuda.Event(enable_timing=True) for _ in range(3)) if cuda else None
        host = None
        with torch.inference_mode():
            if events:
                events[0].record()
            replays = self._replays(chunks)
            logits = self._logits(chunks, sampled, events[1] if events else None, replays)
            tokens, logprobs = None, None
            if logits is not None:
                rows = [chunks[i] for i in sampled]
                params = [c.params for c in rows]
                processed = process_logits(logits, rows, self.eos_token_ids, self._last_sampled)
                tokens = sample_tensor(processed, params, [c.output_index for c in rows])
                logprobs = token_logprobs(logits, tokens, params)
            if events:
                # Copied out now, in stream order: read later, after the next step was queued, the
                # copy would wait for that step too.
                if tokens is not None:
                    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
                    host.copy_(tokens, non_blocking=True)
                events[2].record()
        self._last_sampled = tokens
        return Launched(
            tokens,
            host,
            sampled,
            len(chunks),
            events,
            (time.perf_counter() - t0) * 1000,
            logprobs,
            replays,
        )

    def collect(self, step: Launched) -> tuple[list[int | None], float]:
        """A launched step's tokens (one entry per chunk, None where it did not sample) and its
        device time in ms; waits for the device to finish that step."""
        results: list[int | None] = [None] * step.num_chunks
        if step.events is not None:
            step.events[2].synchronize()
        if step.tokens is not None:
            values = (step.tokens if step.host_tokens is None else step.host_tokens).tolist()
            for i, token in zip(step.rows, values):
                results[i] = token
        step.logprobs = _host_logprobs(step, results)
        if step.events is None:
            return results, step.host_ms
        start, ready, end = step.events
        waited, computed = start.elapsed_time(ready), ready.elapsed_time(end)
        self.timings.append(DeviceTiming(step.replayed, waited, computed))
        return results, waited + computed

    def warmup(self) -> None:
        """Run one step of each kind the kernels specialise on (long and short prefill chunks,
        a mixed step, split and unsplit decodes) over scratch blocks, so Triton compiles them now
        and not inside a client's first requests (seconds each). The scratch K/V is zeroed after."""
        b, greedy = self.block_size, SamplingParams(temperature=0.0)
        long = min(512, (self.num_blocks - 1) * b, self.max_model_len - 1)
        table = list(range(-(-(long + 1) // b)))
        steps = [
            [SeqChunk([0] * long, 0, table, True, greedy)],
            [SeqChunk([0], long, table, True, greedy), SeqChunk([0] * 8, 0, table, True, greedy)],
            [SeqChunk([0], long, table, True, greedy)] * 64,
            [SeqChunk([0], long, table, True, greedy)],
        ]
        for chunks in steps:
            self.execute(chunks)
        self.kv_cache.zero_()
        torch.cuda.synchronize(self.device)

    def _replays(self, chunks: list[SeqChunk]) -> bool:
        """Whether this step is a decode graph replay (decode steps a captured batch size covers)."""
        return self.graphs is not None and len(chunks) <= self.graphs.max_num_seqs and is_decode(chunks)

    def _logits(
        self, chunks: list[SeqChunk], sampled: list[int], ready: "torch.cuda.Event | None", replays: bool
    ) -> Tensor | None:
        """Logits of the sampled rows: a graph replay for a decode step it covers (`replays`),
        else eager. `ready` is recorded once the step's inputs are on the device, just before
        the forward."""
        if replays:
            assert self.graphs is not None
            d = decode_inputs(chunks, self.block_size)
            any_row = max(d.sample_src, default=-1) >= 0
            return self.graphs.run(d, lambda ids, src: self._fill_rows(ids, src, any_row, ready))
        ends = _chunk_ends(chunks)
        patch = [(ends[i], c.prev_sample) for i, c in enumerate(chunks) if c.prev_sample >= 0]
        if self.staging is not None:
            input_ids, positions, batch = kernel_inputs(chunks, self.block_size, self.staging)
        else:
            input_ids, positions, batch = self._prepare(chunks)
        self._fill(input_ids, patch, ready)
        hidden = self.model(input_ids, positions, batch)
        if not sampled:
            return None
        if len(sampled) == len(hidden):
            return self.model.compute_logits(hidden)
        return self.model.compute_logits(hidden[to_device([ends[i] for i in sampled], torch.long, self.device)])

    def _fill(self, input_ids: Tensor, patch: list[tuple[int, int]], ready: "torch.cuda.Event | None" = None) -> None:
        """Write the previous launch's sampled tokens into the rows whose input was a placeholder;
        then record `ready`: the step's inputs are complete on the device."""
        if patch:
            rows, src = zip(*patch)
            index = to_device(list(rows), torch.long, self.device)
            input_ids[index] = self._last_sampled[to_device(list(src), torch.long, self.device)].to(input_ids.dtype)
        if ready is not None:
            ready.record()

    def _fill_rows(self, input_ids: Tensor, src: Tensor, any_row: bool, ready: "torch.cuda.Event | None") -> None:
        """`_fill` for a graph replay, whose rows' sources (`src`, -1: none) came up with its
        inputs: a gather and a select on the device, no index tensors built per step."""
        if any_row:
            assert self._last_sampled is not None
            taken = self._last_sampled.index_select(0, src.clamp(min=0)).to(input_ids.dtype)
            input_ids.copy_(torch.where(src >= 0, taken, input_ids))
        if ready is not None:
            ready.record()

    def _decode_logits(self, input_ids: Tensor, positions: Tensor, batch) -> Tensor:
        """The decode graphs' body: every row samples."""
        return self.model.compute_logits(self.model(input_ids, positions, batch))

    def _prepare(self, chunks: list[SeqChunk]) -> tuple[Tensor, Tensor, AttentionBatch]:
        """Flatten the chunks into the step's tensors; the only per-token Python work of a step."""
        b = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_rows, decode_tables, decode_lens = [], [], []
        prefills: list[PrefillSeq] = []
        for chunk in chunks:
            row, n = len(input_ids), len(chunk.token_ids)
            end = chunk.start_pos + n
            table = list(chunk.block_table[: (end + b - 1) // b])
            input_ids += chunk.token_ids
            positions += range(chunk.start_pos, end)
            slots += [table[p // b] * b + p % b for p in range(chunk.start_pos, end)]
            if n == 1:
                decode_rows.append(row)
                decode_tables.append(table)
                decode_lens.append(end)
            else:
                prefills.append(
                    PrefillSeq(
                        slice(row, row + n),
                        chunk.start_pos,
                        self._tensor(table + [0] * (-len(table) % self.block_bucket)),
                    )
                )
        num_decodes = len(decode_rows)
        pad = -num_decodes % self.seq_bucket
        batch = AttentionBatch(
            slot_mapping=self._tensor(slots),
            decode_rows=self._tensor(decode_rows + [0] * pad),
            decode_tables=self._table_tensor(decode_tables + [[]] * pad),
            decode_lens=self._tensor(decode_lens + [1] * pad),
            prefills=prefills,
            num_decodes=num_decodes,
            bucket=self.token_bucket,
        )
        return self._tensor(input_ids), self._tensor(positions), batch

    def _tensor(self, values: list) -> Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _table_tensor(self, tables: list[list[int]]) -> Tensor:
        """The decode block tables as one [seqs, width] tensor, padded with block 0 (masked
        out) to a multiple of the block bucket. Filled through a flat int64 array rather than `torch.tensor` of nested lists:
        `_prepare` for 256 decodes of 2.2k tokens went from 2.97 to 1.70 ms, on the thread the
        GPU waits for."""
        width = max(map(len, tables), default=0)
        width += -width % self.block_bucket
        flat, pad = array("q"), [0] * width
        for t in tables:
            flat.extend(t)
            flat.extend(pad[: width - len(t)])
        if not flat:
            return torch.zeros((len(tables), width), dtype=torch.long, device=self.device)
        return torch.frombuffer(flat, dtype=torch.long).view(len(tables), width).to(self.device)


def _host_logprobs(step: Launched, tokens: list[int | None]) -> list[TokenLogprobs | None] | None:
    """`token_logprobs`' tensors as one TokenLogprobs per chunk (None where not asked for)."""
    if step.logprobs is None:
        return None
    rows, ks, chosen, top_ids, top_values = step.logprobs
    out: list[TokenLogprobs | None] = [None] * step.num_chunks
    ids = top_ids.tolist() if top_ids is not None else [[] for _ in rows]
    values = top_values.tolist() if top_values is not None else ids
    for row, k, lp, t, v in zip(rows, ks, chosen.tolist(), ids, values):
        chunk = step.rows[row]
        out[chunk] = TokenLogprobs(tokens[chunk], lp, list(zip(t[:k], v[:k])))
    return out


def kernels_available(device: torch.device) -> bool:
    """Whether the Triton path can run on `device` (workers.kernels decides; CPU never by default)."""
    try:
        from workers.kernels import available
    except ImportError:
        return False
    return available(device)


def _chunk_ends(chunks: list[SeqChunk]) -> list[int]:
    """Flat row of each chunk's last token."""
    ends, total = [], 0
    for chunk in chunks:
        total += len(chunk.token_ids)
        ends.append(total - 1)
    return ends


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


def blocks_that_fit(model_dir: str, memory_bytes: int, block_size: int, dtype: torch.dtype) -> int:
    """How many KV blocks a memory budget holds, before building a runner (to size `num_blocks`)."""
    cfg = ModelConfig.from_hf(load_config(model_dir))
    return memory_bytes // (block_size * kv_bytes_per_token(cfg, dtype))


def default_eos_ids(model_dir: str, hf_config: dict) -> tuple[int, ...]:
    """A runner's EOS ids when its caller has no tokenizer to name the first (the worker's
    command line does: workers/cli.py): config.json's first, then the generation config's."""
    primary = hf_config.get("eos_token_id")
    first = primary[0] if isinstance(primary, list) and primary else primary
    return eos_token_ids(read_generation_config(model_dir), first if type(first) is int else None)
