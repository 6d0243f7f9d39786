"""The Triton kernels (workers/kernels) but attention's against eager torch, max abs error in every
message: store_kv, the norms, SiLU, rotary; all of them compiled for sm_90 without a GPU, and the
torch runner's kernel path against its eager one. Attention: tests/test_attention_kernels.py.

On CUDA the cases run in this process. On CPU they run through Triton's interpreter in one child
process: TRITON_INTERPRET=1 must be set before triton's first import and this pytest process is
shared with every other test file, so the parent never imports triton and the child (spawned,
`interpreter.enable` as its initializer) does all the kernel work.
"""

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

from tests.kernel_checks import CPU, DEVICE, PAGE, close, needs_triton, run  # noqa: F401 (run: a fixture)
from workers.kernels import available

pytestmark = needs_triton


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


def test_available_follows_device_and_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert available("cuda")
    assert not available("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert available("cpu")
