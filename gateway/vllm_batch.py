"""vLLM's (and SGLang's) KV event batches off the wire: ZMQ frames -> `EngineBatch`.

vLLM publishes `[topic, seq, payload]` on a PUB socket, `seq` 8 bytes big-endian, one per
scheduler step and from 0 in each process; the payload is msgpack `[ts, events, dp_rank?]`
(or, from a publisher whose batch struct is not array-like, a map of those fields by name).
The replay socket (a ROUTER) answers `[b"", start_seq]` with `[b"", topic, seq, payload]...`
(SGLang: no topic) and an end marker whose seq is 0xff x 8. Each event is framed here and
decoded alone (gateway/vllm_events.py), so a bad one costs only itself.

A message or envelope that is no batch, or whose events' ends msgpack cannot find, raises
`BadBatch` (carrying the batch's seq when its frames gave one); nothing else escapes: a
malformed payload the publisher keeps in its replay buffer would otherwise stop the subscriber
again at every resync. The work one message may cost the event loop is bounded (MAX_PAYLOAD,
MAX_EVENTS, MAX_ENVELOPE, MAX_BATCH_TOKENS), and so are the items decoding it may build, its
events together (MAX_BATCH_ITEMS) and its envelope's fields (a scalar each: a container there is
refused by its header, unbuilt).
"""

import math
from collections.abc import Iterator
from dataclasses import dataclass

import msgpack

from gateway.bounded_msgpack import Items, Spellings, is_array, is_map, scalar, skipped, unpacker
from gateway.vllm_events import BadEvent, Event, Stored, decode_event, stored_tokens

END_SEQ = b"\xff" * 8
MAX_BATCH_REASONS = 3  # a batch's malformed events are all counted, the first few with their reason
# vLLM's biggest steps (a million-token prefill, 5 bytes a token id) pack to some 6 MB; a
# hostile payload of empty arrays unpacks into 66 times its size (1 GiB at this cap).
MAX_PAYLOAD = 16 << 20
# Events in one batch: a step stores and removes blocks for at most a few hundred requests, each
# one event. Framing an event costs ~1 us even when it is one junk byte, so without this a
# payload under MAX_PAYLOAD could hold the event loop for seconds.
MAX_EVENTS = 1 << 16
# Token ids the BlockStored events of one batch may carry: twice a million-token prefill. Decoding
# and hashing them costs ~0.2 us each on the event loop; a payload of one-byte ids under
# MAX_PAYLOAD held it ~3 s. A BlockStored event whose ids would take the batch past the budget is
# left out unread, weighed by its headers (it could only add blocks: a cache miss at worst); its
# batch's removals and clears are still read, and so are its later BlockStored events that fit.
MAX_BATCH_TOKENS = 1 << 21
# Items (gateway/bounded_msgpack.py's count: array items, map entries, containers and ext values,
# in any field at any depth) the decoding of one batch's events may build, each event taking from
# what the ones before it left. A valid batch of a whole budget's token ids holds, at vLLM's
# default block size (16), some 2.1 M (a hash per block) and 4.5 M with an extra_keys entry of
# one key per block (a LoRA name); its removals name no more blocks than a step stores. An event
# that would build more than is left is malformed (a removal's safe reading, its hashes unread,
# is a clear), and so, their items spent, are those after it but for their tag: a payload under
# MAX_PAYLOAD holds 16 M one-byte items, which took ~0.6 s to build in two removals'
# block_hashes when each event had an allowance of its own.
MAX_BATCH_ITEMS = 4 * MAX_BATCH_TOKENS
# Items of a batch's envelope, entries of one encoded as a map: vLLM's has 3 fields. Each more is
# a Python step of the decoder's, ~0.1 us even when it is one junk byte.
MAX_ENVELOPE = 8


class BadBatch(ValueError):
    """A frame or payload that is not a KV event batch. `seq` is its sequence number when its
    frames gave one: the subscriber steps over it in order, since the publisher would replay the
    same bytes, just as bad."""

    def __init__(self, why: str, seq: int | None = None):
        super().__init__(why)
        self.seq = seq


