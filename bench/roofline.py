"""The speed-of-light time of an engine step on this device, to say what fraction a run reaches.

A decode step must at least read every weight and every decoding sequence's K/V once, at the
device's copy bandwidth; a prefill must at least do its matmul FLOPs at the device's matmul rate.
A step's bound is the decode part's bytes / bandwidth plus the prefill part's FLOPs / rate
(issue 14's definition); both ceilings are measured here, on the device the run used.
"""

import time
from dataclasses import asdict, dataclass

import torch


@dataclass
class Ceilings:
    copy_gbps: float  # device-to-device copy, bytes read + written per second / 1e9
    matmul_tflops: float  # bf16 (or the run's dtype) 8192^3 matmul

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class ModelCost:
    weight_bytes: int  # every parameter once (a tied embedding counted once, as the logits GEMM reads it)
    params: int
    kv_bytes_per_token: int
    attn_flops_per_ctx_product: int  # 4 * layers * heads * head_dim: QK^T and PV per (query, key) pair

    def step_bound_s(
        self,
        prefill_tokens: float,
        decode_seqs: float,
        decode_kv_tokens: float,
        prefill_ctx_products: float,
        c: Ceilings,
    ) -> float:
        decode = 0.0
        if decode_seqs:
            decode = (self.weight_bytes + decode_kv_tokens * self.kv_bytes_per_token) / (c.copy_gbps * 1e9)
        flops = 2 * self.params * prefill_tokens + self.attn_flops_per_ctx_product * prefill_ctx_products
        return decode + flops / (c.matmul_tflops * 1e12)


def model_cost(runner) -> ModelCost:
    """What a `TorchRunner`'s model reads and computes per token."""
    params = sum(p.numel() for p in runner.model.parameters())
    cfg = runner.config
    return ModelCost(
        weight_bytes=params * runner.dtype.itemsize,
        params=params,
        kv_bytes_per_token=runner.kv_bytes_per_token,
        attn_flops_per_ctx_product=4 * cfg.num_layers * cfg.num_heads * cfg.head_dim,
    )


def measure(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> Ceilings:
    """Copy bandwidth (1 GiB copied 20 times) and matmul rate (8192^3, 10 times), after warm-ups."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = _timed(lambda: dst.copy_(src), 20, device)
    a = torch.randn(8192, 8192, device=device, dtype=dtype)
    b = torch.randn(8192, 8192, device=device, dtype=dtype)
    mm_s = _timed(lambda: a @ b, 10, device)
    return Ceilings(copy_gbps=2 * (1 << 30) / copy_s / 1e9, matmul_tflops=2 * 8192**3 / mm_s / 1e12)


def _timed(fn, reps: int, device: torch.device) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / reps
