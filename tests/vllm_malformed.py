"""Malformed vLLM KV event payloads, packed byte by byte where Python cannot hold the value
(maps keyed by arrays or maps, nesting deeper than Python recurses), for the tests of the
decoder and the subscriber."""

import msgpack

from gateway.vllm_batch import MAX_ENVELOPE, MAX_EVENTS
from gateway.vllm_events import EVENT_SLACK, MAX_ARRAY_ITEMS, MAX_MAP_FIELDS, Cleared, Removed
from tests import vllm_data as vd
from workers.kv.events import DEVICE, DISK, HOST

TOKENS = list(range(1000, 1032))


class Pairs(list):
    """A msgpack map as its (key, value) pairs: keys of any type, unhashable and repeated ones too."""


class Raw(bytes):
    """msgpack bytes, packed as they are."""


def pack(v: object) -> bytes:
    """`v` as msgpack: a Pairs as a map, a list as an array, Raw as is, the rest as msgpack packs it."""
    p = msgpack.Packer(use_bin_type=True)
    if isinstance(v, Raw):
        return bytes(v)
    if isinstance(v, Pairs):
        return p.pack_map_header(len(v)) + b"".join(pack(k) + pack(x) for k, x in v)
    if isinstance(v, list):
        return p.pack_array_header(len(v)) + b"".join(pack(x) for x in v)
    return p.pack(v)


def nested(depth: int) -> Raw:
    """`depth` arrays, each holding the next, the innermost nil."""
    return Raw(b"\x91" * depth + b"\xc0")


def stored(*pairs: tuple, **fields: object) -> Pairs:
    """A valid vLLM BlockStored of one 32-token block with `fields` replaced, then `pairs` added."""
    return Pairs([*{**vd.stored([1], TOKENS), **fields}.items(), *pairs])


def payload(*events: object, ts: object = 1.0) -> bytes:
    return pack([ts, list(events)])


def junk(n: int) -> list[tuple[str, int]]:
    """`n` map entries of names no decoder knows."""
    return [(f"x{i}", 0) for i in range(n)]


# A valid array-shaped BlockStored (tag and its 8 fields) of one 32-token block.
STORED_ARRAY = ["BlockStored", [1], None, TOKENS, 32, None, "GPU", None, None]


