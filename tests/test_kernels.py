"""The Triton kernels (workers/kernels) against plain torch references, max abs error in every message.

On CUDA the cases run in this process. On CPU they run through Triton's interpreter in one child
process: TRITON_INTERPRET=1 must be set before triton's first import and this pytest process is
shared with every other test file, so the parent never imports triton and the child (spawned,
`interpreter.enable` as its initializer) does all the kernel work. Sizes are smaller on CPU.
"""

import importlib.util
import json
import math
import multiprocessing
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
import torch

from workers.kernels import available
from workers.kernels.interpreter import enable

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CPU = DEVICE == "cpu"
PAGE = 16
# Context lengths of one decode batch (0 is a padding row); the long ones only on the GPU.
CONTEXTS = [0, 1, 16, 17, 100, 300] if CPU else [0, 1, 15, 16, 17, 100, 600, 1000, 2049, 4100]
# Prefill chunks (new tokens, context length) of one call: without a prefix, with one, 1 row; a
# 62-token prefix puts the diagonal one position short of a tile edge (BLOCK_N 32 or 64).
CHUNKS = (
    [(37, 37), (20, 100), (1, 50), (70, 132)] if CPU else [(300, 300), (512, 2560), (1, 50), (200, 4000), (77, 139)]
)
TOL = {torch.float32: (2e-5, 1e-5), torch.bfloat16: (3e-2, 2e-2)}  # (atol, rtol)

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
cuda_only_bf16_dot = pytest.mark.skipif(
    CPU, reason="Triton's interpreter does not support bf16 tl.dot (it multiplies the bit patterns, triton#11584)"
)


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


def paged_cache(lens: list[int], kvh: int, d: int, dtype: torch.dtype, gen: torch.Generator):
    """Random caches and shuffled, non-contiguous block tables whose unused entries are garbage."""
    need = [math.ceil(n / PAGE) for n in lens]
    num_blocks = sum(need) + 7
    k_cache = torch.randn(num_blocks, PAGE, kvh, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, PAGE, kvh, d, generator=gen).to(dtype)
    width = max(need, default=0) + 2
    tables = torch.randint(num_blocks, 1 << 20, (len(lens), width), generator=gen, dtype=torch.int32)
    ids = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    for i, n in enumerate(need):
        tables[i, :n], ids = ids[:n], ids[n:]
    return k_cache, v_cache, tables


