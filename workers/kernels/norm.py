"""RMSNorm, alone or fused with the residual add, one program per row, fp32 accumulation.

`rms_norm(x, weight, eps)`: x [..., N] (last dim contiguous; 2-D or 3-D with free leading
strides, e.g. the q heads of a fused qkv output for Qwen3's q_norm) -> a new contiguous tensor.
`fused_add_rms_norm(x, residual, weight, eps)`: x, residual [T, N]; residual += x, then
x = rms_norm(residual), both in place (vLLM's contract). Rounding follows the eager RMSNorm in
workers/models/llama.py: normalise in fp32, round to x's dtype, multiply by weight in that dtype.
weight [N] has x's dtype. Why: one launch instead of the eager norm's six, and the add fused in.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from workers.kernels.launch import pow2


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    inner,
    n,
    eps,
    stride_xa,
    stride_xb,
    stride_ra,
    stride_oa,
    stride_ob,
    BLOCK: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0)
    a = (row // inner).to(tl.int64)
    b = (row % inner).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + a * stride_xa + b * stride_xb + offs, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        res = tl.load(res_ptr + a * stride_ra + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_ptr + a * stride_ra + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, 0) / n + eps)
    y = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + a * stride_oa + b * stride_ob + offs, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """weight * rmsnorm(x) over the last dimension, as a new tensor shaped like x."""
    _check(x, weight)
    x3 = x[:, None] if x.dim() == 2 else x
    out = torch.empty(x3.shape, dtype=x.dtype, device=x.device)
    _launch(x3, None, weight, out, eps)
    return out.view(x.shape)


def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> None:
    """residual += x; x = weight * rmsnorm(residual); both [T, N], in place."""
    _check(x, weight)
    if x.dim() != 2 or residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1:
        raise ValueError(
            f"x {tuple(x.shape)} {x.dtype} and residual {tuple(residual.shape)} {residual.dtype} "
            "must be matching [T, N] with a contiguous last dimension"
        )
    _launch(x[:, None], residual, weight, x[:, None], eps)


def _check(x: Tensor, weight: Tensor) -> None:
    if x.dim() not in (2, 3) or x.stride(-1) != 1 or weight.shape != (x.shape[-1],) or weight.dtype != x.dtype:
        raise ValueError(
            f"x {tuple(x.shape)} {x.dtype} (2-D or 3-D, contiguous last dim) does not fit "
            f"weight {tuple(weight.shape)} {weight.dtype}"
        )


def _launch(x3: Tensor, residual: Tensor | None, weight: Tensor, out3: Tensor, eps: float) -> None:
    """x3/out3 [A, B, N]: one program per (a, b) row; residual [A, N] when fused."""
    rows = x3.shape[0] * x3.shape[1]
    if rows == 0:
        return
    block = pow2(x3.shape[2])
    res = x3 if residual is None else residual
    _rms_norm_kernel[(rows,)](
        x3,
        res,
        weight,
        out3,
        x3.shape[1],
        x3.shape[2],
        eps,
        x3.stride(0),
        x3.stride(1),
        res.stride(0),
        out3.stride(0),
        out3.stride(1),
        BLOCK=block,
        ADD_RESIDUAL=residual is not None,
        num_warps=min(max(block // 256, 1), 8),
    )
