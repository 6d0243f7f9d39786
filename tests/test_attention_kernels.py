"""The Triton attention kernels (workers/kernels: paged decode and prefill attention) against
float64 references and workers/attention.py's gather path, max abs error in every message; on
CUDA also replayed in a CUDA graph. Sizes are smaller on CPU, where the cases run in Triton's
interpreter (tests/test_kernels.py says how).
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.kernel_checks import CPU, DEVICE, PAGE, close, needs_triton, run  # noqa: F401 (run: a fixture)

# Context lengths of one decode batch (0 is a padding row); the long ones only on the GPU.
CONTEXTS = [0, 1, 16, 17, 100, 300] if CPU else [0, 1, 15, 16, 17, 100, 600, 1000, 2049, 4100]
# Prefill chunks (new tokens, context length) of one call: without a prefix, with one, 1 row; a
# 62-token prefix puts the diagonal one position short of a tile edge (BLOCK_N 32 or 64).
CHUNKS = (
    [(37, 37), (20, 100), (1, 50), (70, 132)] if CPU else [(300, 300), (512, 2560), (1, 50), (200, 4000), (77, 139)]
)

pytestmark = needs_triton
cuda_only_bf16_dot = pytest.mark.skipif(
    CPU, reason="Triton's interpreter does not support bf16 tl.dot (it multiplies the bit patterns, triton#11584)"
)


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
