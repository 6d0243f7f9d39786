"""What the kernel test files share: the device, the tolerance check and the `run` fixture
that computes a case on CUDA here or, on CPU, in Triton's interpreter in one spawned child
(tests/test_kernels.py says why a child)."""

import importlib.util
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

from workers.kernels.interpreter import enable

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CPU = DEVICE == "cpu"
PAGE = 16
TOL = {torch.float32: (2e-5, 1e-5), torch.bfloat16: (3e-2, 2e-2)}  # (atol, rtol)

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@pytest.fixture(scope="module")
def run():
    """run(case, **kwargs): a case's max abs error, computed on CUDA here or in the interpreter child."""
    if not CPU:
        yield lambda case, **kw: case(**kw)
        return
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=enable) as pool:
        yield lambda case, **kw: pool.submit(case, **kw).result(timeout=600)


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> float:
    """Assert got ~ want within the dtype's tolerance; the max abs error."""
    atol, rtol = TOL[dtype]
    got, want = got.double(), want.double()
    err = (got - want).abs()
    worst = err.max().item() if err.numel() else 0.0
    assert not got.isnan().any(), f"{what}: NaN in the output"
    assert (err <= atol + rtol * want.abs()).all(), f"{what}: max abs error {worst:.3g} (atol {atol}, rtol {rtol})"
    return worst
