"""vLLM's (and SGLang's) KV events off the wire: ZMQ frames -> typed batches.

vLLM publishes `[topic, seq, payload]` on a PUB socket, `seq` 8 bytes big-endian, one per
scheduler step and from 0 in each process; the payload is msgpack `[ts, events, dp_rank?]`.
Events are maps tagged by `"type"` (vLLM >= 0.10) or arrays whose first item is the tag (older
vLLM and SGLang): `BlockStored`, `BlockRemoved`, `AllBlocksCleared`. The replay socket (a
ROUTER) answers `[b"", start_seq]` with `[b"", topic, seq, payload]...` (SGLang: no topic)
and an end marker whose seq is 0xff x 8.

The publisher is a process of the fleet, not a client, but a bad frame still must not stop the
subscriber: anything malformed raises `BadBatch`, and fields are type-checked here, once, so
the translation downstream handles plain, well-typed data.
"""

from dataclasses import dataclass

import msgpack

from workers.kv.events import DEVICE, DISK, HOST

END_SEQ = b"\xff" * 8
STORED_TAG, REMOVED_TAG, CLEARED_TAG = "BlockStored", "BlockRemoved", "AllBlocksCleared"
# The array form's fields, in order after the tag (vLLM's BlockStored / BlockRemoved order).
STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
)
REMOVED_FIELDS = ("block_hashes", "medium")
# vLLM's `medium` (kv_events.MEDIUM_*: GPU, CPU from its offloading connector, STORAGE from its
# file and object tiers), lower-cased, as kvgate's tier; nil (older vLLM, SGLang) is the device.
MEDIA = {"gpu": DEVICE, "cpu": HOST, "storage": DISK, "disk": DISK}
# Extra keys that change no block hash in kvgate's chain or are about placement, not content.
NEUTRAL_KEYS = {
    "type",
    *STORED_FIELDS,
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "cache_salt",
    "remaining_copy_counts",
}


class BadBatch(ValueError):
    """A frame or payload that is not a KV event batch."""


EngineHash = int | bytes


@dataclass(frozen=True)
class Stored:
    """Full blocks an engine cached, in chain order; `parent` is the engine hash of the block
    before the first (None: the first block of a prompt). `extra` holds, per block, the extra
    hash keys vLLM published (LoRA name, multimodal ids, cache salt), `salt` SGLang's cache salt,
    and `unknown` names fields this decoder cannot vouch do not change a block's hash."""

    hashes: tuple[EngineHash, ...]
    parent: EngineHash | None
    token_ids: tuple[int, ...]
    block_size: int
    group: int = 0
    lora: bool = False
    extra: tuple[tuple | None, ...] = ()
    salt: str | None = None
    full_attention: bool = True
    unknown: tuple[str, ...] = ()
    medium: str = DEVICE


@dataclass(frozen=True)
class Removed:
    hashes: tuple[EngineHash, ...]
    group: int = 0
    medium: str = DEVICE


@dataclass(frozen=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


@dataclass(frozen=True)
class EngineBatch:
    """One scheduler step's events from one data-parallel rank."""

    seq: int
    ts: float
    events: tuple[Event, ...]
    rank: int = 0


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
    try:
        body = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=True)
    except (ValueError, msgpack.UnpackException) as e:
        raise BadBatch(f"payload is not msgpack: {e}") from None
    if not isinstance(body, list) or len(body) < 2 or not isinstance(body[1], list):
        raise BadBatch("payload is not [ts, events, dp_rank?]")
    ts, rank = body[0], body[2] if len(body) > 2 else 0
    if not isinstance(ts, (int, float)) or not (rank is None or type(rank) is int):
        raise BadBatch("payload's ts must be a number and dp_rank an int")
    return EngineBatch(seq, float(ts), tuple(decode_event(e) for e in body[1]), rank or 0)


def decode_event(e: object) -> Event:
    if isinstance(e, list) and e and isinstance(e[0], str):
        fields = STORED_FIELDS if e[0] == STORED_TAG else REMOVED_FIELDS
        e = {
            "type": e[0],
            **dict(zip(fields, e[1:])),  # fields past the known ones: unknown meaning
            **{f"field {i}": True for i in range(len(fields) + 1, len(e)) if e[i] is not None},
        }
    if not isinstance(e, dict):
        raise BadBatch("an event is a map with a 'type' or an array starting with its tag")
    tag = e.get("type")
    if tag == STORED_TAG:
        return _stored(e)
    if tag == REMOVED_TAG:
        return Removed(_hashes(e.get("block_hashes")), _group(e), _medium(e))
    if tag == CLEARED_TAG:
        return Cleared()
    raise BadBatch(f"unknown event type {str(tag)[:40]!r}")


def _stored(e: dict) -> Stored:
    hashes, tokens, size = _hashes(e.get("block_hashes")), e.get("token_ids"), e.get("block_size")
    parent = e.get("parent_block_hash")
    if size == 0 and tokens == [] and parent is None:  # vLLM's offloading placeholder: hashes alone
        return Stored(hashes, None, (), 0, _group(e), medium=_medium(e))
    if type(size) is not int or size < 1:
        raise BadBatch("BlockStored.block_size must be a positive int")
    if (
        not isinstance(tokens, list)
        or len(tokens) != len(hashes) * size
        or not all(type(t) is int and t >= 0 for t in tokens)
    ):
        raise BadBatch("BlockStored.token_ids must be block_size token ids per block")
    if parent is not None and not isinstance(parent, (int, bytes)):
        raise BadBatch("BlockStored.parent_block_hash must be a hash or nil")
    extra = e.get("extra_keys") or ()
    if not isinstance(extra, list | tuple) or (extra and len(extra) != len(hashes)):
        raise BadBatch("BlockStored.extra_keys must hold one entry per block")
    salt = e.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise BadBatch("BlockStored.cache_salt must be a string")
    kind = e.get("kv_cache_spec_kind")
    return Stored(
        hashes,
        parent,
        tuple(tokens),
        size,
        _group(e),
        lora=e.get("lora_id") is not None or e.get("lora_name") is not None,
        extra=tuple(None if x is None else tuple(x) if isinstance(x, list | tuple) else (x,) for x in extra),
        salt=salt or None,
        full_attention=kind in (None, "full_attention"),
        unknown=tuple(sorted(k for k in e if k not in NEUTRAL_KEYS)),
        medium=_medium(e),
    )


def _medium(e: dict) -> str:
    """kvgate's tier for an event's `medium`; an unknown one is kept as given, lower-cased (the
    translator leaves its blocks out)."""
    m = e.get("medium")
    if m is None:
        return DEVICE
    if not isinstance(m, str):
        raise BadBatch("medium must be a string or nil")
    return MEDIA.get(m.lower(), m.lower())


def _hashes(v: object) -> tuple[EngineHash, ...]:
    if not isinstance(v, list) or not all(isinstance(h, (int, bytes)) and not isinstance(h, bool) for h in v):
        raise BadBatch("block_hashes must be a list of ints or bytes")
    return tuple(v)


def _group(e: dict) -> int:
    g = e.get("group_idx")
    if g is not None and type(g) is not int:
        raise BadBatch("group_idx must be an int")
    return g or 0
