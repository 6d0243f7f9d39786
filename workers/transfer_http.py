"""P/D over HTTP: the prefill leg streams its blocks to the decode worker's `/kv/import`
(or hands them over by CUDA IPC, or with `--kv-transport nixl` writes them by NIXL, falling back
to the stream: workers/transfer_ipc.py, workers/transfer_nixl.py).

Internal calls carry the fleet's shared token (`x-kvgate-token`); a worker started without
one refuses imports, so a public port never accepts foreign K/V.
"""

import asyncio
import logging
import time
from collections.abc import Callable

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from workers.background import background
from workers.http_guard import BodyTooLarge, read_body_writable
from workers.internal_auth import TOKEN_HEADER, token_matches
from workers.kv_host import KVHost
from workers.protocol import error_body
from workers.sampling_params import InvalidRequest
from workers.tracing import WorkerTracing
from workers.transfer import MAX_HEADER_BYTES, KVPayload, decode, encode_header

log = logging.getLogger("kvgate.transfer")
CHUNK = 1 << 20
TRANSPORTS = ("http", "ipc", "nixl")


class TransferService:
    def __init__(
        self,
        engine,
        served_model: str,
        token: str | None,
        transport: str = "http",
        nixl_quarantine_s: float | None = None,
    ):
        self.host = KVHost(engine)
        self.token = token
        self.transport = transport
        self.spec = self.host.spec(served_model)
        # the largest /kv/import worth reading: a header and K/V for every block of the pool
        self.max_import_bytes = MAX_HEADER_BYTES + engine.pool.num_blocks * self.spec.block_bytes()
        self.client: httpx.AsyncClient | None = None
        self.sent_bytes = dict.fromkeys(TRANSPORTS, 0)  # exports' bytes and seconds, by the transport that moved them
        self.sent_seconds = dict.fromkeys(TRANSPORTS, 0.0)
        self.failures = 0
        self.sending = 0  # exports between a finished prefill and the end of their POST
        self.backlog_bytes = 0  # their K/V bytes: what is ahead of a new export on this link
        self.received_seconds = {"body": 0.0, "decode": 0.0, "import": 0.0}
        self.tracing = WorkerTracing()  # the server's, once it sets it
        self.nixl = self._start_nixl(self.host.worker_id, nixl_quarantine_s) if transport == "nixl" else None

    def _start_nixl(self, worker_id: str, quarantine_s: float | None):
        """The NIXL side of this worker (workers/transfer_nixl.py), or None, with HTTP in its
        place, where NIXL cannot run (not installed, no KV tensor: the sim executor)."""
        from workers.nixl_agent import NixlError
        from workers.transfer_nixl import NixlTransfer

        try:
            return NixlTransfer.start(self, worker_id, quarantine_s)
        except NixlError as e:
            log.warning("--kv-transport nixl unavailable, using http: %s", e)
            self.transport = "http"
            return None

    def count_sent(self, transport: str, nbytes: int, seconds: float) -> None:
        self.sent_bytes[transport] += nbytes
        self.sent_seconds[transport] += seconds

    def routes(self) -> list[Route]:
        """The internal KV endpoints: `/kv/import`, and with NIXL `/kv/nixl{,/reserve,/commit}`."""
        routes = [Route("/kv/import", self.import_endpoint, methods=["POST"])]
        if self.nixl is not None:
            routes += [
                Route("/kv/nixl", self.nixl.info_endpoint),
                Route("/kv/nixl/reserve", self.nixl.reserve_endpoint, methods=["POST"]),
                Route("/kv/nixl/commit", self.nixl.commit_endpoint, methods=["POST"]),
            ]
        return routes

    def exporter(self, url: str, loop: asyncio.AbstractEventLoop, cache_salt: str | None = None, span=None) -> Callable:
        """An engine-thread callback that ships a finished prefill's blocks to `url`. It only
        takes a reference on the blocks: copying tens of MB there would stall every stream
        decoding on this worker, so `send` reads them on another thread and lets them go.
        `span` is the request's, which the export's span is a child of."""

        def export(hashes: list[int], tokens: list[list[int]], block_ids: list[int], parent: int | None) -> None:
            held = self.host.hold_for_export(block_ids)
            loop.call_soon_threadsafe(self._start_send, url, hashes, tokens, held, cache_salt, span, parent)

        return export

    def _start_send(
        self,
        url: str,
        hashes: list[int],
        tokens: list[list[int]],
        held: list,
        cache_salt: str | None,
        span=None,
        parent: int | None = None,
    ) -> None:
        """Counted from here, on the loop, so a draining worker waits for the export too."""
        nbytes = len(hashes) * self.spec.block_bytes()
        self.sending += 1
        self.backlog_bytes += nbytes
        headers: dict[str, str] = {}
        export_span = self.tracing.export_span(span, url, len(hashes), sum(map(len, tokens)), headers)
        task = background(self.send(url, hashes, tokens, held, cache_salt, headers, parent))
        task.add_done_callback(lambda t: self._sent(t, nbytes))
        if export_span is not None:
            task.add_done_callback(lambda t: export_span.end())

    def _sent(self, task: asyncio.Task, nbytes: int) -> None:
        self.sending -= 1
        self.backlog_bytes -= nbytes
        if not task.cancelled() and task.exception() is not None:
            self.failures += 1
            log.warning("KV export failed: %r", task.exception())

    async def send(
        self,
        url: str,
        hashes: list[int],
        tokens: list[list[int]],
        held: list,
        cache_salt: str | None = None,
        headers: dict[str, str] | None = None,
        parent: int | None = None,
    ) -> bool:
        """Ship the held blocks (a chain continuing `parent`), then release them: written by NIXL
        straight from the cache, else read and sent as an IPC handle (falling back to bytes if
        refused) or as streamed bytes.

        Failures only cost the decode side a recompute, so they are counted and logged.
        """
        header = encode_header(self.spec, hashes, tokens, parent, cache_salt)
        ids = [b.block_id for b in held]
        try:
            if self.nixl is not None:
                if await self.nixl.send(self._client(), url, header, ids, headers or {}):
                    return True
            kv = await asyncio.to_thread(self.host.read_blocks, ids)
        finally:
            self.host.release(held)
        if self.transport == "ipc" and not isinstance(kv, bytes):
            from workers.transfer_ipc import share

            if await self._post(url, [header, share(kv)], "ipc", kv.nbytes, headers):
                return True
        if not isinstance(kv, bytes):
            kv = await asyncio.to_thread(self.host.to_bytes, kv)
        view = memoryview(kv)
        pieces = [header] + [view[i : i + CHUNK] for i in range(0, len(view), CHUNK)]
        return await self._post(url, pieces, "http", len(kv), headers)

    async def _post(
        self, url: str, pieces: list, transport: str, nbytes: int, headers: dict[str, str] | None = None
    ) -> bool:
        """POST `pieces` to `/kv/import`: the bytes (`http`) or an IPC handle (`ipc`)."""
        ctype = "application/x-kvgate-ipc" if transport == "ipc" else "application/octet-stream"

        async def body():
            for piece in pieces:
                yield bytes(piece)

        t0 = time.perf_counter()
        try:
            r = await self._client().post(
                url.rstrip("/") + "/kv/import",
                content=body(),
                headers={**(headers or {}), TOKEN_HEADER: self.token or "", "content-type": ctype},
            )
            r.raise_for_status()
        except httpx.HTTPError as e:
            self.failures += 1
            detail = e.response.text[:300] if isinstance(e, httpx.HTTPStatusError) else ""
            log.warning("KV export (%s) to %s failed: %s %s", ctype, url, e, detail)
            return False
        self.count_sent(transport, nbytes, time.perf_counter() - t0)
        return True

    def _client(self) -> httpx.AsyncClient:
        # idle connections end before the peer's 5 s keep-alive does (see gateway/proxy.py)
        limits = httpx.Limits(keepalive_expiry=4.0)
        self.client = self.client or httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=2.0), limits=limits)
        return self.client

    def authorised(self, request: Request) -> bool:
        return token_matches(request.headers.get(TOKEN_HEADER), self.token)

    async def import_endpoint(self, request: Request) -> Response:
        """POST /kv/import: verify, then write the blocks into the prefix cache.

        The engine thread only reserves and publishes blocks (bookkeeping); decoding the body
        and writing tens of MB of K/V run on other threads, so decoding streams do not stall."""
        if not self.authorised(request):
            return JSONResponse(
                error_body("KV import needs the fleet's internal token", "permission_error", "forbidden"),
                status_code=403,
            )
        span = self.tracing.import_span(request.headers)
        try:
            resp = await self._import_request(request, span)
        finally:
            if span is not None:
                span.end()
        return resp

    async def _import_request(self, request: Request, span) -> Response:
        t0 = time.perf_counter()
        try:
            body = await read_body_writable(request, self.max_import_bytes)
        except BodyTooLarge as e:
            return JSONResponse(error_body(str(e), code="bad_kv_transfer"), status_code=413)
        ipc = request.headers.get("content-type") == "application/x-kvgate-ipc"
        t1 = time.perf_counter()
        try:
            payload = await asyncio.to_thread(decode, body, self.spec, self.host.kv_seed, ipc)
        except InvalidRequest as e:
            return JSONResponse(error_body(str(e), code=e.code), status_code=400)
        except Exception as e:
            if not ipc:  # a checked header and payload fail only as InvalidRequest: this is a bug
                raise
            return JSONResponse(error_body(f"cannot open KV IPC handle: {e}", code="ipc_unavailable"), status_code=422)
        t2 = time.perf_counter()
        try:
            imported, present = await asyncio.shield(background(self._import(payload)))
        except Exception as e:
            log.exception("KV import failed")
            return JSONResponse(
                error_body(f"KV import failed: {e}", "server_error", "kv_import_failed"), status_code=500
            )
        if span is not None:
            span.set_attributes(
                {
                    "kvgate.blocks": len(payload.hashes),
                    "kvgate.imported_blocks": imported,
                    "kvgate.present_blocks": present,
                    "kvgate.tokens": len(payload.hashes) * self.spec.block_size,
                }
            )
        for key, dt in (("body", t1 - t0), ("decode", t2 - t1), ("import", time.perf_counter() - t2)):
            self.received_seconds[key] += dt
        return JSONResponse(
            {"imported": imported, "present": present, "dropped": len(payload.hashes) - imported - present}
        )

    async def _import(self, payload: KVPayload) -> tuple[int, int]:
        """Reserve, write, publish. Run as its own task: cancelled half-way it would leave blocks
        held, or freed while a thread still writes them."""
        host = self.host
        res = await asyncio.wrap_future(host.reserve(payload))
        try:
            if res.fresh:
                await asyncio.to_thread(
                    host.write_blocks, res.fresh_ids, payload.data, res.positions, len(payload.hashes)
                )
        except Exception:
            host.release(res.blocks)
            raise
        return await asyncio.wrap_future(host.publish(payload, res))

    def stats(self) -> dict:
        return {
            "transport": self.transport,
            "sent_bytes": (nbytes := sum(self.sent_bytes.values())),
            "sent_seconds": (seconds := sum(self.sent_seconds.values())),
            "gbps": nbytes / seconds / 1e9 if seconds else None,
            "sent_by_transport": {
                t: {"bytes": self.sent_bytes[t], "seconds": self.sent_seconds[t]} for t in TRANSPORTS
            },
            "failures": self.failures,
            "backlog_bytes": self.backlog_bytes,
            "received_seconds": self.received_seconds,
            **({"nixl": self.nixl.stats()} if self.nixl is not None else {}),
        }

    async def close(self) -> None:
        if self.nixl is not None:
            await self.nixl.peers.close()
        if self.client:
            await self.client.aclose()
