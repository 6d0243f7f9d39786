"""Next-token sampling for one step: greedy, temperature, min_p, top-k, top-p, and per-request seeds.

All rows are processed as one tensor; only the random noise of seeded rows is drawn row by row,
from a generator seeded by (seed, output_index), so a seeded request produces the same tokens
whatever else shares its batch. Sampling uses the exponential race (argmax of p / Exp(1)), which
draws from p exactly and turns the whole batch into one argmax. Rows whose request asks for
penalties, a logit bias or min_tokens arrive processed (workers/logits_processors.py).
"""

import torch
from torch import Tensor

from workers.sampling_params import SamplingParams

_MASK64 = (1 << 63) - 1


def sample(logits: Tensor, params: list[SamplingParams], output_indices: list[int]) -> list[int]:
    """logits [n, V] -> one token per row; `output_indices[i]` is how many tokens row i has emitted."""
    return sample_tensor(logits, params, output_indices).tolist()


def sample_tensor(logits: Tensor, params: list[SamplingParams], output_indices: list[int]) -> Tensor:
    """`sample`'s tokens as a tensor on the logits' device, queued without waiting for the device
    (host values go up through pinned memory), so a launched step need not be waited for."""
    tokens = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        picked = [params[i] for i in rows]
        noise = _exponential_noise(logits.shape[1], picked, [output_indices[i] for i in rows], logits.device)
        index = to_device(rows, torch.long, logits.device)
        tokens[index] = _sample_rows(logits[index].float(), picked, noise)
    return tokens


def token_logprobs(logits: Tensor, tokens: Tensor, params: list[SamplingParams]) -> tuple | None:
    """For the rows that asked for logprobs: (rows, how many top tokens each asked for, the sampled
    tokens' log-probabilities, the top ids, their log-probabilities), the tensors queued on the
    device; None when no row asked.

    Taken from the raw logits (log-softmax before temperature, top-k and top-p), as vLLM does by
    default (`logprobs_mode="raw_logprobs"`): a log-probability reports what the model thinks of
    a token, not how this request's sampling settings reshaped the draw."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return None
    k = max(params[i].logprobs for i in rows)
    index = to_device(rows, torch.long, logits.device)
    logprobs = logits[index].float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, tokens[index][:, None])[:, 0]
    top = logprobs.topk(k, dim=-1) if k else None
    return rows, [params[i].logprobs for i in rows], chosen, top.indices if top else None, top.values if top else None


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A small host list as a tensor on `device`: through pinned memory and an asynchronous copy
    on CUDA, where a plain copy from pageable memory would wait for the device to go idle."""
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def _sample_rows(logits: Tensor, params: list[SamplingParams], noise: Tensor) -> Tensor:
    """Temperature, then min_p, then top-k, then top-p on the renormalised remainder (vLLM's order)."""
    temperature = to_device([p.temperature for p in params], logits.dtype, logits.device)[:, None]
    logits, order = (logits / temperature).sort(dim=-1, descending=True, stable=True)
    if any(p.min_p for p in params):
        logits = _min_p(logits, to_device([p.min_p for p in params], logits.dtype, logits.device)[:, None])
    rank = torch.arange(logits.shape[1], device=logits.device)[None, :]
    top_k = to_device([p.top_k or logits.shape[1] for p in params], logits.dtype, logits.device)[:, None]
    logits = logits.masked_fill(rank >= top_k, float("-inf"))
    probs = logits.softmax(dim=-1)
    top_p = to_device([p.top_p for p in params], logits.dtype, logits.device)[:, None]
    # Keep a token while the mass strictly before it is below top_p (the first always stays);
    # top_p == 1 is skipped so float error in the cumsum cannot clip the tail.
    probs = probs.masked_fill((probs.cumsum(dim=-1) - probs >= top_p) & (top_p < 1), 0.0)
    # Exp(1) noise can be exactly 0; clamping keeps masked tokens at 0 instead of NaN.
    choice = (probs / noise.clamp_min(torch.finfo(noise.dtype).tiny)).argmax(dim=-1, keepdim=True)
    return order.gather(1, choice)[:, 0]


def _min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """vLLM's min_p on logits sorted in descending order: a token less probable than `min_p`
    times the most probable one is dropped (-inf). It never drops the argmax, so greedy rows skip it."""
    probs = logits.softmax(dim=-1)
    return logits.masked_fill(probs < probs[:, :1] * min_p, float("-inf"))


def _exponential_noise(
    vocab: int, params: list[SamplingParams], output_indices: list[int], device: torch.device
) -> Tensor:
    """Exp(1) noise per row (indexed by rank in the sorted vocabulary); seeded rows get their own stream."""
    noise = torch.empty(len(params), vocab, device=device).exponential_()
    for i, (p, index) in enumerate(zip(params, output_indices)):
        if p.seed is not None:
            gen = torch.Generator(device=device).manual_seed(_row_seed(p.seed, index))
            noise[i].exponential_(generator=gen)
    return noise


def _row_seed(seed: int, output_index: int) -> int:
    """Mix (seed, output_index) into one 63-bit seed so neighbouring steps get unrelated streams."""
    x = (seed * 0x9E3779B97F4A7C15 + output_index * 0xBF58476D1CE4E5B9) & _MASK64
    x ^= x >> 31
    return (x * 0x94D049BB133111EB) & _MASK64