@dataclass(frozen=True)
class EngineBatch:
    """One scheduler step's events from one data-parallel rank. `malformed` counts the events
    that did not decode, each left out but for its safe reading (a clear, a removal), and a `ts`
    or `dp_rank` that did not (`ts` None, `rank` 0); `reasons` says why for the first
    MAX_BATCH_REASONS of them: a publisher may send a million."""

    seq: int
    ts: float | None
    events: tuple[Event, ...]
    rank: int = 0
    malformed: int = 0
    reasons: tuple[str, ...] = ()


def decode_frames(frames: list[bytes]) -> EngineBatch:
    """A live PUB message `[topic, seq, payload]` (or `[seq, payload]` without a topic)."""
    if len(frames) not in (2, 3):
        raise BadBatch(f"a KV event message has 2 or 3 frames, not {len(frames)}")
    return decode_payload(_seq(frames[-2]), frames[-1])


def decode_replay(frames: list[bytes]) -> EngineBatch | None:
    """A replay answer as a DEALER receives it: `[b"", topic, seq, payload]` (vLLM) or
    `[b"", seq, payload]` (SGLang); None for the end marker."""
    if len(frames) not in (3, 4) or frames[0] != b"":
        raise BadBatch(f"a replay message is [b'', (topic,) seq, payload], not {len(frames)} frames")
    if frames[-2] == END_SEQ:
        return None
    return decode_payload(_seq(frames[-2]), frames[-1])


def _seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise BadBatch(f"a sequence number is 8 bytes, not {len(frame)}")
    return int.from_bytes(frame, "big")


def decode_payload(seq: int, payload: bytes) -> EngineBatch:
    """Batch `seq` from its msgpack `[ts, events, dp_rank?]`. A payload that is no such envelope
    raises BadBatch carrying `seq`, so that one bad batch costs its own events and nothing more."""
    try:
        return _batch(seq, payload)
    except BadBatch as e:
        raise BadBatch(str(e), seq) from None
    except (ValueError, msgpack.UnpackException) as e:  # UnicodeDecodeError and StackError among them
        raise BadBatch(f"payload is no msgpack [ts, events, dp_rank?]: {e}", seq) from None


def _batch(seq: int, payload: bytes) -> EngineBatch:
    """A batch's envelope (`_envelope`): `ts` a finite, non-negative time (the subscriber orders
    restarts by it), `dp_rank` a non-negative int or nil, each a scalar read from its own bytes
    (`_scalar`), other fields skipped; either one malformed is counted as such and costs the
    batch nothing else: its events are the engine's all the same. Its events are framed one by
    one (`_events`); what hides where they end fails the batch: bytes msgpack cannot read,
    nesting past its stack (1024 deep), a truncated payload, bytes past its end, a payload over
    MAX_PAYLOAD (a hostile one unpacks into tens of times its size), over MAX_EVENTS events or
    an envelope of over MAX_ENVELOPE fields."""
    if len(payload) > MAX_PAYLOAD:
        raise BadBatch(f"payload is {len(payload)} bytes, over {MAX_PAYLOAD}")
    u = unpacker(payload)
    view = memoryview(payload)
    ts, rank, read = None, None, None
    for name in _envelope(u, view):
        if name == "ts":
            ts = _scalar(skipped(u, view))
        elif name == "events" and read is None:
            read = _events(u, view)
        elif name == "data_parallel_rank":
            rank = _scalar(skipped(u, view))
        else:
            u.skip()
    if read is None:
        raise BadBatch("payload is not [ts, events, dp_rank?]")
    if u.tell() != len(payload):
        raise BadBatch("payload has bytes past its batch")
    bad = []
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts) or ts < 0:
        ts, bad = None, ["ts must be a finite, non-negative number"]
    if rank is not None and (type(rank) is not int or rank < 0):
        rank, bad = None, [*bad, "dp_rank must be a non-negative int or nil"]
    events, malformed, reasons = read
    why = (*bad, *reasons)[:MAX_BATCH_REASONS]
    return EngineBatch(seq, None if ts is None else float(ts), events, rank or 0, malformed + len(bad), why)