# Payloads that are no batch: where their events end is unknown (bytes msgpack cannot read,
# nesting past its stack, an array claiming more items than the payload holds, trailing bytes,
# a payload over the cap), or their envelope [ts, events, dp_rank?] is no such array.
MALFORMED = {
    "nested past msgpack's stack": payload(Pairs([("type", nested(5000))])),
    "reserved byte in an event": payload(Raw(b"\x81\xa4type\xc1")),
    "events claim more than the payload holds": pack([1.0, Raw(b"\xdd\xff\xff\xff\xff\xc0")]),
    "truncated": payload(stored())[:-1],
    "over the size cap": payload(stored(padding=Raw(b"\xc6" + (16 << 20).to_bytes(4, "big") + bytes(16 << 20)))),
    "over the event cap": pack([1.0, Raw(b"\xdd" + (MAX_EVENTS + 1).to_bytes(4, "big") + b"\xc0" * (MAX_EVENTS + 1))]),
    "events a map": pack([1.0, Pairs([("type", "AllBlocksCleared")])]),
    "batch a map without events": pack(Pairs([("ts", 1.0), ("data_parallel_rank", 0)])),
    "batch neither array nor map": pack("kv"),
    "empty": b"",
    "trailing bytes": payload(stored()) + b"\x00",
    "envelope of too many items": pack([1.0, [], *[0] * (MAX_ENVELOPE - 1)]),
    "map envelope of too many entries": pack(Pairs([("ts", 1.0), ("events", []), *junk(MAX_ENVELOPE - 1)])),
}
# Events that are none: msgpack reads past them but cannot build them or the decoder refuses
# them. A batch leaves them out and keeps the others. The first five, a review found failing the
# whole batch while msgpack refused every key but a string.
BAD_EVENTS = {
    "int key": stored((7, 1)),
    "mixed keys": stored((1, 2), ("zz", 3)),
    "array key": stored(([1], 1)),
    "map key": stored((Pairs([("a", 1)]), 1)),
    "float key": stored((1.5, 1)),
    "bytes key": stored((b"zz", 1)),
    "invalid utf-8": stored(("zz", Raw(b"\xa2\xff\xfe"))),
    "malformed timestamp": stored(("zz", Raw(b"\xd5\xff\x00\x00"))),
    "deeply nested tag": Pairs([("type", nested(1000))]),
    "token id past int64": stored(token_ids=[2**63, *TOKENS[1:]]),
    "bool parent": stored(parent_block_hash=True),
    "str lora_id": stored(lora_id="a"),
    "int lora_name": stored(lora_name=3),
    "false extra_keys": stored(extra_keys=False),
    "array spec kind": stored(kv_cache_spec_kind=[1]),
    "bool group": stored(group_idx=True),
    "short array event": ["BlockStored", [1], None],
    "wrong token count": stored(token_ids=TOKENS[:31]),
    "unknown type": {"type": "Nope"},
    "str hash": ["BlockStored", ["x"], None, [], 32, None],
    "array event of too many items": STORED_ARRAY + [None] * (MAX_ARRAY_ITEMS + 1 - len(STORED_ARRAY)),
    "map event of too many entries": stored(*junk(MAX_MAP_FIELDS + 1 - len(stored()))),
}
# Malformed clears and removals, each with what of it still applies: the blocks it says went.
REMOVED = [*vd.removed([1]).items()]
CLEARED = [("type", "AllBlocksCleared")]
SAFE_READINGS = {
    "clear with an int key": (Pairs([*CLEARED, (7, 1)]), [Cleared()]),
    "clear with invalid utf-8": (Pairs([*CLEARED, ("zz", Raw(b"\xa2\xff\xfe"))]), [Cleared()]),
    "clear with a malformed timestamp": (Pairs([("zz", Raw(b"\xd5\xff\x00\x00")), *CLEARED]), [Cleared()]),
    "array clear with invalid utf-8": (["AllBlocksCleared", Raw(b"\xa2\xff\xfe")], [Cleared()]),
    "removal with an array key": (Pairs([*REMOVED, ([7], 1)]), [Removed((1,))]),
    "removal with an int medium": (
        Pairs([*REMOVED, ("medium", 3)]),
        [Removed((1,), 0, m) for m in (DEVICE, HOST, DISK)],
    ),
    "removal with a str group": (Pairs([*REMOVED, ("group_idx", "0")]), [Cleared()]),
    "removal of ext hashes": (
        Pairs([("type", "BlockRemoved"), ("block_hashes", [msgpack.ExtType(5, b"x")])]),
        [Cleared()],
    ),
    "removal with invalid utf-8": (Pairs([*REMOVED, ("zz", Raw(b"\xa2\xff\xfe"))]), [Cleared()]),
    "bare removal tag": (["BlockRemoved"], [Cleared()]),
    # Longer than their tag's fields and EVENT_SLACK: built (a short array), or refused unread, of
    # their leading fields.
    "removal array of too many items": (["BlockRemoved", [1], "GPU", *[None] * (EVENT_SLACK + 1)], [Removed((1,))]),
    "clear array of too many items": (["AllBlocksCleared", *[None] * (EVENT_SLACK + 3)], [Cleared()]),
    "removal array past any tag's items": (["BlockRemoved", [1], "GPU", *[None] * MAX_ARRAY_ITEMS], [Removed((1,))]),
    "removal map past its entries": (Pairs([*REMOVED, *junk(MAX_MAP_FIELDS)]), [Removed((1,))]),
    "clear map past its entries": (Pairs([*junk(3), *CLEARED, *junk(MAX_MAP_FIELDS)]), [Cleared()]),
    "removal past its items with an unreadable medium": (
        ["BlockRemoved", [1], Raw(b"\xa2\xff\xfe"), *[None] * MAX_ARRAY_ITEMS],
        [Removed((1,), 0, m) for m in (DEVICE, HOST, DISK)],
    ),
    "removal past its entries, a field unreadable before its medium and group": (
        Pairs([*REMOVED[:2], ("zz", Raw(b"\xa2\xff\xfe")), *REMOVED[2:], *junk(MAX_MAP_FIELDS)]),
        [Cleared()],
    ),
    "removal past its entries with unreadable hashes": (
        Pairs([("type", "BlockRemoved"), ("block_hashes", Raw(b"\x91\xa2\xff\xfe")), *junk(MAX_MAP_FIELDS)]),
        [Cleared()],
    ),
}
# Batches of a stored and a removed event whose ts or dp_rank is malformed.
EVENTS = [stored(), vd.removed([1])]
BAD_ENVELOPES = {
    "nan ts": payload(*EVENTS, ts=float("nan")),
    "infinite ts": payload(*EVENTS, ts=float("inf")),
    "negative ts": payload(*EVENTS, ts=-1.0),
    "bool ts": payload(*EVENTS, ts=True),
    "timestamp ts": payload(*EVENTS, ts=msgpack.Timestamp(1, 0)),
    "array ts": payload(*EVENTS, ts=[1.0]),
    "invalid utf-8 ts": payload(*EVENTS, ts=Raw(b"\xa2\xff\xfe")),
    "negative dp_rank": pack([1.0, EVENTS, -1]),
    "float dp_rank": pack([1.0, EVENTS, 1.0]),
}
