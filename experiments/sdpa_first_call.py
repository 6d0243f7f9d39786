"""What the first call at a new shape costs on CUDA, against a repeat at the same shape:
scaled_dot_product_attention at decode shapes (masked, GQA; cuDNN on and off) and a matmul
at new row counts. Why the torch runner pads attention shapes to buckets (workers/attention.py).

    python experiments/sdpa_first_call.py --out bench/results/h200-sdpa-first-call.json
"""

import argparse
import json
import random
import time

import torch
import torch.nn.functional as F


def timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return round((time.perf_counter() - t) * 1000, 2)


def sdpa_shapes(dev: str, rnd: random.Random, shapes: int = 12) -> dict:
    """First and repeat ms of one decode attention call per random (sequences, context) shape."""
    firsts, repeats = [], []
    for _ in range(shapes):
        s, ctx = rnd.randint(20, 200), rnd.randint(70, 80) * 16
        q = torch.randn(s, 32, 1, 128, device=dev, dtype=torch.bfloat16)
        k = torch.randn(s, 8, ctx, 128, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        mask = (torch.arange(ctx, device=dev)[None, :] < torch.randint(1, ctx, (s, 1), device=dev))[:, None, None, :]

        def call():
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

        firsts.append(timed(call))
        repeats.append(timed(call))
    return {"first_ms": firsts, "repeat_ms": repeats}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    out = {}
    for cudnn in (True, False):
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
        out[f"sdpa_cudnn_{cudnn}"] = sdpa_shapes(args.device, random.Random(cudnn))
    torch.backends.cuda.enable_cudnn_sdp(True)
    w = torch.randn(14336, 4096, device=args.device, dtype=torch.bfloat16)
    firsts, repeats = [], []
    for m in random.Random(5).sample(range(100, 2048), 12):
        x = torch.randn(m, 4096, device=args.device, dtype=torch.bfloat16)
        firsts.append(timed(lambda: x @ w.t()))
        repeats.append(timed(lambda: x @ w.t()))
    out["matmul"] = {"first_ms": firsts, "repeat_ms": repeats}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