def _scalar(raw: bytes | memoryview) -> object:
    """An envelope field's value, a scalar; UNREAD for a container (refused by its header,
    unbuilt: a hostile `ts` of 16 M items once took ~0.2 s to build) or bytes that do not decode
    (bad UTF-8), which the batch counts as its malformed field."""
    try:
        return scalar(raw)
    except (ValueError, msgpack.UnpackException):
        return UNREAD


UNREAD = object()  # an envelope field that did not read
ENVELOPE = ("ts", "events", "data_parallel_rank")
NAMES = Spellings(*ENVELOPE)


def _envelope(u: msgpack.Unpacker, payload: memoryview) -> Iterator[str | None]:
    """The names of the envelope's fields, each as `u` reaches its value: by position in vLLM's
    batch (an array-like struct: [ts, events, dp_rank?], more items unnamed), or by key where a
    publisher encodes the struct as a map (msgspec's default; a key that is no name is None, told
    by its bytes, unbuilt). An envelope of more than MAX_ENVELOPE items or entries is no batch,
    told by its header before any is read."""
    first = payload[0] if payload else 0
    if is_map(first):
        entries = u.read_map_header()
        if entries > MAX_ENVELOPE:
            raise BadBatch(f"batch is a map of {entries} entries, over {MAX_ENVELOPE}")
        for _ in range(entries):
            yield NAMES.of(skipped(u, payload))
        return
    if not is_array(first):
        raise BadBatch("payload is not [ts, events, dp_rank?]")
    items = u.read_array_header()
    if items < 2:
        raise BadBatch("payload is not [ts, events, dp_rank?]")
    if items > MAX_ENVELOPE:
        raise BadBatch(f"batch is an array of {items} items, over {MAX_ENVELOPE}")
    for i in range(items):
        yield ENVELOPE[i] if i < len(ENVELOPE) else None


def _events(u: msgpack.Unpacker, payload: memoryview) -> tuple[tuple[Event, ...], int, tuple[str, ...]]:
    """The events of the events array `u` is at, in order, the malformed ones by their safe
    reading, then how many were malformed and why for the first MAX_BATCH_REASONS: a bad event
    costs only itself, not its batch's BlockRemoved events. msgpack frames each event without
    building it (`skip`), so that what one holds (a map key of any type, bad UTF-8, a malformed
    timestamp) fails its own decoding (`_read`), within the batch's MAX_BATCH_TOKENS and
    MAX_BATCH_ITEMS."""
    events: list[Event] = []
    reasons: list[str] = []
    malformed, count = 0, u.read_array_header()
    if count > MAX_EVENTS:
        raise BadBatch(f"batch holds {count} events, over {MAX_EVENTS}")
    tokens, items = 0, Items(MAX_BATCH_ITEMS)
    for i in range(count):
        start = u.tell()
        u.skip()
        read, cost, why = _read(payload[start : u.tell()], MAX_BATCH_TOKENS - tokens, items)
        events += read
        tokens += cost
        if why is not None:
            malformed += 1
            if len(reasons) < MAX_BATCH_REASONS:
                reasons.append(f"event {i}: {why}")
    return tuple(events), malformed, tuple(reasons)


def _read(raw: memoryview, left: int, items: Items) -> tuple[tuple[Event, ...], int, str | None]:
    """Event `raw` as the events it stands for (itself, or a malformed one's safe reading, built
    from the batch's `items`), what it cost the batch's token budget, `left` of which remain, and
    why it is malformed (None: it is not). A BlockStored event carrying more ids than are left
    is left out unread, weighed by its headers (`stored_tokens`) only where its bytes could hold
    more, an item being at least a byte: weighing costs about what decoding a small event does.
    A valid BlockStored costs its ids; a malformed event that could only have added blocks (no
    safe reading) its bytes, more than the items it had the decoder build (uncharged, a payload
    of them would all be decoded), or what is left: the cost never passes `left`, so an event of
    no token ids always fits."""
    if len(raw) > left and (claimed := stored_tokens(raw)) > left:
        return (), 0, f"its {claimed} token ids would take the batch's BlockStored events over {MAX_BATCH_TOKENS}"
    try:
        event = decode_event(raw, items)
    except BadEvent as bad:
        return bad.safe, 0 if bad.safe else min(len(raw), left), str(bad)
    return (event,), len(event.token_ids) if isinstance(event, Stored) else 0, None