def reference(
    q: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    ctx: int,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """q [n, H, D] at `positions` over one sequence's first ctx cached tokens, float64, causal and
    windowed as workers/attention.py masks; a row that sees nothing is 0."""
    kv = torch.arange(ctx)
    blocks = table[kv // PAGE].long()
    group = q.shape[1] // k_cache.shape[2]
    k = k_cache[blocks, kv % PAGE].double().repeat_interleave(group, 1)
    v = v_cache[blocks, kv % PAGE].double().repeat_interleave(group, 1)
    s = torch.einsum("nhd,chd->hnc", q.double(), k) * scale
    mask = kv[None, :] <= positions[:, None]
    if window is not None:
        mask &= kv[None, :] > positions[:, None] - window
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1).nan_to_num(0.0)
    return torch.einsum("hnc,chd->nhd", p, v)


def case_decode(
    device: str,
    dtype: torch.dtype,
    group: int,
    d: int,
    num_splits: int | None,
    window: int | None = None,
    strided_q: bool = False,
    seed: int = 0,
) -> float:
    from workers.kernels.decode_attention import paged_decode_attention

    gen = torch.Generator().manual_seed(seed)
    kvh, lens = 2, CONTEXTS
    h, s = kvh * group, len(lens)
    k_cache, v_cache, tables = paged_cache(lens, kvh, d, dtype, gen)
    qkv = torch.randn(s, h + 2 * kvh, d, generator=gen).to(dtype)
    q = qkv[:, :h].contiguous()
    dev = torch.device(device)
    q_dev = qkv.to(dev)[:, :h] if strided_q else q.to(dev)  # a view of a fused qkv output, or not
    scale = d**-0.5
    out = torch.full((s, h, d), float("nan"), dtype=dtype, device=dev)
    got = paged_decode_attention(
        q_dev,
        k_cache.to(dev),
        v_cache.to(dev),
        tables.to(dev),
        torch.tensor(lens, dtype=torch.int32, device=dev),
        scale,
        sliding_window=window,
        num_splits=num_splits,
        out=out,
    )
    assert got is out
    want = torch.stack(
        [
            reference(q[i : i + 1], torch.tensor([n - 1]), k_cache, v_cache, tables[i], n, window, scale)[0]
            for i, n in enumerate(lens)
        ]
    )
    return close(got.cpu(), want, dtype, f"decode group {group} d {d} splits {num_splits} window {window}")


def case_prefill(
    device: str,
    dtype: torch.dtype,
    group: int,
    d: int,
    window: int | None = None,
    chunks: list | None = None,
    seed: int = 0,
) -> float:
    from workers.kernels.prefill_attention import paged_prefill_attention

    gen = torch.Generator().manual_seed(seed)
    chunks = chunks or CHUNKS
    kvh = 2
    h = kvh * group
    lens = [ctx for _, ctx in chunks]
    k_cache, v_cache, tables = paged_cache(lens, kvh, d, dtype, gen)
    rows = [n for n, _ in chunks]
    cu = torch.tensor([0] + rows).cumsum(0).to(torch.int32)
    q = torch.randn(int(cu[-1]), h, d, generator=gen).to(dtype)
    scale = d**-0.5
    dev = torch.device(device)
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=dev)
    got = paged_prefill_attention(
        q.to(dev),
        k_cache.to(dev),
        v_cache.to(dev),
        tables.to(dev),
        cu.to(dev),
        torch.tensor(lens, dtype=torch.int32, device=dev),
        max(rows),
        scale,
        sliding_window=window,
        out=out,
    )
    assert got is out
    want = torch.cat(
        [
            reference(q[cu[i] : cu[i + 1]], torch.arange(ctx - n, ctx), k_cache, v_cache, tables[i], ctx, window, scale)
            for i, (n, ctx) in enumerate(chunks)
        ]
    )
    return close(got.cpu(), want, dtype, f"prefill group {group} d {d} window {window}")


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_matches_reference(run, group, d, num_splits):
    print(run(case_decode, device=DEVICE, dtype=torch.float32, group=group, d=d, num_splits=num_splits))


@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_decode_sliding_window(run, num_splits):
    print(run(case_decode, device=DEVICE, dtype=torch.float32, group=4, d=64, num_splits=num_splits, window=40))


@pytest.mark.parametrize(("group", "d"), [(2, 80), (2, 96), (7, 64), (16, 64)])
def test_decode_odd_shapes_and_strided_q(run, group, d):
    """Head dims padded to a power of two, groups that are not one or past 8, q a view of qkv."""
    print(run(case_decode, device=DEVICE, dtype=torch.float32, group=group, d=d, num_splits=None, strided_q=True))


@cuda_only_bf16_dot
@pytest.mark.parametrize("num_splits", [1, 5])
def test_decode_bf16(run, num_splits):
    print(run(case_decode, device=DEVICE, dtype=torch.bfloat16, group=8, d=128, num_splits=num_splits, window=None))


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_prefill_matches_reference(run, group, d):
    print(run(case_prefill, device=DEVICE, dtype=torch.float32, group=group, d=d))


@pytest.mark.parametrize("window", [1, 24, 150])
def test_prefill_sliding_window(run, window):
    # (100, 300) at window 150 walks all three stages: window edge, whole tiles, diagonal.
    chunks = [(37, 37), (20, 300), (100, 300), (1, 50)] if CPU else [(300, 300), (512, 2560), (1, 50), (700, 4000)]
    print(run(case_prefill, device=DEVICE, dtype=torch.float32, group=4, d=64, window=window, chunks=chunks))


def test_prefill_pads_head_dim(run):
    print(run(case_prefill, device=DEVICE, dtype=torch.float32, group=2, d=80))


@cuda_only_bf16_dot
def test_prefill_bf16(run):
    print(run(case_prefill, device=DEVICE, dtype=torch.bfloat16, group=4, d=128, window=None))


