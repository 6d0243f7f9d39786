"""vLLM's logits processors that can change the argmax: allowed_token_ids, min_tokens, logit_bias,
the repetition, frequency and presence penalties and bad_words, in the order of vLLM 0.32's (V2)
GPU runner, before greedy picks and before temperature (min_p, which keeps the argmax, is applied
after temperature in workers/sampling.py). The masks (allowed_token_ids, min_tokens, bad_words)
set -inf, which a bias and the penalties keep, so their place in the order changes nothing: vLLM's
V1 runner, which masks allowed_token_ids and bad_words first, samples the same.

Plain data until here. Only the rows that ask are gathered, once per step: what they need goes to
the device in one copy of integers and one of floats (pinned memory, asynchronous), and their
token counts are built there from their token ids, as vLLM v1 does. A penalised row's ids are its
request's history (workers/request.py), an array grown as its tokens resolve, so the host copies
it whole rather than rebuilding it token by token each step; a bad word's prefix is compared on
the device with the history's tail, as long as the row's longest usable prefix. A row's logit
biases, stop ids, allowed ids and bad words come as arrays built with its params, their rows
spread on the device. A step where no row asks gets its logits back untouched: no tensor, no copy.
A row whose last token is a placeholder (the sample of a step launched but not read yet,
workers/inflight.py) takes it from that step's tokens on the device, so nothing waits for the
step before.
"""

import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Generic, TypeVar

import torch
from torch import Tensor

from workers.executors.batch import SeqChunk

# repetition_penalty is any finite number > 0 (vLLM); the device divides and multiplies by it
# clamped here, where float32 logits stay finite (a penalty past float32's range made inf * 0 NaN).
REPETITION_RANGE = (2.0**-100, 2.0**100)
HOLE = array("q", [0])  # a placeholder's slot among a row's ids, written over on the device
T = TypeVar("T")


@dataclass
class Ints(Generic[T]):
    """A step's integer data, by name: arrays while `_gather` fills them, tensors once uploaded."""

    index: T  # the asking rows, among the step's
    allowed_rows: T  # the rows with allowed_token_ids, among the asking ones
    allowed_counts: T  # how many each allows
    allowed_ids: T  # and which
    mask_counts: T  # per row: how many tokens min_tokens masks
    mask_ids: T  # and which
    bias_counts: T  # per row: how many tokens its logit_bias raises
    bias_ids: T  # and which
    lengths: T  # per penalised row: its sequence's length
    prompts: T  # and its prompt's
    pen_rows: T  # the penalised rows, among the asking ones
    holes: T  # the penalised rows (by their order) whose last id is a placeholder
    sources: T  # and the rows of the previous launch's samples they take
    bad_rows: T  # per usable bad-word sequence: its row, among the asking ones
    bad_ends: T  # where its row's tail ends among `bad_tails`
    bad_lengths: T  # its prefix's length
    bad_last: T  # its last token, banned where the tail ends with its prefix
    bad_prefix: T  # the prefixes' tokens, sequence after sequence
    bad_back: T  # each one's distance from its sequence's end, so from its tail's end
    bad_tails: T  # each bad-words row's last tokens, as many as its longest usable prefix
    tail_holes: T  # placeholder positions among `bad_tails`
    tail_sources: T  # and the rows of the previous launch's samples they take


@dataclass
class Floats(Generic[T]):
    """A step's float data, by name, as `Ints`."""

    biases: T  # the logit biases, beside `Ints.bias_ids`
    presence: T  # per penalised row: its three penalties
    frequency: T
    repetition: T


