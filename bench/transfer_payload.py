"""KV payload throughput per transport, 32 MiB to 1 GiB: NIXL vs HTTP vs CUDA IPC, in one run.

A real decode worker (random weights shaped so that one 16-token block is 1 MiB of K/V) receives
payloads from this process, which plays the prefill worker with a KV cache of the same shape and
uses the workers' own code for each transport, from its cache into the worker's cache:

  http  gather the blocks, serialise, stream to POST /kv/import (the worker decodes and writes);
  ipc   gather on the GPU, POST the CUDA IPC handle to /kv/import (CUDA only);
  nixl  POST /kv/nixl/reserve, one NIXL WRITE by descriptor from the registered cache into the
        granted blocks, POST /kv/nixl/commit (the worker publishes).

Every payload is a fresh chain of hashes (distinct tokens), so every block really moves and the
worker re-derives every hash. The clock runs from the start of the sender's work to the
worker's answer; prefill compute is not part of it (bench/transfer_throughput.py has that).
JSON (with each transport's fitted link, bench/transfer_model.py, which the simulator reads)
and PNG out.
"""

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from bench.random_model import add_args, make_model
from bench.transfer_model import fit
from bench.transfer_throughput import plot
from gateway.procs import Worker
from workers.executors.torch_runner import TorchRunner
from workers.internal_auth import internal_headers
from workers.kv.hashing import block_hashes, seed_hash
from workers.model_store import served_name
from workers.models.loader import default_dtype
from workers.transfer import KVSpec, encode_header

TOKEN = "bench-token"
BLOCK = 16
MIB = 1 << 20


class Sender:
    """The prefill side: a KV cache shaped as the worker's, and one payload per `send`."""

    def __init__(self, spec: KVSpec, num_blocks: int, device: str, url: str, seed: int):
        dtype = getattr(torch, spec.dtype)
        self.cache = torch.randn(
            spec.num_layers, 2, num_blocks, BLOCK, spec.num_kv_heads, spec.head_dim, dtype=dtype, device=device
        )
        self.spec, self.url, self.seed = spec, url, seed
        self.client = httpx.AsyncClient(timeout=600, headers=internal_headers(TOKEN))
        self.nixl = None
        self.rng = random.Random(0)
        self.token = TOKEN  # what NixlTransfer reads

    def count_sent(self, transport: str, nbytes: int, seconds: float) -> None:
        """NixlTransfer counts its WRITEs here; the bench times each send itself."""

    def header(self, n: int) -> bytes:
        tokens = [self.rng.randrange(100, 30000) for _ in range(n * BLOCK)]
        hashes = block_hashes(tokens, BLOCK, self.seed)
        return encode_header(self.spec, hashes, [tokens[i * BLOCK : (i + 1) * BLOCK] for i in range(n)], None)

    async def send(self, transport: str, n: int) -> dict:
        header, ids = self.header(n), list(range(n))
        t0 = time.perf_counter()
        if transport == "nixl":
            ok = await self._nixl(header, ids)
        else:
            kv = self.cache[:, :, torch.tensor(ids, device=self.cache.device)]
            if transport == "ipc":
                from workers.transfer_ipc import share

                torch.cuda.synchronize()
                pieces, ctype = [header, share(kv)], "application/x-kvgate-ipc"
            else:
                raw = memoryview(TorchRunner.to_bytes(kv))
                pieces, ctype = (
                    [header] + [raw[i : i + MIB] for i in range(0, len(raw), MIB)],
                    "application/octet-stream",
                )
            ok = await self._post(pieces, ctype)
        secs = time.perf_counter() - t0
        nbytes = n * self.spec.block_bytes()
        return {
            "transport": transport,
            "blocks": n,
            "bytes": nbytes,
            "seconds": secs,
            "gbps": nbytes / secs / 1e9 if ok else None,
            "ok": ok,
        }

    async def _post(self, pieces: list, ctype: str) -> bool:
        async def body():
            for piece in pieces:
                yield bytes(piece)

        r = await self.client.post(self.url + "/kv/import", content=body(), headers={"content-type": ctype})
        return r.status_code == 200 and r.json()["imported"] > 0

    async def _nixl(self, header: bytes, ids: list[int]) -> bool:
        from workers.nixl_agent import NixlAgent
        from workers.transfer_nixl import NixlTransfer

        if self.nixl is None:
            self.nixl = NixlTransfer(self, NixlAgent("bench-sender", self.cache))
        return await self.nixl.send(self.client, self.url, header, ids, {})


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    add_args(p)
    p.set_defaults(layers=16, hidden=256, intermediate=512, heads=8, kv_heads=4, head_dim=128)
    p.add_argument("--device", default="cpu", help="the sender's (prefill side's) device")
    p.add_argument("--decode-device", help="the decode worker's device (default: --device; cuda:1 for two GPUs)")
    p.add_argument("--transports", default="nixl,http,ipc", type=lambda s: s.split(","))
    p.add_argument("--mib", default="32,128,512,1024", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="bench/results/transfer_payload.json")
    args = p.parse_args(argv)
    transports = [t for t in args.transports if t != "ipc" or args.device.startswith("cuda")]
    skipped = {t: "CUDA IPC needs a GPU" for t in args.transports if t not in transports}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(args, Path(tmp))
        dtype = str(default_dtype(args.device)).removeprefix("torch.")
        spec = KVSpec(served_name(str(model)), BLOCK, dtype, args.layers, args.kv_heads, args.head_dim)
        blocks = [m * MIB // spec.block_bytes() for m in args.mib]
        w = Worker(
            "torch",
            "payload-d",
            model=str(model),
            extra=[
                "--role",
                "decode",
                "--internal-token",
                TOKEN,
                "--kv-transport",
                "nixl",
                "--device",
                args.decode_device or args.device,
                "--num-blocks",
                str(max(blocks) + 16),
                "--block-size",
                str(BLOCK),
            ],
        )
        try:
            w.ready(300)
            sender = Sender(spec, max(blocks), args.device, w.url, seed_hash(spec.model, BLOCK))

            async def run() -> None:
                for t in transports:
                    await sender.send(t, blocks[0])  # connect, warm up
                    for n in blocks:
                        for _ in range(args.repeats):
                            rows.append(await sender.send(t, n))
                            print(
                                f"{t} {rows[-1]['bytes'] / MIB:.0f} MiB: {rows[-1]['gbps']} GB/s",
                                file=sys.stderr,
                                flush=True,
                            )
                await sender.client.aclose()

            asyncio.run(run())
        finally:
            w.stop()
    summary = {
        t: {
            str(m): max((r["gbps"] or 0) for r in rows if r["transport"] == t and r["blocks"] == n)
            for m, n in zip(args.mib, blocks)
        }
        for t in transports
    }
    links = {t: fit(t, rows).to_json() for t in transports if sum(r["ok"] for r in rows if r["transport"] == t) >= 2}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "command": "python -m bench.transfer_payload " + " ".join(argv or sys.argv[1:]),
                "config": vars(args),
                "spec": spec.__dict__,
                "block_bytes": spec.block_bytes(),
                "best_gbps_by_mib": summary,
                "links": links,
                "not_run": skipped,
                "runs": rows,
            },
            indent=1,
        )
    )
    plot(rows, out.with_suffix(".png"))
    print(json.dumps({"best_gbps_by_mib": summary, "links": links}, indent=1))


if __name__ == "__main__":
    main()
