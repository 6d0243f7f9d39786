"""The attention benchmark's measurements (bench/attention_kernels.py): a call timed as CUDA-graph
replays (wall time on the CPU), the copy bandwidth the K/V reads are held against, and one decode
or prefill point timed for our Triton kernels, the gather + SDPA path and FlexAttention, with the
largest difference between their outputs; a sweep of tile configs at a few points."""

import time

import torch

from bench.attention_plan import PAGE, Plan, Shape, point, release


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