def process_logits(
    logits: Tensor, chunks: Sequence[SeqChunk], stop_ids: Sequence[int], prev_sampled: Tensor | None
) -> Tensor:
    """`logits` [n, V] of the sampling `chunks` as vLLM processes them before sampling: where a row
    has `allowed_token_ids`, every other token is -inf; while it has emitted fewer than
    `min_tokens`, its stop tokens (`stop_ids`, the model's EOS, and its own `stop_token_ids`) are
    -inf; then its `logit_bias` is added; then the repetition penalty (on tokens of the prompt or
    output: a positive logit divided by it, a negative one multiplied), the frequency penalty (times
    the token's count in the output) and the presence penalty (once for a token in the output) are
    applied; then each bad-word sequence whose prefix ends the output bans its last token (-inf).
    `prev_sampled`: the previous launch's sampled tokens, which placeholders name by row.

    A batch where no row asks returns `logits` itself; otherwise a float32 copy (vLLM processes in
    float32), `logits` left raw for the logprobs (vLLM reports raw logprobs: its masks do not
    touch them either)."""
    rows = [i for i, c in enumerate(chunks) if c.params.processes_logits(c.output_index)]
    if not rows:
        return logits
    ints, floats, histories = _gather(chunks, rows, stop_ids)
    device = logits.device
    *parts, flat = _upload(list(vars(ints).values()), torch.long, device, histories)
    i, f = Ints(*parts), Floats(*_upload(list(vars(floats).values()), torch.float32, device))
    out = logits.to(torch.float32, copy=True)
    x = out[i.index]
    if i.allowed_rows.numel():
        _allow_only(x, i.allowed_rows, i.allowed_counts, i.allowed_ids)
    x[_rows_of(i.mask_counts, i.mask_ids.numel()), i.mask_ids] = float("-inf")
    x.index_put_((_rows_of(i.bias_counts, i.bias_ids.numel()), i.bias_ids), f.biases, accumulate=True)
    if i.pen_rows.numel():
        if i.holes.numel():
            _fill(flat, i.lengths.cumsum(0)[i.holes] - 1, prev_sampled, i.sources)
        seen, counts = _token_counts(flat, i.lengths, i.prompts, logits.shape[1])
        x[i.pen_rows] = apply_penalties(x[i.pen_rows], seen, counts, f.presence, f.frequency, f.repetition)
    if i.bad_rows.numel():
        if i.tail_holes.numel():
            _fill(i.bad_tails, i.tail_holes, prev_sampled, i.tail_sources)
        _ban_bad_words(x, i)
    out[i.index] = x
    return out


def _fill(ids: Tensor, holes: Tensor, prev_sampled: Tensor | None, sources: Tensor) -> None:
    """In place: the placeholders of `ids` at `holes` take the previous launch's samples `sources`."""
    assert prev_sampled is not None, "a placeholder without a launched step before it"
    ids[holes] = prev_sampled[sources]


def _allow_only(x: Tensor, rows: Tensor, counts: Tensor, ids: Tensor) -> None:
    """In place: the `rows` of `x` -inf but for their allowed `ids` (`counts` each)."""
    row_of = rows.repeat_interleave(counts, output_size=ids.numel())
    kept = x[row_of, ids]
    x[rows] = float("-inf")
    x[row_of, ids] = kept


def _ban_bad_words(x: Tensor, i: Ints[Tensor]) -> None:
    """In place: -inf at each usable bad-word sequence's last token, in its row, where the row's
    tail ends with the sequence's prefix (every prefix token equals the tail's token as far from
    its end). One token banned twice is banned (the least of -inf and the logit), never unbanned
    by a sequence that does not match."""
    seq_of = _rows_of(i.bad_lengths, i.bad_prefix.numel())
    mismatched = i.bad_tails[i.bad_ends[seq_of] - i.bad_back] != i.bad_prefix
    misses = torch.zeros(i.bad_rows.numel(), dtype=torch.long, device=x.device).index_add_(0, seq_of, mismatched.long())
    banned = torch.where(misses == 0, -math.inf, math.inf)
    x.view(-1).scatter_reduce_(0, i.bad_rows * x.shape[1] + i.bad_last, banned, "amin")


def apply_penalties(
    logits: Tensor, seen: Tensor, counts: Tensor, presence: Tensor, frequency: Tensor, repetition: Tensor
) -> Tensor:
    """The penalties on float32 `logits` [P, V]: `seen` marks tokens of the prompt or output,
    `counts` the output's token counts; one penalty of each kind per row. vLLM's (and HF's)
    repetition penalty, then OpenAI's frequency and presence penalties."""
    r = repetition.clamp(*REPETITION_RANGE)[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)


def _token_counts(flat: Tensor, lengths: Tensor, prompts: Tensor, vocab: int) -> tuple[Tensor, Tensor]:
    """From the rows' token ids laid end to end (`lengths` each, the first `prompts` of a row its
    prompt): which tokens each row has seen [P, V] and how often each is in its output [P, V]."""
    n, rows = flat.shape[0], lengths.shape[0]
    row_of = _rows_of(lengths, n)
    starts = lengths.cumsum(0) - lengths
    is_output = torch.arange(n, device=flat.device) - starts[row_of] >= prompts[row_of]
    keys = row_of * vocab + flat
    counts = torch.zeros(rows * vocab, dtype=torch.float32, device=flat.device).index_add_(0, keys, is_output.float())
    seen = torch.zeros(rows * vocab, dtype=torch.bool, device=flat.device).index_fill_(0, keys, True)
    return seen.view(rows, vocab), counts.view(rows, vocab)


def _rows_of(counts: Tensor, total: int) -> Tensor:
    """Each row's index `counts[row]` times, in row order: `total` in all (known on the host, so
    the device is never asked)."""
    rows = torch.arange(counts.shape[0], device=counts.device)
    return torch.repeat_interleave(rows, counts, output_size=total)


