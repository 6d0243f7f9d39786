"""The attention benchmark's setup (bench/attention_kernels.py): what a run measures (the shapes
and points of a Plan: GPU_PLAN on CUDA, DRY_PLAN on the CPU) and one point's inputs: random
per-layer K/V caches, enough of them that K/V come from HBM, not L2, with shuffled block tables;
and the memory they held, released between points."""

import math
from dataclasses import dataclass

import torch

PAGE = 16
L2_DEFEAT_BYTES = 256 << 20  # per-layer caches are repeated until a point reads this much
MAX_LAYERS = 64


@dataclass(frozen=True)
class Shape:
    name: str
    heads: int
    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class Plan:
    """What one run measures: shapes and points, and which points FlexAttention tries."""

    shapes: tuple[Shape, ...]
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    chunks: tuple[int, ...]
    prefixes: tuple[int, ...]
    flex_decode: tuple[tuple[str, int, int], ...]  # (shape, batch, context)
    flex_prefill: tuple[tuple[str, int, int], ...]  # (shape, chunk, prefix)
    dtype: torch.dtype
    rep_ms: int


GPU_PLAN = Plan(
    shapes=(Shape("llama-3.2-1b", 32, 8, 64), Shape("llama-3-8b", 32, 8, 128)),
    batches=(1, 8, 64, 256),
    contexts=(600, 2048, 8192),
    chunks=(512, 2048),
    prefixes=(0, 2048),
    flex_decode=(("llama-3.2-1b", 1, 8192), ("llama-3.2-1b", 64, 2048), ("llama-3.2-1b", 256, 600)),
    flex_prefill=(("llama-3.2-1b", 2048, 2048),),
    dtype=torch.bfloat16,
    rep_ms=10,
)
DRY_PLAN = Plan(
    shapes=(Shape("tiny-64", 4, 2, 64), Shape("tiny-128", 8, 2, 128)),
    batches=(1, 3),
    contexts=(40,),
    chunks=(20,),
    prefixes=(0, 24),
    flex_decode=(("tiny-64", 3, 40),),
    flex_prefill=(("tiny-64", 20, 24),),
    dtype=torch.float32,
    rep_ms=1,
)


def caches(shape: Shape, num_blocks: int, layers: int, dtype: torch.dtype, dev: torch.device, gen: torch.Generator):
    """`layers` independent (k, v) caches with random contents."""
    size = (num_blocks, PAGE, shape.kv_heads, shape.head_dim)
    return [
        tuple(torch.empty(size, dtype=dtype, device=dev).normal_(generator=gen) for _ in range(2))
        for _ in range(layers)
    ]


def point(shape: Shape, num_seqs: int, context: int, dtype: torch.dtype, dev: torch.device, seed: int):
    """Shuffled block tables for num_seqs sequences of `context` tokens, enough layers to defeat L2."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    per_seq = math.ceil(context / PAGE)
    num_blocks = num_seqs * per_seq
    kv_bytes = 2 * num_seqs * context * shape.kv_heads * shape.head_dim * dtype.itemsize
    layers = max(1, min(MAX_LAYERS, math.ceil(L2_DEFEAT_BYTES / kv_bytes))) if dev.type == "cuda" else 1
    tables = torch.randperm(num_blocks, generator=gen, device=dev).view(num_seqs, per_seq).int()
    lens = torch.full((num_seqs,), context, dtype=torch.int32, device=dev)
    return caches(shape, num_blocks, layers, dtype, dev, gen), tables, lens, kv_bytes, gen


def release(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.empty_cache()
