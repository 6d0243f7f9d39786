"""Paged attention on the GPU: our Triton kernels, today's gather + SDPA path, FlexAttention.

Decode (batch 1/8/64/256 at context 600/2k/8k) and prefill (a 512- or 2048-token chunk over a
0- or 2k-token cached prefix) at the Llama-3.2-1B attention shape (32 q heads, 8 kv heads,
head dim 64) and the Llama-3-8B one (head dim 128), bf16, 16-token pages, shuffled block tables.
Each point is timed as CUDA-graph replays (no launch overhead) over enough separate per-layer
caches that K/V come from HBM, not L2; decode bandwidth is K/V bytes read over the time, against
the copy bandwidth measured here (bytes read + written by a large device-to-device copy).
Every point also records the largest difference between the Triton and gather outputs.

    python -m bench.attention_kernels --out bench/results/h200-attention-kernels.json [--sweep]
    python -m bench.attention_kernels --dry-run --out /tmp/attn.json   # CPU: interpreter, tiny shapes
"""

import argparse
import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass

import torch

PAGE = 16
L2_DEFEAT_BYTES = 256 << 20  # per-layer caches are repeated until a point reads this much
MAX_LAYERS = 64


@dataclass(frozen=True)
class Shape:
    name: str
    heads: int
    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class Plan:
    """What one run measures: shapes and points, and which points FlexAttention tries."""

    shapes: tuple[Shape, ...]
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    chunks: tuple[int, ...]
    prefixes: tuple[int, ...]
    flex_decode: tuple[tuple[str, int, int], ...]  # (shape, batch, context)
    flex_prefill: tuple[tuple[str, int, int], ...]  # (shape, chunk, prefix)
    dtype: torch.dtype
    rep_ms: int


