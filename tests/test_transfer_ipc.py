"""CUDA IPC transfer between two processes on one host (runs where CUDA is; skipped on CPU CI)."""

import multiprocessing as mp

import pytest

torch = pytest.importorskip("torch")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _producer(q_out, q_done):
    import torch

    from workers.transfer_ipc import share

    kv = torch.arange(2 * 2 * 3 * 4 * 2 * 8, dtype=torch.bfloat16, device="cuda:0").view(2, 2, 3, 4, 2, 8)
    q_out.put(share(kv))
    q_done.get(timeout=60)


@needs_cuda
def test_ipc_handle_opens_in_another_process_and_copies():
    from workers.transfer_ipc import open_shared

    ctx = mp.get_context("spawn")
    q_out, q_done = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_producer, args=(q_out, q_done))
    child.start()
    try:
        kv = open_shared(q_out.get(timeout=60), (2, 2, 3))
        dst = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
        got = kv.to(dst)
        torch.cuda.synchronize()
        want = torch.arange(got.numel(), dtype=torch.bfloat16).view(got.shape)
        assert torch.equal(got.cpu(), want)
    finally:
        q_done.put(True)
        child.join(30)


def test_ipc_handle_refuses_foreign_pickles():
    import pickle

    from workers.transfer_ipc import open_shared

    with pytest.raises(pickle.UnpicklingError):
        open_shared(pickle.dumps(print), (1,))