def case_gather_path(device: str, dtype: torch.dtype) -> float:
    """Decode and prefill kernels against workers/attention.py's gather + SDPA path, the CPU reference."""
    from workers.attention import AttentionBatch, PagedAttention, PrefillSeq
    from workers.kernels.decode_attention import paged_decode_attention
    from workers.kernels.prefill_attention import paged_prefill_attention

    gen = torch.Generator().manual_seed(3)
    kvh, group, d, window = 2, 4, 64, 50
    lens = [1, 33, 130]
    k_cache, v_cache, tables = paged_cache(lens, kvh, d, dtype, gen)
    attn = PagedAttention(kvh * group, kvh, d, window)
    attn.k_cache, attn.v_cache = k_cache, v_cache
    need = torch.tensor([math.ceil(n / PAGE) for n in lens])[:, None]
    clean = torch.where(torch.arange(tables.shape[1]) < need, tables, 0)  # the gather path reads every entry
    q = torch.randn(len(lens), kvh * group, d, generator=gen).to(dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    batch = AttentionBatch(
        slot_mapping=torch.zeros(0, dtype=torch.long),
        decode_rows=torch.arange(len(lens)),
        decode_tables=clean.long(),
        decode_lens=lens_t.long(),
        prefills=[],
        num_decodes=len(lens),
    )
    dev = torch.device(device)
    got = paged_decode_attention(
        q.to(dev), k_cache.to(dev), v_cache.to(dev), tables.to(dev), lens_t.to(dev), d**-0.5, sliding_window=window
    )
    worst = close(got.cpu(), attn._decode(q, batch), dtype, "decode vs gather path")
    n, ctx = 40, 130  # a chunk over a cached 90-token prefix
    qp = torch.randn(n, kvh * group, d, generator=gen).to(dtype)
    seq = PrefillSeq(slice(0, n), ctx - n, tables[2, : math.ceil(ctx / PAGE)].long())
    want = attn._prefill(qp, None, None, seq)
    got = paged_prefill_attention(
        qp.to(dev),
        k_cache.to(dev),
        v_cache.to(dev),
        tables[2:].to(dev),
        torch.tensor([0, n], dtype=torch.int32, device=dev),
        torch.tensor([ctx], dtype=torch.int32, device=dev),
        n,
        d**-0.5,
        sliding_window=window,
    )
    return max(worst, close(got.cpu(), want, dtype, "prefill vs gather path"))


def test_attention_matches_gather_path(run):
    print(run(case_gather_path, device=DEVICE, dtype=torch.float32))


@pytest.mark.skipif(CPU, reason="CUDA graphs need a GPU")
def test_decode_replays_in_a_cuda_graph():
    """Captured once with static buffers, replayed over new tables and lengths: no host sync and
    no host decision on tensor values, so each replay matches the reference."""
    from workers.kernels.decode_attention import paged_decode_attention

    gen = torch.Generator().manual_seed(8)
    kvh, group, d, s, width = 2, 4, 128, 6, 300
    k_cache, v_cache, _ = paged_cache([width * PAGE] * 2, kvh, d, torch.float32, gen)
    dev = torch.device("cuda")
    static = {
        "q": torch.zeros(s, kvh * group, d, device=dev),
        "tables": torch.zeros(s, width, dtype=torch.int32, device=dev),
        "lens": torch.zeros(s, dtype=torch.int32, device=dev),
        "out": torch.zeros(s, kvh * group, d, device=dev),
    }
    kc, vc = k_cache.to(dev), v_cache.to(dev)

    def step():
        paged_decode_attention(static["q"], kc, vc, static["tables"], static["lens"], d**-0.5, out=static["out"])

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for lens in ([1, 5, 4000, 0, 17, 300], [4800, 2, 33, 600, 1, 0]):
        tables = torch.stack([torch.randperm(k_cache.shape[0], generator=gen)[:width] for _ in range(s)]).int()
        q = torch.randn(s, kvh * group, d, generator=gen)
        for name, value in (("q", q), ("tables", tables), ("lens", torch.tensor(lens, dtype=torch.int32))):
            static[name].copy_(value)
        graph.replay()
        want = torch.stack(
            [
                reference(q[i : i + 1], torch.tensor([n - 1]), k_cache, v_cache, tables[i], n, None, d**-0.5)[0]
                for i, n in enumerate(lens)
            ]
        )
        print(close(static["out"].cpu(), want, torch.float32, f"graph replay at {lens}"))


def case_store_kv(device: str, dtype: torch.dtype) -> float:
    from workers.kernels.store_kv import store_kv

    gen = torch.Generator().manual_seed(4)
    kvh, d, blocks = 2, 64, 6
    qkv = torch.randn(9, 4 + 2 * kvh, d, generator=gen).to(dtype)
    k, v = qkv[:, 4 : 4 + kvh], qkv[:, 4 + kvh :]
    slots = torch.tensor([3, -1, 16, 95, 40, -1, 0, 17, 64])
    dev = torch.device(device)
    k_cache = torch.zeros(blocks, PAGE, kvh, d, dtype=dtype, device=dev)
    v_cache = torch.zeros_like(k_cache)
    qkv_dev = qkv.to(dev)  # k and v as strided views of a fused qkv output
    store_kv(qkv_dev[:, 4 : 4 + kvh], qkv_dev[:, 4 + kvh :], k_cache, v_cache, slots.to(dev))
    want_k = torch.zeros(blocks * PAGE, kvh, d, dtype=dtype)
    want_v = torch.zeros_like(want_k)
    keep = slots >= 0
    want_k[slots[keep]], want_v[slots[keep]] = k[keep], v[keep]
    assert torch.equal(k_cache.cpu().view(-1, kvh, d), want_k), "store_kv: K differs"
    assert torch.equal(v_cache.cpu().view(-1, kvh, d), want_v), "store_kv: V differs"
    return 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_slots_and_skips_padding(run, dtype):
    run(case_store_kv, device=DEVICE, dtype=dtype)


def case_norm(device: str, dtype: torch.dtype) -> float:
    from workers.kernels.norm import fused_add_rms_norm, rms_norm
    from workers.models.llama import RMSNorm

    gen = torch.Generator().manual_seed(5)
    dev = torch.device(device)
    worst = 0.0
    for n, shape in ((576, (7,)), (2048, (3,)), (64, (5, 6))):  # hidden sizes, and per-head q_norm
        norm = RMSNorm(n, 1e-5).to(dtype)
        norm.weight.data = torch.randn(n, generator=gen).to(dtype)
        x = torch.randn(*shape, n, generator=gen).to(dtype)
        got = rms_norm(x.to(dev), norm.weight.data.to(dev), 1e-5)
        assert got.shape == x.shape and got.dtype == x.dtype
        worst = max(worst, close(got.cpu(), norm(x), dtype, f"rms_norm {tuple(x.shape)}"))
    wide = torch.randn(5, 3, 2, 64, generator=gen).to(dtype)
    got = rms_norm(wide.to(dev)[:, :, 0], norm.weight.data.to(dev), 1e-5)  # strided heads, as a qkv view
    worst = max(worst, close(got.cpu(), norm(wide[:, :, 0]), dtype, "rms_norm strided"))
    norm = RMSNorm(576, 1e-6).to(dtype)
    norm.weight.data = torch.randn(576, generator=gen).to(dtype)
    x, residual = (torch.randn(9, 576, generator=gen).to(dtype) for _ in range(2))
    want_res = residual + x
    want = norm(want_res)
    x_dev, res_dev = x.to(dev), residual.to(dev)
    fused_add_rms_norm(x_dev, res_dev, norm.weight.data.to(dev), 1e-6)
    worst = max(worst, close(res_dev.cpu(), want_res, dtype, "fused residual"))
    return max(worst, close(x_dev.cpu(), want, dtype, "fused_add_rms_norm"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_match_eager_rmsnorm(run, dtype):
    print(run(case_norm, device=DEVICE, dtype=dtype))


def case_silu(device: str, dtype: torch.dtype) -> float:
    import torch.nn.functional as F

    from workers.kernels.activation import silu_and_mul

    gen = torch.Generator().manual_seed(6)
    inter = 1500
    wide = torch.randn(5, 2 * inter + 8, generator=gen).to(dtype)
    gate_up = wide[:, : 2 * inter]
    got = silu_and_mul(wide.to(torch.device(device))[:, : 2 * inter])  # a free row stride
    return close(got.cpu(), F.silu(gate_up[:, :inter]) * gate_up[:, inter:], dtype, "silu_and_mul")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_eager_mlp(run, dtype):
    print(run(case_silu, device=DEVICE, dtype=dtype))


def case_rotary(device: str, dtype: torch.dtype, rope: dict) -> float:
    """Against llama.apply_rotary with the eager Rotary's cos/sin, through the kernel-mode
    Rotary's table (`rotary_cache`), as the model runs it."""
    from workers.models.llama import Rotary, rope_inv_freq

    gen = torch.Generator().manual_seed(7)
    h, kvh, d, max_pos = 6, 2, 64, 4096
    dev = torch.device(device)
    qkv = torch.randn(8, h + 2 * kvh, d, generator=gen).to(dtype).to(dev)
    q, k = qkv[:, :h], qkv[:, h : h + kvh]
    positions = torch.tensor([0, 1, 2, 15, 16, 511, 1000, 4095], device=dev)
    inv_freq = rope_inv_freq(rope, d)
    eager = Rotary(inv_freq, max_pos, kernels=False)
    want_q, want_k = (x.cpu() for x in eager.apply(eager.prepare(positions, dtype), q, k))
    kernel_rotary = Rotary(inv_freq, max_pos, kernels=True)
    kernel_rotary.apply(kernel_rotary.prepare(positions, dtype), q, k)
    return max(close(q.cpu(), want_q, dtype, "rotary q"), close(k.cpu(), want_k, dtype, "rotary k"))


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.mark.parametrize("rope", [{"rope_type": "default", "rope_theta": 10000.0}, LLAMA3_ROPE])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_matches_apply_rotary(run, dtype, rope):
    print(run(case_rotary, device=DEVICE, dtype=dtype, rope=rope))


H200_SHARED_BYTES = 232448  # the most shared memory one block may opt in to on sm_90
COMPILED: list = []  # filled in the compile-only child


def compile_only() -> None:
    """Child initializer: real Triton compilation for sm_90 with no GPU. A stand-in driver names
    the target, and a launch compiles (warmup) instead of running, recording the kernel."""
    import os

    os.environ.pop("TRITON_INTERPRET", None)
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    class Sm90:
        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device: int | None = None) -> int:
            return 0

        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", 90, 32)

    driver.set_active(Sm90())
    JITFunction.__getitem__ = lambda self, grid: (
        lambda *args, **kw: COMPILED.append((self.fn.__name__, self.run(*args, grid=grid, warmup=True, **kw)))
    )


def case_compile_sm90() -> list[tuple[str, int]]:
    """Every kernel variant the wrappers launch at production and test shapes, compiled for an
    H200 through the wrappers themselves (same arguments, same specialisation); (name, shared bytes)."""
    from workers.kernels.activation import silu_and_mul
    from workers.kernels.decode_attention import paged_decode_attention
    from workers.kernels.norm import fused_add_rms_norm, rms_norm
    from workers.kernels.prefill_attention import paged_prefill_attention
    from workers.kernels.rotary import apply_rotary_inplace
    from workers.kernels.store_kv import store_kv

    COMPILED.clear()
    # (dtype, kv heads, head dim, window, decode splits, prefill chunk lengths): bf16 at the
    # Llama-3.2-1B and 8B shapes with and without a window, fp32 at the tests' (largest tiles).
    shapes = (
        (torch.bfloat16, 8, 64, None, (1, 4), (16, 512)),
        (torch.bfloat16, 8, 128, 4096, (4,), (512,)),
        (torch.float32, 2, 128, None, (4,), (512,)),
    )
    for dtype, kvh, d, window, splits, max_qs in shapes:
        k_cache = torch.zeros(64, PAGE, kvh, d, dtype=dtype)
        tables, lens = torch.zeros(4, 32, dtype=torch.int32), torch.ones(4, dtype=torch.int32)
        q = torch.zeros(4, 4 * kvh, d, dtype=dtype)
        for n in splits:
            paged_decode_attention(q, k_cache, k_cache, tables, lens, 0.1, window, n)
        for max_q in max_qs:
            cu = torch.tensor([0, max_q], dtype=torch.int32)
            paged_prefill_attention(
                q.new_zeros(max_q, 4 * kvh, d), k_cache, k_cache, tables, cu, lens, max_q, 0.1, window
            )
    x = torch.zeros(4, 2048, dtype=torch.bfloat16)
    q = torch.zeros(4, 40, 64, dtype=torch.bfloat16)
    store_kv(
        q[:, 32:],
        q[:, 32:],
        torch.zeros(8, PAGE, 8, 64, dtype=torch.bfloat16),
        torch.zeros(8, PAGE, 8, 64, dtype=torch.bfloat16),
        lens,
    )
    apply_rotary_inplace(q[:, :32], q[:, 32:], lens, torch.zeros(8, 64, dtype=torch.bfloat16))
    rms_norm(q[:, :32], torch.ones(64, dtype=torch.bfloat16), 1e-5)
    fused_add_rms_norm(x, x.clone(), torch.ones(2048, dtype=torch.bfloat16), 1e-5)
    silu_and_mul(torch.zeros(4, 16384, dtype=torch.bfloat16))
    built = [(name, kernel.metadata.shared) for name, kernel in COMPILED]
    over = [b for b in built if b[1] > H200_SHARED_BYTES]
    assert not over, f"kernels over the H200's shared memory: {over}"
    return built


@pytest.mark.skipif(not CPU, reason="on CUDA every other test compiles and runs the kernels")
def test_kernels_compile_for_h200_without_a_gpu():
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=compile_only) as pool:
        built = pool.submit(case_compile_sm90).result(timeout=600)
    print(built)
    assert {name for name, _ in built} >= {
        "_decode_kernel",
        "_merge_kernel",
        "_prefill_kernel",
        "_store_kv_kernel",
        "_rotary_kernel",
        "_rms_norm_kernel",
        "_silu_and_mul_kernel",
    }


def case_runner(name: str, path: str) -> float:
    """The torch runner's kernel path (workers/attention.py KernelBatch, fused norms, RoPE table,
    SiLU) against its eager path on one checkpoint: chunked prefill, mixed steps, decodes over
    shuffled blocks give the same greedy tokens; the max abs difference of the KV caches."""
    import random

    from tests.test_model_fidelity import NUM_BLOCKS, run_greedy
    from workers.executors.torch_runner import TorchRunner

    runners = [
        TorchRunner(path, NUM_BLOCKS, 4, DEVICE, torch.float32, kernels=kernels, enforce_eager=True)
        for kernels in (False, True)
    ]
    rng = random.Random(9)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (19, 7, 30)]
    blocks = rng.sample(range(NUM_BLOCKS), NUM_BLOCKS)
    tables = [blocks[:12], blocks[12:24], blocks[24:40]]
    eager, fast = (run_greedy(r, prompts, tables, n=4, chunk=8) for r in runners)
    assert fast == eager, f"{name}: kernel path {fast} != eager {eager}"
    return (runners[0].kv_cache - runners[1].kv_cache).abs().max().cpu().item()


