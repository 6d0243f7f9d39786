"""The one-host fast path for P/D: hand the decode worker a CUDA IPC handle, not the bytes.

The prefill worker gathers the blocks into one GPU tensor and sends its IPC handle; the decode
worker maps it and copies GPU to GPU (NVLink/PCIe peer copy), then answers, and only then does
the sender drop its tensor. Handles are pickled by torch's own reducer; the receiver unpickles
with an allow-list, so a handle can name nothing but a CUDA tensor rebuild.
"""

import io
import pickle

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

_ALLOWED = {
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
    ("torch", "Tensor"),
    ("torch", "Size"),
    ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"),
    ("torch", "device"),
}


class _HandleUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a KV IPC handle")


def share(kv: torch.Tensor) -> bytes:
    """A handle another process on this host can open; keep `kv` alive until it has copied."""
    fn, args = reduce_tensor(kv)
    assert fn is rebuild_cuda_tensor, "CUDA IPC needs a CUDA tensor"
    return pickle.dumps(args)


def open_shared(blob: bytes, leading: tuple[int, ...]) -> torch.Tensor:
    """Map a peer's tensor; `leading` are the dims it must start with (layers, 2, blocks)."""
    args = _HandleUnpickler(io.BytesIO(blob)).load()
    kv = rebuild_cuda_tensor(*args)
    if tuple(kv.shape[:3]) != leading:
        raise ValueError(f"IPC tensor shape {tuple(kv.shape)} does not start with {leading}")
    return kv
