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
    def __init__(self, engine, served_model: str, token: str | None):
        self.engine = engine
        self.token = token
        self.spec = executor_spec(served_model, engine.config.block_size, engine.executor)
        self.client: httpx.AsyncClient | None = None
        self.sent_bytes = 0
        self.sent_seconds = 0.0
        self.failures = 0

    def exporter(self, url: str, loop: asyncio.AbstractEventLoop) -> Callable:
        """An engine-thread callback that ships a finished prefill's blocks to `url`."""
        def export(hashes: list[int], tokens: list[list[int]], data: bytes) -> None:
            self.engine.stats.kv_exported_blocks += len(hashes)
            loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self.send(url, hashes, tokens, data)))
        return export

    async def send(self, url: str, hashes: list[int], tokens: list[list[int]], data: bytes) -> bool:
        """Stream header then payload in 1 MiB pieces; failures only cost the decode side a recompute."""
        header = encode_header(self.spec, hashes, tokens, None)
        view = memoryview(data)

        async def body():
            yield header
            for i in range(0, len(view), CHUNK):
                yield bytes(view[i:i + CHUNK])

        self.client = self.client or httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=2.0))
        t0 = time.perf_counter()
        try:
            r = await self.client.post(url.rstrip("/") + "/kv/import", content=body(),
                                       headers={"x-kvgate-token": self.token or "",
                                                "content-type": "application/octet-stream"})
            r.raise_for_status()
        except httpx.HTTPError as e:
            self.failures += 1
            log.warning("KV export to %s failed: %s", url, e)
            return False
        self.sent_seconds += time.perf_counter() - t0
        self.sent_bytes += len(header) + len(data)
        return True

    def authorised(self, request: Request) -> bool:
        given = request.headers.get("x-kvgate-token", "")
        return bool(self.token) and hmac.compare_digest(given, self.token)

    async def import_endpoint(self, request: Request) -> Response:
        """POST /kv/import: verify, then write the blocks into the prefix cache (engine thread)."""
        if not self.authorised(request):
            return JSONResponse(error_body("KV import needs the fleet's internal token", "permission_error",
                                           "forbidden"), status_code=403)
        body = await request.body()
        try:
            payload = await asyncio.to_thread(decode, body, self.spec, self.engine.kv.seed)
        except InvalidRequest as e:
            return JSONResponse(error_body(str(e), code=e.code), status_code=400)
        eng = self.engine
        imported, present = await asyncio.wrap_future(
            eng.call(lambda: import_payload(eng.pool, eng.executor, payload)))
        eng.stats.kv_imported_blocks += imported
        return JSONResponse({"imported": imported, "present": present,
                             "dropped": len(payload.hashes) - imported - present})

    async def close(self) -> None:
        if self.client:
            await self.client.aclose()
