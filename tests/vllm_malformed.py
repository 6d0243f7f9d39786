"""Malformed vLLM KV event payloads, packed byte by byte where Python cannot hold the value
(maps keyed by arrays or maps, nesting deeper than Python recurses), for the tests of the
decoder and the subscriber."""

import msgpack

from tests import vllm_data as vd

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


# Payloads that are no batch: msgpack rejects them (a non-string map key anywhere, nesting past
# its stack, bad UTF-8, trailing bytes), or their envelope [ts, events, dp_rank?] is wrong. The
# three a review found stopping the subscriber come first.
MALFORMED = {
    "mixed keys": payload(stored((1, 2), ("zz", 3))),
    "array key": payload(stored(([1], 1))),
    "int key": payload(stored((7, 1))),
    "map key": payload(stored((Pairs([("a", 1)]), 1))),
    "float key": payload(Pairs([("type", "AllBlocksCleared"), (1.5, 1)])),
    "nested past msgpack's stack": payload(Pairs([("type", nested(5000))])),
    "nan ts": payload(stored(), ts=float("nan")),
    "infinite ts": payload(stored(), ts=float("inf")),
    "negative ts": payload(stored(), ts=-1.0),
    "bool ts": payload(stored(), ts=True),
    "timestamp ts": payload(stored(), ts=msgpack.Timestamp(1, 0)),
    "negative dp_rank": pack([1.0, [stored()], -1]),
    "events a map": pack([1.0, Pairs([("type", "AllBlocksCleared")])]),
    "batch a map": pack(Pairs([("ts", 1.0), ("events", [])])),
    "invalid utf-8": payload(Raw(b"\x81\xa4type\xa2\xff\xfe")),
    "trailing bytes": payload(stored()) + b"\x00",
}
# Events that msgpack reads but that are none: a batch leaves them out and keeps the others.
BAD_EVENTS = {
    "bytes key": stored((b"zz", 1)),
    "deeply nested tag": Pairs([("type", nested(1000))]),
    "token id past int64": stored(token_ids=[2**63, *TOKENS[1:]]),
    "bool parent": stored(parent_block_hash=True),
    "str lora_id": stored(lora_id="a"),
    "int lora_name": stored(lora_name=3),
    "false extra_keys": stored(extra_keys=False),
    "array spec kind": stored(kv_cache_spec_kind=[1]),
    "bool group": stored(group_idx=True),
    "short array event": ["BlockStored", [1], None],
    "bare tag": ["BlockRemoved"],
    "ext hash": Pairs([("type", "BlockRemoved"), ("block_hashes", [msgpack.ExtType(5, b"x")])]),
    "wrong token count": stored(token_ids=TOKENS[:31]),
    "unknown type": {"type": "Nope"},
    "str hash": ["BlockStored", ["x"], None, [], 32, None],
}