GPU_PLAN = Plan(
    shapes=(Shape("llama-3.2-1b", 32, 8, 64), Shape("llama-3-8b", 32, 8, 128)),
    batches=(1, 8, 64, 256),
    contexts=(600, 2048, 8192),
    chunks=(512, 2048),
    prefixes=(0, 2048),
    flex_decode=(("llama-3.2-1b", 1, 8192), ("llama-3.2-1b", 64, 2048), ("llama-3.2-1b", 256, 600)),
    flex_prefill=(("llama-3.2-1b", 2048, 2048),),
    dtype=torch.bfloat16,
    rep_ms=10,
)
DRY_PLAN = Plan(
    shapes=(Shape("tiny-64", 4, 2, 64), Shape("tiny-128", 8, 2, 128)),
    batches=(1, 3),
    contexts=(40,),
    chunks=(20,),
    prefixes=(0, 24),
    flex_decode=(("tiny-64", 3, 40),),
    flex_prefill=(("tiny-64", 20, 24),),
    dtype=torch.float32,
    rep_ms=1,
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON path; the PNG goes beside it")
    p.add_argument("--dry-run", action="store_true", help="CPU, Triton's interpreter, tiny shapes, fp32")
    p.add_argument("--sweep", action="store_true", help="also time a few tile configs at one point each")
    p.add_argument(
        "--flex",
        choices=("some", "all", "none"),
        default="some",
        help="FlexAttention at the plan's few points (each compiles), all points, or none",
    )
    return p


class Timer:
    """Milliseconds per call: CUDA-graph replays on CUDA (events if capture fails), wall time on CPU."""

    def __init__(self, cuda: bool, rep_ms: int):
        self.cuda, self.rep_ms = cuda, rep_ms

    def __call__(self, fn) -> tuple[float, str]:
        if not self.cuda:
            fn()
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1000, "wall"
        import triton.testing

        try:
            return triton.testing.do_bench_cudagraph(fn, rep=self.rep_ms), "cudagraph"
        except Exception:  # a path that cannot be captured is still timed, with its launches
            torch.cuda.synchronize()
            return triton.testing.do_bench(fn, warmup=5, rep=self.rep_ms), "events"


def copy_bandwidth(dev: torch.device, timer: Timer, nbytes: int) -> float:
    """GB/s of a device-to-device copy, counting the bytes read and the bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    ms, _ = timer(lambda: dst.copy_(src))
    return 2 * nbytes / ms / 1e6


def caches(shape: Shape, num_blocks: int, layers: int, dtype: torch.dtype, dev: torch.device, gen: torch.Generator):
    """`layers` independent (k, v) caches with random contents."""
    size = (num_blocks, PAGE, shape.kv_heads, shape.head_dim)
    return [
        tuple(torch.empty(size, dtype=dtype, device=dev).normal_(generator=gen) for _ in range(2))
        for _ in range(layers)
    ]


def point(shape: Shape, num_seqs: int, context: int, dtype: torch.dtype, dev: torch.device, seed: int):
    """Shuffled block tables for num_seqs sequences of `context` tokens, enough layers to defeat L2."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    per_seq = math.ceil(context / PAGE)
    num_blocks = num_seqs * per_seq
    kv_bytes = 2 * num_seqs * context * shape.kv_heads * shape.head_dim * dtype.itemsize
    layers = max(1, min(MAX_LAYERS, math.ceil(L2_DEFEAT_BYTES / kv_bytes))) if dev.type == "cuda" else 1
    tables = torch.randperm(num_blocks, generator=gen, device=dev).view(num_seqs, per_seq).int()
    lens = torch.full((num_seqs,), context, dtype=torch.int32, device=dev)
    return caches(shape, num_blocks, layers, dtype, dev, gen), tables, lens, kv_bytes, gen


def per_layer(timer: Timer, layers: list, call) -> dict:
    """Time call(k, v) over every layer's cache; ms per call and how it was timed."""
    ms, how = timer(lambda: [call(k, v) for k, v in layers])
    return {"ms": ms / len(layers), "timer": how}


def diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def with_bandwidth(methods: dict, kv_bytes: int) -> dict:
    """Add GB/s of K/V read to every timed method."""
    for m in methods.values():
        if "ms" in m:
            m["gbps"] = kv_bytes / m["ms"] / 1e6
    return methods


def flex(
    q: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    num_q: int,
    layers: list,
    scale: float,
    timer: Timer,
    reference: torch.Tensor,
) -> dict:
    """FlexAttention with a paged block mask, timed like the others, or the errors that stopped it.
    Tried in turn: default kernel options, BLOCK_N = page size, and K/V expanded to the query batch
    (a stride-0 view) in case the compiled kernel refuses to broadcast a batch of 1."""
    errors = []
    try:
        from torch.nn.attention.flex_attention import flex_attention

        from bench.flex_paged import paged_block_mask, physical_kv

        mask = paged_block_mask(tables, lens, num_q, layers[0][0].shape[0], PAGE)
        attend = torch.compile(flex_attention, dynamic=False) if timer.cuda else flex_attention
    except Exception as e:  # recorded: the comparison says why FlexAttention could not run
        return {"error": [repr(e)[:400]]}
    qf = q.transpose(0, 1)[None] if num_q > 1 else q[:, :, None, :]  # [1, H, n, D] or [B, H, 1, D]
    for options, expand in ((None, False), ({"BLOCK_N": PAGE}, False), (None, True)):

        def call(k, v, options=options, expand=expand):
            k, v = physical_kv(k), physical_kv(v)
            if expand:
                k, v = k.expand(qf.shape[0], -1, -1, -1), v.expand(qf.shape[0], -1, -1, -1)
            return attend(qf, k, v, block_mask=mask, scale=scale, enable_gqa=True, kernel_options=options)

        try:
            out = call(*layers[0])
            out = out[0].transpose(0, 1) if num_q > 1 else out[:, :, 0]
            return {
                **per_layer(timer, layers, call),
                "kernel_options": options,
                "kv_expanded": expand,
                "max_abs_diff_vs_triton": diff(out, reference),
                "errors_before": errors,
            }
        except Exception as e:
            errors.append(f"kernel_options={options} expand={expand}: {e!r}"[:400])
            release(q.device)
    return {"error": errors}


def decode_point(
    shape: Shape, batch: int, context: int, plan: Plan, dev: torch.device, timer: Timer, with_flex: bool, config=None
) -> dict:
    from workers.attention import AttentionBatch, PagedAttention
    from workers.kernels.decode_attention import default_num_splits, paged_decode_attention

    layers, tables, lens, kv_bytes, gen = point(shape, batch, context, plan.dtype, dev, seed=batch + context)
    q = torch.empty(batch, shape.heads, shape.head_dim, dtype=plan.dtype, device=dev).normal_(generator=gen)
    scale = shape.head_dim**-0.5
    attn = PagedAttention(shape.heads, shape.kv_heads, shape.head_dim, None)
    meta = AttentionBatch(
        slot_mapping=lens.long(),
        decode_rows=torch.arange(batch, device=dev),
        decode_tables=tables.long(),
        decode_lens=lens.long(),
        prefills=[],
        num_decodes=batch,
    )

    def gather(k, v):
        attn.k_cache, attn.v_cache = k, v
        return attn._decode(q, meta)

    def ours(k, v):
        return paged_decode_attention(q, k, v, tables, lens, scale, config=config)

    reference = ours(*layers[0])
    methods = {"triton": per_layer(timer, layers, ours)}
    if config is None:
        methods["gather_sdpa"] = per_layer(timer, layers, gather)
    if with_flex:
        methods["flex"] = flex(q, tables, lens, 1, layers, scale, timer, reference)
    return {
        "shape": shape.name,
        "batch": batch,
        "context": context,
        "layers": len(layers),
        "kv_bytes": kv_bytes,
        "num_splits": default_num_splits(batch, shape.kv_heads, tables.shape[1] * PAGE, dev),
        "max_abs_diff_vs_gather": diff(reference, gather(*layers[0])),
        "methods": with_bandwidth(methods, kv_bytes),
    }


def prefill_point(
    shape: Shape, chunk: int, prefix: int, plan: Plan, dev: torch.device, timer: Timer, with_flex: bool, config=None
) -> dict:
    from workers.attention import PagedAttention, PrefillSeq
    from workers.kernels.prefill_attention import paged_prefill_attention

    context = prefix + chunk
    layers, tables, lens, kv_bytes, gen = point(shape, 1, context, plan.dtype, dev, seed=chunk + prefix)
    q = torch.empty(chunk, shape.heads, shape.head_dim, dtype=plan.dtype, device=dev).normal_(generator=gen)
    scale = shape.head_dim**-0.5
    cu = torch.tensor([0, chunk], dtype=torch.int32, device=dev)
    attn = PagedAttention(shape.heads, shape.kv_heads, shape.head_dim, None)
    seq = PrefillSeq(slice(0, chunk), prefix, tables[0].long())
    pos = torch.arange(prefix, context, device=dev)
    blocks, slots = tables[0].long()[pos // PAGE], pos % PAGE
    fresh = {id(k): (k[blocks, slots], v[blocks, slots]) for k, v in layers}  # the chunk's own K/V

    def gather(k, v):
        attn.k_cache, attn.v_cache = k, v
        return attn._prefill(q, *fresh[id(k)], seq)

    def ours(k, v):
        return paged_prefill_attention(q, k, v, tables, cu, lens, chunk, scale, config=config)

    reference = ours(*layers[0])
    methods = {"triton": per_layer(timer, layers, ours)}
    if config is None:
        methods["gather_sdpa"] = per_layer(timer, layers, gather)
    if with_flex:
        methods["flex"] = flex(q, tables, lens, chunk, layers, scale, timer, reference)
    flops = 4 * shape.heads * shape.head_dim * (chunk * prefix + chunk * (chunk + 1) / 2)
    for m in methods.values():
        if "ms" in m:
            m["tflops"] = flops / m["ms"] / 1e9
    return {
        "shape": shape.name,
        "chunk": chunk,
        "prefix": prefix,
        "layers": len(layers),
        "kv_bytes": kv_bytes,
        "flops": flops,
        "max_abs_diff_vs_gather": diff(reference, gather(*layers[0])),
        "methods": methods,
    }


def sweep(plan: Plan, dev: torch.device, timer: Timer) -> dict:
    """Tile configs at one decode point per shape and one prefill point: ms per config."""
    from workers.kernels.launch import TileConfig

    decode = [
        TileConfig(block_n=n, num_warps=w, num_stages=s)
        for n, w, s in ((32, 4, 2), (64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 8, 2))
    ]
    prefill = [
        TileConfig(block_m=m, block_n=n, num_warps=w, num_stages=s)
        for m, n, w, s in (
            (64, 64, 4, 2),
            (64, 64, 4, 3),
            (128, 64, 8, 2),
            (128, 64, 8, 3),
            (128, 32, 8, 3),
            (128, 128, 8, 2),
        )
    ]
    out: dict = {"decode": [], "prefill": []}
    small, large = plan.shapes[0], plan.shapes[-1]
    for shape, batch, context in (
        (small, plan.batches[-2], plan.contexts[1 % len(plan.contexts)]),
        (large, plan.batches[1 % len(plan.batches)], plan.contexts[-1]),
    ):
        for cfg in decode:
            entry = decode_point(shape, batch, context, plan, dev, timer, False, cfg)
            out["decode"].append(
                {
                    "shape": shape.name,
                    "batch": batch,
                    "context": context,
                    "config": cfg.to_json(),
                    "ms": entry["methods"]["triton"]["ms"],
                }
            )
    for cfg in prefill:
        entry = prefill_point(large, plan.chunks[-1], plan.prefixes[-1], plan, dev, timer, False, cfg)
        out["prefill"].append(
            {
                "shape": large.name,
                "chunk": plan.chunks[-1],
                "prefix": plan.prefixes[-1],
                "config": cfg.to_json(),
                "ms": entry["methods"]["triton"]["ms"],
            }
        )
    return out


def run(plan: Plan, dev: torch.device, flex_mode: str, with_sweep: bool) -> dict:
    timer = Timer(dev.type == "cuda", plan.rep_ms)
    import torch._dynamo

    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    setattr(torch._dynamo.config, limit, 64)  # --flex all compiles once per point
    start = time.perf_counter()
    report: dict = {
        "device": torch.cuda.get_device_name(dev) if timer.cuda else platform.processor() or "cpu",
        "torch": torch.__version__,
        "dtype": str(plan.dtype).removeprefix("torch."),
        "page": PAGE,
        "shapes": [asdict(s) for s in plan.shapes],
        "decode": [],
        "prefill": [],
    }
    report["copy_bandwidth_gbps"] = copy_bandwidth(dev, timer, (2 << 30) if timer.cuda else (64 << 20))
    for shape in plan.shapes:
        for batch in plan.batches:
            for context in plan.contexts:
                chosen = flex_mode == "all" or (
                    flex_mode == "some" and (shape.name, batch, context) in plan.flex_decode
                )
                report["decode"].append(decode_point(shape, batch, context, plan, dev, timer, chosen))
                release(dev)
        for chunk in plan.chunks:
            for prefix in plan.prefixes:
                chosen = flex_mode == "all" or (
                    flex_mode == "some" and (shape.name, chunk, prefix) in plan.flex_prefill
                )
                report["prefill"].append(prefill_point(shape, chunk, prefix, plan, dev, timer, chosen))
                release(dev)
    for entry in report["decode"]:
        for m in entry["methods"].values():
            if "gbps" in m:
                m["copy_fraction"] = m["gbps"] / report["copy_bandwidth_gbps"]
    if with_sweep:
        report["sweep"] = sweep(plan, dev, timer)
    import triton

    report["triton"] = triton.__version__
    report["wall_s"] = time.perf_counter() - start
    return report


def release(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def plot(report: dict, path: str) -> None:
    """Bars per point: decode time, decode bandwidth as a fraction of the copy's, prefill time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = ("triton", "gather_sdpa", "flex")
    panels = (
        ("decode", "decode: us per layer", "ms", 1000, True),
        ("decode", "decode: K/V GB/s / copy GB/s", "copy_fraction", 1, False),
        ("prefill", "prefill: us per layer", "ms", 1000, True),
    )
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(10, len(report["decode"]) * 0.7), 12))
    for ax, (kind, title, key, factor, log) in zip(axes, panels):
        entries = report[kind]
        labels = [
            f"{e['shape'].split('-')[-1]} b{e['batch']} c{e['context']}"
            if kind == "decode"
            else f"{e['shape'].split('-')[-1]} n{e['chunk']} p{e['prefix']}"
            for e in entries
        ]
        width = 0.8 / len(methods)
        for i, name in enumerate(methods):
            values = [e["methods"].get(name, {}).get(key, 0) * factor for e in entries]
            ax.bar([x + i * width for x in range(len(entries))], values, width, label=name)
        ax.set_xticks([x + width for x in range(len(entries))], labels, rotation=60, fontsize=7)
        ax.set_title(title)
        if log:
            ax.set_yscale("log")
        else:
            ax.axhline(1.0, color="k", linestyle="--", linewidth=1)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"paged attention, {report['device']}, {report['dtype']}, page {report['page']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.dry_run:
        from workers.kernels.interpreter import enable

        enable()  # before anything imports triton
        plan, dev = DRY_PLAN, torch.device("cpu")
    else:
        plan, dev = GPU_PLAN, torch.device("cuda")
    with torch.inference_mode():
        report = run(plan, dev, args.flex, args.sweep)
    report["command"] = "python -m bench.attention_kernels " + " ".join(sys.argv[1:] if argv is None else argv)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    plot(report, args.out.removesuffix(".json") + ".png")
    print(json.dumps({k: report[k] for k in ("device", "copy_bandwidth_gbps", "wall_s")}))


if __name__ == "__main__":
    main()
