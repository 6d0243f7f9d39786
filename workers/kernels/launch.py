"""Launch parameters shared by the kernels: tile configs, power-of-two sizes, dot precision, SMs.

Kernels are plain `@triton.jit` functions: compiled on CUDA, or run by Triton's interpreter when
TRITON_INTERPRET=1 was set before triton was first imported (tests on CPU do that in a child
process, tests/test_kernels.py). Why: one place for the sizes every kernel must get right.
"""

import functools
from dataclasses import asdict, dataclass

import torch
import triton

from workers.kernels import interpreter

if interpreter.interpreting():
    interpreter.fix_index()


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes and launch parameters of an attention kernel (powers of two, >= 16 for tl.dot)."""

    block_n: int = 64  # context tokens per loop step
    block_m: int = 64  # query rows per program (prefill only)
    num_warps: int = 4
    num_stages: int = 2

    def to_json(self) -> dict:
        return asdict(self)


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (1 elsewhere): how many programs fill it."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: exact fp32 for fp32 tensors (the default tf32 keeps 10 mantissa
    bits), the default for 16-bit inputs."""
    return "ieee" if dtype == torch.float32 else "tf32"


def pow2(n: int, least: int = 1) -> int:
    """Smallest power of two >= max(n, least): tile sizes must be powers of two."""
    return max(triton.next_power_of_2(n), least)
