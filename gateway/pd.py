"""Prefill/decode orchestration: two legs started at once, one ordinary stream to the client.

The decode leg is the client's request plus `kv_transfer.wait_ms`: the decode worker holds it
until the prompt's blocks are in its prefix cache, or the wait runs out and it computes them
itself. The prefill leg is the same prompt with `max_tokens: 1` and
`kv_transfer.export_to: <decode worker>`, less what only shapes the answer's delivery and length
(`ANSWER_ONLY`); the prefill worker ships its full blocks there when its prefill ends. The prefill leg's own answer is discarded; its failure only costs the decode
worker a recompute, so it is logged and counted, never shown to the client.

`kv_transfer` is internal: workers read it only with the fleet's token, so both legs carry it
(`leg_headers`) and no other request does.
"""

import asyncio
import json
import logging
from collections.abc import Callable

from gateway.proxy import ConnectFailed, Proxy, UpstreamFailed
from gateway.tap import cached_tokens
from workers.background import background
from workers.internal_auth import internal_headers

log = logging.getLogger("kvgate.pd")


def leg_headers(headers: dict[str, str], token: str) -> dict[str, str]:
    """A P/D leg's headers: the request's own plus the fleet's internal token."""
    return {**headers, **internal_headers(token)}


def decode_leg(body: dict, wait_ms: float) -> bytes:
    """The client's request, told to wait for its blocks."""
    return json.dumps({**body, "kv_transfer": {"wait_ms": wait_ms}}).encode()


# The client's fields the prefill leg leaves out: its stream and its budget, which `max_tokens: 1`
# replaces, with `min_tokens`, which a worker holds to that budget (vLLM's P/D proxies drop it
# too). The rest stays: the prompt's own fields shape its blocks, and the answer's other
# controls (stop strings and ids, logit_bias, penalties, allowed_token_ids, bad_words, logprobs,
# how its text is made: `include_stop_str_in_output`, `skip_special_tokens`) hold for any budget,
# so the prefill leg is parsed and refused as its decode leg is.
ANSWER_ONLY = ("stream", "stream_options", "max_completion_tokens", "min_tokens")


def prefill_leg(body: dict, decode_url: str) -> bytes:
    """Prefill only: one token, no stream, blocks exported to the decode worker."""
    leg = {k: v for k, v in body.items() if k not in ANSWER_ONLY}
    leg.update(max_tokens=1, stream=False, kv_transfer={"export_to": decode_url})
    return json.dumps(leg).encode()


def expected_cached(num_tokens: int, block_size: int) -> int:
    """What a decode leg finds cached once its prefill leg's blocks arrived: every full block
    but the one holding the last token, which a worker always computes."""
    return (num_tokens - 1) // block_size * block_size if num_tokens > 0 else 0


async def run_prefill(proxy: Proxy, url: str, path: str, payload: bytes, headers: dict[str, str]) -> int | None:
    """Send the prefill leg and wait for it; the prompt tokens it found cached when the prefill
    worker finished it, None when it did not. Its answer comes whole but is one token, the
    work of a stream's first, so it keeps the first-byte timeout, not a whole answer's."""
    try:
        resp = await proxy.open(url, path, payload, headers)
    except ConnectFailed as e:
        log.warning("prefill leg to %s failed to connect: %s", url, e)
        return None
    try:
        body = await proxy.read(resp)
    except UpstreamFailed as e:
        log.warning("prefill leg to %s broke off: %s", url, e)
        return None
    if resp.status != 200:
        log.warning("prefill leg to %s answered %s: %s", url, resp.status, body[:200])
        return None
    return cached_tokens(body) or 0


def start_prefill(
    proxy: Proxy, url: str, path: str, payload: bytes, headers: dict[str, str], done: Callable[[int | None], None]
) -> "asyncio.Future[int | None]":
    """Run the prefill leg in the background; `done(cached)` is called once when it ends
    (cached tokens, or None when it failed, raised or was cancelled), so the caller's
    accounting (the prefill worker's in-flight count) always closes."""
    task = background(run_prefill(proxy, url, path, payload, headers))
    task.add_done_callback(lambda t: done(leg_result(t, url)))
    return task


def leg_result(task: "asyncio.Future[int | None]", url: str) -> int | None:
    """A finished prefill leg's cached tokens; None when it was cancelled or raised (logged)."""
    if task.cancelled():
        return None
    if (e := task.exception()) is not None:
        log.warning("prefill leg to %s raised: %r", url, e)
        return None
    return task.result()