def _gather(
    chunks: Sequence[SeqChunk], rows: list[int], stop_ids: Sequence[int]
) -> tuple[Ints[array], Floats[array], list[array]]:
    """The plain data of the asking `rows`, in `process_logits`' order, and the penalised rows'
    ids as parts to lay end to end (each history, then a HOLE for its placeholder). A row's own
    ids and biases are extended from its params' arrays, never entry by entry."""
    ints = Ints(*(array("q") for _ in fields(Ints)))
    floats = Floats(*(array("f") for _ in fields(Floats)))
    eos = array("q", stop_ids)
    histories: list[array] = []
    for row, i in enumerate(rows):
        c, p = chunks[i], chunks[i].params
        ints.index.append(i)
        if p.allowed_token_ids is not None:
            ints.allowed_rows.append(row)
            ints.allowed_counts.append(len(p.allowed_id_array))
            ints.allowed_ids.extend(p.allowed_id_array)
        masked = c.output_index < p.min_tokens
        ints.mask_counts.append(len(eos) + len(p.stop_id_array) if masked else 0)
        if masked:
            ints.mask_ids.extend(eos)
            ints.mask_ids.extend(p.stop_id_array)
        ints.bias_counts.append(len(p.logit_bias_ids))
        ints.bias_ids.extend(p.logit_bias_ids)
        floats.biases.extend(p.logit_bias_values)
        if p.penalized:
            _gather_penalties(ints, floats, histories, row, c)
        if p.bad_words_token_ids and (usable := p.banned.usable(c.output_index)):
            _gather_bad_words(ints, row, c, usable)
    return ints, floats, histories


def _gather_penalties(ints: Ints[array], floats: Floats[array], histories: list[array], row: int, c: SeqChunk) -> None:
    """A penalised row's ids (its history, then a HOLE for a placeholder), lengths and penalties."""
    p, history, hole = c.params, c.history, c.prev_sample >= 0
    assert history is not None, "a penalised row needs its request's history"
    n = len(history) + hole
    assert n == c.start_pos + len(c.token_ids), "a penalised row's history is its sequence so far"
    histories.append(history)
    if hole:
        histories.append(HOLE)
        ints.holes.append(len(ints.lengths))
        ints.sources.append(c.prev_sample)
    ints.lengths.append(n)
    ints.prompts.append(c.num_prompt)
    ints.pen_rows.append(row)
    floats.presence.append(p.presence_penalty)
    floats.frequency.append(p.frequency_penalty)
    floats.repetition.append(p.repetition_penalty)


def _gather_bad_words(ints: Ints[array], row: int, c: SeqChunk, usable: int) -> None:
    """A row's `usable` bad-word sequences (the first, by prefix length: leading slices of its
    params' arrays) and its tail: its last tokens, as many as the longest usable prefix (the last
    a HOLE for a placeholder)."""
    banned, whole = c.params.banned, usable == len(c.params.banned.lengths)
    tokens = banned.ends[usable]
    ints.bad_rows.extend(array("q", [row]) * usable)
    ints.bad_lengths.extend(banned.lengths if whole else banned.lengths[:usable])
    ints.bad_last.extend(banned.last if whole else banned.last[:usable])
    ints.bad_prefix.extend(banned.prefix if whole else banned.prefix[:tokens])
    ints.bad_back.extend(banned.back if whole else banned.back[:tokens])
    if tail := banned.lengths[usable - 1]:
        history, hole = c.history, c.prev_sample >= 0
        assert history is not None, "a row with a bad word's prefix needs its request's history"
        assert len(history) + hole == c.start_pos + len(c.token_ids), "its history is its sequence so far"
        ints.bad_tails.extend(history[len(history) - tail + hole :])
        if hole:
            ints.bad_tails.extend(HOLE)
            ints.tail_holes.append(len(ints.bad_tails) - 1)
            ints.tail_sources.append(c.prev_sample)
    ints.bad_ends.extend(array("q", [len(ints.bad_tails)]) * usable)


def _upload(
    lists: list[array], dtype: torch.dtype, device: torch.device, tail: Sequence[array] | None = None
) -> list[Tensor]:
    """The lists as tensors on `device`, then the `tail` arrays end to end as one more, through
    one host buffer and one copy (pinned and asynchronous on CUDA)."""
    sizes = [len(values) for values in lists]
    joined = array(lists[0].typecode)
    for values in lists:
        joined.extend(values)
    if tail is not None:
        for values in tail:
            joined.extend(values)
        sizes.append(len(joined) - sum(sizes))
    host = torch.frombuffer(joined, dtype=dtype) if joined else torch.empty(0, dtype=dtype)
    if device.type == "cuda":
        host = host.pin_memory().to(device, non_blocking=True)
    return list(host.split(sizes))