@pytest.mark.parametrize("name", ["qwen3-qknorm-headdim32-tied", "mistral-window5"])
def test_runner_kernel_path_matches_eager(run, name, tmp_path):
    """The integration: kernels at their real call sites (qkv views, the model's RoPE table) on
    tiny Qwen3 (GQA, q/k norm, tied) and Mistral (sliding window) checkpoints."""
    import transformers

    from tests.test_model_fidelity import CONFIGS, _randomize

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[name])
    _randomize(model)
    model.save_pretrained(tmp_path)
    err = run(case_runner, name=name, path=str(tmp_path))
    assert err < 1e-4, f"{name}: KV caches differ by {err:.3g}"
    print(err)


def test_attention_bench_dry_run_agrees_with_gather_and_flex(tmp_path):
    """bench.attention_kernels end to end on the CPU (interpreter, tiny shapes): JSON, PNG, and
    its Triton outputs against the gather path and FlexAttention's paged block mask."""
    out = tmp_path / "attn.json"
    subprocess.run(
        [sys.executable, "-m", "bench.attention_kernels", "--dry-run", "--out", str(out)],
        cwd=Path(__file__).resolve().parents[1],
        check=True,
        timeout=600,
        capture_output=True,
    )
    report = json.loads(out.read_text())
    entries = report["decode"] + report["prefill"]
    assert len(report["decode"]) == 4 and len(report["prefill"]) == 4 and out.with_suffix(".png").exists()
    assert max(e["max_abs_diff_vs_gather"] for e in entries) < 1e-5
    flexed = [e["methods"]["flex"] for e in entries if "flex" in e["methods"]]
    assert len(flexed) == 2 and max(f["max_abs_diff_vs_triton"] for f in flexed) < 1e-5, flexed


def test_available_follows_device_and_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert available("cuda")
    assert not available("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert available("cpu")
