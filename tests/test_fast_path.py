"""The fast path (Triton kernels, fused layers, CUDA graphs) generates what HF generates.

The same tiny fp32 checkpoints as test_model_fidelity, driven the same way (chunked prefill,
mixed steps, shuffled blocks, a shared cached prefix), through `TorchRunner(kernels=True)`. On
CUDA the decode steps replay CUDA graphs, and graph replay is also held against the eager kernel
path across batch sizes that pad a bucket. On CPU the kernels run in Triton's interpreter in a
spawned child (tests/test_kernels.py says why), without graphs.
"""

import importlib.util
import multiprocessing
import random
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

from tests.test_model_fidelity import BLOCK, CONFIGS, NUM_BLOCKS, _prompt, checkpoints, hf_greedy, run_greedy  # noqa: F401
from workers.kernels.interpreter import enable

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def fast_greedy(
    path: str,
    prompts: list[list[int]],
    tables: list[list[int]],
    chunk: int | None = None,
    starts: list[int] | None = None,
    eager: bool = not CUDA,
) -> list[list[int]]:
    """Greedy tokens from a kernel-path runner (graphs unless `eager`)."""
    from workers.executors.torch_runner import TorchRunner

    runner = TorchRunner(
        path, NUM_BLOCKS, BLOCK, DEVICE, torch.float32, kernels=True, enforce_eager=eager, max_num_seqs=32
    )
    assert (runner.graphs is None) == eager
    return run_greedy(runner, prompts, tables, chunk=chunk, starts=starts)


@pytest.fixture(scope="module")
def run():
    """run(fn, *args): fn's result, computed here on CUDA or in the interpreter child on CPU."""
    if CUDA:
        yield lambda fn, *a, **kw: fn(*a, **kw)
        return
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=enable) as pool:
        yield lambda fn, *a, **kw: pool.submit(fn, *a, **kw).result(timeout=900)


# On CPU the interpreter is slow, and test_kernels runs the Qwen3 and Mistral checkpoints through
# the kernel path already: the other three cover the rest of the family here.
FAMILY = list(CONFIGS) if CUDA else ["llama3-gqa4-tied", "llama2-mha-linear-oldstyle", "qwen2-bias-gqa2"]


@pytest.mark.parametrize("name", FAMILY)
def test_batch_chunked_shuffled_matches_hf(name, checkpoints, run):
    path, hf = checkpoints[name]
    rng = random.Random(2)
    prompts = [_prompt(rng, n) for n in (1, 5, 12, 21)]
    ids = list(range(NUM_BLOCKS))
    rng.shuffle(ids)
    tables = [ids[i * 8 : (i + 1) * 8] for i in range(len(prompts))]
    assert run(fast_greedy, str(path), prompts, tables, 7) == [hf_greedy(hf, p) for p in prompts]


@pytest.mark.parametrize("name", ["llama3-gqa4-tied", "mistral-window5"] if CUDA else ["llama3-gqa4-tied"])
def test_reads_a_cached_prefix(name, checkpoints, run):
    """B starts past A's first two blocks, which it lists: prefill and decode read A's K/V."""
    path, hf = checkpoints[name]
    rng = random.Random(3)
    a = _prompt(rng, 2 * BLOCK + 3)
    b = a[: 2 * BLOCK] + _prompt(rng, 5)
    table_a, fresh = [17, 3, 40, 8, 61, 25], [9, 52, 30, 71]
    got = run(fast_greedy, str(path), [a, b], [table_a, table_a[:2] + fresh], None, [0, 2 * BLOCK])
    assert got == [hf_greedy(hf, a), hf_greedy(hf, b)]


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("batch", [1, 3, 9, 17])
def test_graph_replay_equals_eager_across_buckets(batch, checkpoints):
    """Batches that pad a graph bucket (padding rows read and write no cache) give the eager
    kernel path's tokens."""
    path, _ = checkpoints["qwen2-bias-gqa2"]
    rng = random.Random(batch)
    prompts = [_prompt(rng, rng.randint(1, 12)) for _ in range(batch)]
    tables = [[i * 5 + j for j in range(5)] for i in range(batch)]
    graphed = fast_greedy(str(path), prompts, tables, None, None, eager=False)
    assert graphed == fast_greedy(str(path), prompts, tables, None, None, eager=True)


@pytest.mark.skipif(not CUDA, reason="the engine overlaps steps only on CUDA")
@pytest.mark.parametrize("blocks", [96, 20])
def test_engine_overlapping_graph_steps_matches_cpu_engine(blocks, checkpoints):
    """The engine as served on CUDA: each decode step planned and launched (a graph replay whose
    input tokens are filled on the device) before the previous step's tokens are read; the same
    tokens and finish reasons as the same runner one step at a time (seeded sampling draws from
    the device's generator, so the reference runs on CUDA too), with and without preemption."""
    from tests.test_overlap import run, workload
    from workers.config import EngineConfig
    from workers.engine import Engine
    from workers.executors.torch_runner import TorchRunner

    path, _ = checkpoints["qwen2-bias-gqa2"]

    def engine(overlap: bool) -> Engine:
        runner = TorchRunner(str(path), blocks, BLOCK, "cuda", torch.float32, max_num_seqs=8)
        eng = Engine(runner, None, EngineConfig("m", BLOCK, blocks, 64, 8))  # no detokenizing
        assert eng._overlap
        eng._overlap = overlap
        return eng

    requests = workload(4, 512)
    assert run(engine(True), requests) == run(engine(False), requests)
