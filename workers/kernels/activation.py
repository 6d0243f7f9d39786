"""SiLU-and-multiply over the fused gate/up projection: out = silu(gate) * up.

Layout: gate_up [T, 2I] (last dim contiguous, free row stride), gate in columns :I and up in
I:, as one GEMM over concatenated gate/up weights produces it; out [T, I] in the same dtype.
Rounding follows the eager MLP: silu in fp32 rounded to the dtype, then the product rounded.
Why: one launch instead of silu, mul and the two slices' copies.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_xt, stride_ot, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    g = tl.load(x_ptr + t * stride_xt + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + t * stride_xt + inter + offs, mask=mask, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + offs, (s * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: Tensor, out: Tensor | None = None) -> Tensor:
    """[T, 2I] -> [T, I]: silu(gate_up[:, :I]) * gate_up[:, I:]."""
    t, two_i = gate_up.shape
    if two_i % 2 or gate_up.stride(-1) != 1:
        raise ValueError(f"gate_up {tuple(gate_up.shape)} needs an even, contiguous last dimension")
    inter = two_i // 2
    out = torch.empty((t, inter), dtype=gate_up.dtype, device=gate_up.device) if out is None else out
    if out.shape != (t, inter) or out.dtype != gate_up.dtype or out.stride(-1) != 1:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must be [{t}, {inter}] {gate_up.dtype}")
    if t:
        _silu_and_mul_kernel[(t, triton.cdiv(inter, BLOCK))](
            gate_up, out, inter, gate_up.stride(0), out.stride(0), BLOCK=BLOCK, num_warps=4
        )
    return out
