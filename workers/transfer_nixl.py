"""P/D over NIXL: the prefill worker WRITEs its blocks straight into blocks the decode worker reserved.

Each worker registers its whole KV cache tensor (CPU or GPU memory) with a NIXL agent (UCX
backend: workers/nixl_agent.py) at start, and serves the agent's metadata and the cache's layout on `GET /kv/nixl`
(internal token; also in `/state`, and with `--redis` under its agent's key there, which a
prefill worker reads first: workers/nixl_peers.py). A transfer takes the same three steps as
over HTTP (workers/transfer.py), with only the bytes moving out of band:

  1. reserve (decode side, `POST /kv/nixl/reserve`): the checked KVG1 header, no payload; every
     hash is re-derived from its tokens, then the blocks are held and the fresh ones' ids answered;
  2. write (prefill side): the layout of the agent the grant names (cached, Redis or HTTP), then
     one NIXL WRITE from its own cache into those blocks, by descriptor (one per layer, K or V,
     and run of consecutive block ids on both sides);
  3. publish (decode side, `POST /kv/nixl/commit`): the blocks enter the prefix cache, or are
     let go when the write failed.

A reservation whose commit does not come in time is let go, so a prefill worker that dies
mid-transfer costs the decode side only a recompute; a sender whose write fails falls back to
HTTP. Whoever holds the fleet token and the metadata can write into the registered cache, as
with any RDMA peer: the metadata is served to token holders only.

A WRITE cannot be taken back: NIXL has no abort, and releasing a transfer in progress may leave
its bytes in flight. So a block the peer may still write into is never freed for reuse:
  - the writer posts its WRITE only while the grant is young (before half its life, counted
    from when it asked) and gives up at that same deadline, reporting whether its transfer is
    settled (done or failed: nothing in flight) or may still be landing;
  - the decode side quarantines the fresh blocks of a reservation that expired, or whose
    writer reports an unsettled failure: they stay held, never published (and kept
    progressing, so a late WRITE can end), until a settled commit comes (released
    `completed`) or the quarantine's bound has passed (`timed_out`): another lifetime by
    default, so a block is reused no sooner than 1.5 lifetimes after its writer stopped, or
    `--nixl-quarantine-s`. A writer that dies mid-WRITE so holds its blocks at most one
    lifetime plus the bound.
"""

import asyncio
import json
import logging
import threading
import time
import uuid
from dataclasses import asdict, dataclass

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from workers.background import background
from workers.http_guard import BodyTooLarge, read_body
from workers.internal_auth import TOKEN_HEADER
from workers.kv.redis_schema import AgentRecord
from workers.nixl_agent import NixlAgent, NixlError
from workers.nixl_layout import CacheLayout
from workers.nixl_peers import PeerLayouts
from workers.protocol import error_body
from workers.sampling_params import InvalidRequest
from workers.transfer import MAX_HEADER_BYTES, KVPayload, Reservation, decode_header

log = logging.getLogger("kvgate.transfer")

RESERVE_BASE_S = 5.0  # a reservation lives this long plus its bytes at RESERVE_MIN_GBPS
RESERVE_MIN_GBPS = 0.2
PROGRESS_S = 0.0005  # a target's progress period while it holds reservations
NO_NIXL_RECHECK_S = 60.0  # a peer without /kv/nixl gets HTTP straight away for this long
QUARANTINE_OUTCOMES = ("completed", "timed_out")  # a settled commit came / the bound passed


