"""Triton kernels for the GPU fast path: paged attention read in place, fused norm/activation/RoPE.

Importing this package is cheap (no triton); each kernel module imports triton itself. Kernels run
compiled on CUDA tensors and through Triton's interpreter on CPU tensors (workers/kernels/launch.py),
the latter only for tests: the CPU keeps the eager path.
"""

import importlib.util
import os

import torch


def available(device: str | torch.device) -> bool:
    """Whether the kernels can serve `device`: triton importable and the device CUDA, or the
    interpreter asked for (TRITON_INTERPRET=1), which runs them on CPU tensors."""
    if importlib.util.find_spec("triton") is None:
        return False
    return torch.device(device).type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
