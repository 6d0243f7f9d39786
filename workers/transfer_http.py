"""P/D over HTTP: the prefill leg streams its blocks to the decode worker's `/kv/import`.

Internal calls carry the fleet's shared token (`x-kvgate-token`); a worker started without
one refuses imports, so a public port never accepts foreign K/V.
"""
import asyncio
import hmac
import logging
import time
from collections.abc import Callable

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from workers.protocol import error_body
from workers.sampling_params import InvalidRequest
from workers.transfer import decode, encode_header, executor_spec, import_payload

log = logging.getLogger("kvgate.transfer")
CHUNK = 1 << 20


class TransferService:
    def __init__(self, engine, served_model: str, token: str | None, transport: str = "http"):
        self.engine = engine
        self.token = token
        self.transport = transport
        self.spec = executor_spec(served_model, engine.config.block_size, engine.executor)
        self.client: httpx.AsyncClient | None = None
        self.sent_bytes = 0
        self.sent_seconds = 0.0
        self.failures = 0
        self.received_seconds = {"body": 0.0, "decode": 0.0, "import": 0.0}

    def exporter(self, url: str, loop: asyncio.AbstractEventLoop) -> Callable:
        """An engine-thread callback that ships a finished prefill's blocks to `url`."""
        def export(hashes: list[int], tokens: list[list[int]], block_ids: list[int]) -> None:
            self.engine.stats.kv_exported_blocks += len(hashes)
            ex = self.engine.executor
            kv = ex.read_blocks(block_ids) if self.transport == "ipc" else ex.export_bytes(block_ids)
            loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self.send(url, hashes, tokens, kv)))
        return export

    async def send(self, url: str, hashes: list[int], tokens: list[list[int]], kv) -> bool:
        """Ship blocks: an IPC handle (falling back to bytes if refused) or streamed bytes.

        Failures only cost the decode side a recompute, so they are counted and logged.
        """
        header = encode_header(self.spec, hashes, tokens, None)
        if not isinstance(kv, bytes):
            from workers.transfer_ipc import share
            if await self._post(url, [header, share(kv)], "application/x-kvgate-ipc", kv.nbytes):
                return True
            kv = self.engine.executor.to_bytes(kv)
        view = memoryview(kv)
        pieces = [header] + [view[i:i + CHUNK] for i in range(0, len(view), CHUNK)]
        return await self._post(url, pieces, "application/octet-stream", len(kv))

    async def _post(self, url: str, pieces: list, ctype: str, nbytes: int) -> bool:
        async def body():
            for piece in pieces:
                yield bytes(piece)

        self.client = self.client or httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=2.0))
        t0 = time.perf_counter()
        try:
            r = await self.client.post(url.rstrip("/") + "/kv/import", content=body(),
                                       headers={"x-kvgate-token": self.token or "", "content-type": ctype})
            r.raise_for_status()
        except httpx.HTTPError as e:
            self.failures += 1
            detail = e.response.text[:300] if isinstance(e, httpx.HTTPStatusError) else ""
            log.warning("KV export (%s) to %s failed: %s %s", ctype, url, e, detail)
            return False
        self.sent_seconds += time.perf_counter() - t0
        self.sent_bytes += nbytes
        return True

    def authorised(self, request: Request) -> bool:
        given = request.headers.get("x-kvgate-token", "")
        return bool(self.token) and hmac.compare_digest(given, self.token)

    async def import_endpoint(self, request: Request) -> Response:
        """POST /kv/import: verify, then write the blocks into the prefix cache (engine thread)."""
        if not self.authorised(request):
            return JSONResponse(error_body("KV import needs the fleet's internal token", "permission_error",
                                           "forbidden"), status_code=403)
        t0 = time.perf_counter()
        body = await request.body()
        ipc = request.headers.get("content-type") == "application/x-kvgate-ipc"
        t1 = time.perf_counter()
        try:
            payload = await asyncio.to_thread(decode, body, self.spec, self.engine.kv.seed, ipc)
        except InvalidRequest as e:
            return JSONResponse(error_body(str(e), code=e.code), status_code=400)
        except Exception as e:
            return JSONResponse(error_body(f"cannot open KV IPC handle: {e}", code="ipc_unavailable"),
                                status_code=422)
        eng = self.engine
        t2 = time.perf_counter()
        imported, present = await asyncio.wrap_future(
            eng.call(lambda: import_payload(eng.pool, eng.executor, payload)))
        eng.stats.kv_imported_blocks += imported
        for key, dt in (("body", t1 - t0), ("decode", t2 - t1), ("import", time.perf_counter() - t2)):
            self.received_seconds[key] += dt
        return JSONResponse({"imported": imported, "present": present,
                             "dropped": len(payload.hashes) - imported - present})

    def stats(self) -> dict:
        return {"transport": self.transport, "sent_bytes": self.sent_bytes, "sent_seconds": self.sent_seconds,
                "gbps": self.sent_bytes / self.sent_seconds / 1e9 if self.sent_seconds else None,
                "failures": self.failures, "received_seconds": self.received_seconds}

    async def close(self) -> None:
        if self.client:
            await self.client.aclose()