@dataclass(frozen=True)
class Grant:
    """The decode side's answer to a reservation: which of its blocks take payload blocks
    `positions`, and for how long it waits for the commit."""

    id: str
    agent: str
    blocks: list[int]
    positions: list[int]
    ttl_s: float

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "Grant":
        try:
            grant = cls(
                str(d["id"]),
                str(d["agent"]),
                [int(b) for b in d["blocks"]],
                [int(p) for p in d["positions"]],
                float(d["ttl_s"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a NIXL reservation: {e!r}") from None
        if not 0 < grant.ttl_s <= 3600:
            raise ValueError(f"a NIXL reservation lives (0, 3600] s, not {grant.ttl_s}")
        return grant

    def sources(self, local_ids: list[int], peer: CacheLayout) -> list[int]:
        """Our block for each granted one; raises NixlError for a grant that does not fit the
        payload or the peer's cache (a decode worker is trusted with the token, not with bounds)."""
        fits = (
            self.agent == peer.agent
            and len(self.blocks) == len(self.positions)
            and all(0 <= p < len(local_ids) for p in self.positions)
            and all(0 <= b < peer.num_blocks for b in self.blocks)
        )
        if not fits:
            raise NixlError(f"grant {self.id} does not fit the payload or {peer.agent}'s cache")
        return [local_ids[p] for p in self.positions]


@dataclass
class Held:
    """A reservation waiting for its commit; `timer` quarantines it when none comes."""

    payload: KVPayload
    res: Reservation
    timer: asyncio.TimerHandle
    ttl_s: float


@dataclass
class Quarantined:
    """Fresh blocks of a reservation that a WRITE may still land in: held, never published,
    until the writer reports its transfer settled or `timer` ends the wait."""

    blocks: list
    timer: asyncio.TimerHandle


class NixlTransfer:
    """Both sides of NIXL P/D for one worker, beside its HTTP TransferService (`service`).
    `quarantine_s` bounds a quarantine (None: the reservation's own lifetime)."""

    def __init__(self, service, agent: NixlAgent, quarantine_s: float | None = None):
        self.service = service
        self.agent = agent
        self.quarantine_s = quarantine_s
        self.reservations: dict[str, Held] = {}
        self.quarantined: dict[str, Quarantined] = {}
        self.peers = PeerLayouts(service.token, agent.forget)
        self._without_nixl: dict[str, float] = {}  # decode worker URL -> when to ask it again
        self._progressing: threading.Thread | None = None
        self._progress_lock = threading.Lock()
        self.committed = 0  # reservations published
        self.expired = 0  # reservations quarantined without a commit
        self.quarantine_releases = dict.fromkeys(QUARANTINE_OUTCOMES, 0)  # quarantines ended, by how
        self.fallbacks = 0  # sends that failed here and went to HTTP

    @classmethod
    def start(cls, service, worker_id: str, quarantine_s: float | None = None) -> "NixlTransfer":
        """Register the executor's KV cache with a fresh agent; raises NixlError when it cannot."""
        kv_cache = service.host.cache_tensor()
        if kv_cache is None:
            raise NixlError("this executor has no KV cache tensor to register")
        return cls(service, NixlAgent(f"kvgate-{worker_id}-{uuid.uuid4().hex[:8]}", kv_cache), quarantine_s)

    def record(self, worker_id: str) -> AgentRecord:
        """This worker's agent for Redis (unsigned: the publisher signs it)."""
        return AgentRecord(worker_id, self.agent.name, self.agent.layout.to_json())

    # -- decode side ------------------------------------------------------------------------

    async def info_endpoint(self, request: Request) -> Response:
        """GET /kv/nixl: this worker's agent metadata and cache layout (internal)."""
        if not self.service.authorised(request):
            return _forbidden()
        return JSONResponse(self.agent.layout.to_json())

    async def reserve_endpoint(self, request: Request) -> Response:
        """POST /kv/nixl/reserve: verify a header-only transfer, hold its blocks, answer a Grant."""
        if not self.service.authorised(request):
            return _forbidden()
        svc, host = self.service, self.service.host
        try:
            body = await read_body(request, MAX_HEADER_BYTES)
            payload, _ = await asyncio.to_thread(decode_header, body, svc.spec, host.kv_seed)
        except BodyTooLarge as e:
            return JSONResponse(error_body(str(e), code="bad_kv_transfer"), status_code=413)
        except InvalidRequest as e:
            return JSONResponse(error_body(str(e), code=e.code), status_code=400)
        grant = await asyncio.shield(background(self._reserve(payload)))
        return JSONResponse(grant.to_json())

    async def _reserve(self, payload: KVPayload) -> Grant:
        """Hold the blocks and start the clock on them. Its own task: a caller that goes away
        half-way must not leave blocks held with no timer to let them go."""
        host = self.service.host
        res = await asyncio.wrap_future(host.reserve(payload))
        rid = uuid.uuid4().hex
        ttl = RESERVE_BASE_S + len(res.fresh) * self.service.spec.block_bytes() / (RESERVE_MIN_GBPS * 1e9)
        timer = asyncio.get_running_loop().call_later(ttl, self._expire, rid)
        self.reservations[rid] = Held(payload, res, timer, ttl)
        self._keep_progressing()
        return Grant(rid, self.agent.name, res.fresh_ids, res.positions, ttl)

    def _keep_progressing(self) -> None:
        with self._progress_lock:
            if self._progressing is None:
                self._progressing = threading.Thread(target=self._progress_loop, name="nixl-progress", daemon=True)
                self._progressing.start()

    def _progress_loop(self) -> None:
        """Progress the agent while any reservation waits for its WRITE or any quarantine for a
        late one, then stop (no idle cost)."""
        while True:
            with self._progress_lock:
                if not self.reservations and not self.quarantined:
                    self._progressing = None
                    return
            try:
                self.agent.progress()
            except Exception as e:
                log.warning("NIXL progress failed: %r", e)
            time.sleep(PROGRESS_S)

    def _expire(self, rid: str) -> None:
        held = self.reservations.pop(rid, None)
        if held is not None:
            self.expired += 1
            log.warning("KV reservation %s expired without a commit: its blocks are quarantined", rid)
            self._quarantine(rid, held)

    def _quarantine(self, rid: str, held: Held) -> None:
        """Let go of the reservation's blocks but the fresh ones, which its WRITE may still land
        in: those are held for the quarantine's bound, or until a settled commit for `rid`."""
        fresh = {id(b) for b in held.res.fresh}
        self.service.host.release([b for b in held.res.blocks if id(b) not in fresh])
        bound = held.ttl_s if self.quarantine_s is None else self.quarantine_s
        timer = asyncio.get_running_loop().call_later(bound, self._end_quarantine, rid)
        self.quarantined[rid] = Quarantined(list(held.res.fresh), timer)
        self._keep_progressing()

    def _end_quarantine(self, rid: str) -> None:
        q = self.quarantined.pop(rid, None)
        if q is not None:
            self.quarantine_releases["timed_out"] += 1
            log.warning("KV reservation %s: no settled commit; its %d blocks go back to the pool", rid, len(q.blocks))
            self.service.host.release(q.blocks)

    def _settled(self, rid: str) -> Response:
        """A commit for a quarantined reservation that says its WRITE is over: let the blocks go
        (unpublished: the request they were for fell back long ago)."""
        q = self.quarantined.pop(rid)
        q.timer.cancel()
        self.quarantine_releases["completed"] += 1
        self.service.host.release(q.blocks)
        return JSONResponse(error_body("the KV reservation had expired", code="kv_reservation_gone"), status_code=409)

    async def commit_endpoint(self, request: Request) -> Response:
        """POST /kv/nixl/commit {id, ok, settled}: publish the written blocks, or let them go;
        a failed WRITE that may still be landing (`settled` false or absent) is quarantined, and a
        settled commit of an expired reservation ends its quarantine."""
        if not self.service.authorised(request):
            return _forbidden()
        try:
            body = json.loads(await read_body(request, 4096))
            rid, ok = body["id"], body["ok"]
            settled = body.get("settled", ok)
            if not isinstance(rid, str) or not isinstance(ok, bool) or not isinstance(settled, bool):
                raise TypeError("'id' is a string, 'ok' and 'settled' booleans")
        except (BodyTooLarge, ValueError, KeyError, TypeError) as e:
            return JSONResponse(error_body(f"bad KV commit: {e!r}", code="bad_kv_transfer"), status_code=400)
        held = self.reservations.pop(rid, None)
        if held is None:
            if settled and rid in self.quarantined:
                return self._settled(rid)
            return JSONResponse(
                error_body("no such KV reservation (expired or committed)", code="kv_reservation_gone"), status_code=409
            )
        held.timer.cancel()
        host = self.service.host
        if not ok:
            if not settled:
                self._quarantine(rid, held)
                return JSONResponse({"quarantined": len(held.res.fresh)})
            host.release(held.res.blocks)
            return JSONResponse({"released": len(held.res.blocks)})
        imported, present = await asyncio.wrap_future(host.publish(held.payload, held.res))
        self.committed += 1
        return JSONResponse(
            {"imported": imported, "present": present, "dropped": len(held.payload.hashes) - imported - present}
        )

    # -- prefill side -----------------------------------------------------------------------

    async def send(
        self, client: httpx.AsyncClient, url: str, header: bytes, local_ids: list[int], headers: dict[str, str]
    ) -> bool:
        """Reserve at `url`, WRITE `local_ids` (the payload's blocks in order) into the granted
        blocks, commit. False when any step failed (the caller falls back); nothing stays held."""
        headers = {**headers, TOKEN_HEADER: self.service.token or ""}
        base = url.rstrip("/")
        if self._without_nixl.get(url, 0.0) > time.monotonic():
            self.fallbacks += 1
            return False
        try:
            asked = time.monotonic()  # the grant's clock started after this
            r = await client.post(
                base + "/kv/nixl/reserve",
                content=header,
                headers={**headers, "content-type": "application/x-kvgate-header"},
            )
            r.raise_for_status()
            grant = Grant.from_json(r.json())
        except (httpx.HTTPError, ValueError) as e:
            if isinstance(e, httpx.HTTPStatusError) and e.response.status_code == 404:
                self._without_nixl[url] = time.monotonic() + NO_NIXL_RECHECK_S  # an HTTP-only peer
            log.warning("NIXL reservation at %s failed: %r", url, e)
            self.fallbacks += 1
            return False
        ok, settled = False, True
        try:
            peer = await self.peers.get(client, url, grant.agent, headers)
            src = grant.sources(local_ids, peer)
            t0 = time.perf_counter()
            deadline = asked + grant.ttl_s / 2
            nbytes = await asyncio.to_thread(self.agent.write, peer, src, grant.blocks, deadline)
            self.service.count_sent("nixl", nbytes, time.perf_counter() - t0)
            ok = True
        except (NixlError, ValueError) as e:  # ValueError: no layout for the agent, nothing written
            log.warning("NIXL write to %s failed: %s", url, e)
            settled = e.settled if isinstance(e, NixlError) else True
            self.peers.drop(grant.agent)
        try:
            body = {"id": grant.id, "ok": ok, "settled": settled}
            r = await client.post(base + "/kv/nixl/commit", json=body, headers=headers)
            r.raise_for_status()
        except httpx.HTTPError as e:
            log.warning("NIXL commit at %s failed: %r", url, e)
            ok = False
        self.fallbacks += not ok
        return ok

    def stats(self) -> dict:
        return {
            "agent": self.agent.name,
            "layout": self.agent.layout.to_json(),
            "reservations": len(self.reservations),
            "committed": self.committed,
            "expired": self.expired,
            "quarantined": len(self.quarantined),
            "quarantined_blocks": sum(len(q.blocks) for q in self.quarantined.values()),
            "quarantine_releases": dict(self.quarantine_releases),
            "fallbacks": self.fallbacks,
            "peer_lookups": dict(self.peers.lookups),
        }


def _forbidden() -> JSONResponse:
    return JSONResponse(
        error_body("KV transfer needs the fleet's internal token", "permission_error", "forbidden"), status_code=403
    )
