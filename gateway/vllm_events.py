"""One vLLM (or SGLang) KV event off the wire: its msgpack bytes -> a typed event (batches:
gateway/vllm_batch.py).

Events are maps tagged by `"type"` (vLLM >= 0.10) or arrays whose first item is the tag (older
vLLM and SGLang): `BlockStored`, `BlockRemoved`, `AllBlocksCleared`. The publisher is a process
of the fleet, not a client, but a bad event still must not stop the subscriber or cost its
batch's other events (a dropped BlockRemoved would leave evicted blocks resident): a malformed
one raises `BadEvent` carrying what of it still applies (`_safe`: of a malformed clear or
removal the blocks it says went are forgotten all the same). An event's fields are bounded by
its header before any item is read (EVENT_SLACK), a BlockStored's token ids are counted by theirs
(`stored_tokens`) for its batch's budget, and the items its decoding builds, in whatever field,
by what its batch has left to build (`decode_event`'s `left`: gateway/bounded_msgpack.py); its
tag is read whatever is left, so that an event past it still reads as its tag's safe reading.
Fields are type-checked here, once, so the translation downstream handles plain, well-typed data.
"""

import heapq
from dataclasses import dataclass
from itertools import islice
from typing import TypeGuard, TypeVar

import msgpack

from gateway.bounded_msgpack import (
    PAIR,
    Items,
    Pairs,
    Spellings,
    header_size,
    is_array,
    is_map,
    reader,
    skipped,
    unpack,
    unpacker,
    value,
)
from workers.kv.events import DEVICE, DISK, HOST, checked_ints
from workers.kv.hashing import MAX_TOKEN_ID

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

MAX_UNKNOWN = 3  # one unknown field leaves a block out; the first few name why
# An event may hold this many items (entries) past the fields this decoder knows: a newer vLLM's,
# read as unknown fields. An array event holds its tag, its tag's fields and these; a map event
# its known fields (NEUTRAL_KEYS, the tag among them) and these. More fails the event, decided
# from its header before any item is read: a payload under MAX_PAYLOAD holds 16 M one-byte items,
# seconds of the event loop's time to build and walk.
EVENT_SLACK = 8
MAX_MAP_FIELDS = len(NEUTRAL_KEYS) + EVENT_SLACK
MAX_ARRAY_ITEMS = 1 + len(STORED_FIELDS) + EVENT_SLACK  # the longest tag's; each tag's own in `_cap`
T = TypeVar("T", int, str)


EngineHash = int | bytes


@dataclass(frozen=True)
class Stored:
    """Full blocks an engine cached, in chain order; `parent` is the engine hash of the block
    before the first (None: the first block of a prompt). `extra` holds, per block, the extra
    hash keys vLLM published (LoRA name, multimodal ids, cache salt), `salt` SGLang's cache salt,
    and `unknown` names (the first MAX_UNKNOWN of) fields this decoder cannot vouch do not change
    a block's hash."""

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


class BadEvent(ValueError):
    """A malformed event; `safe` is what of it still applies (`_safe`)."""

    def __init__(self, why: str, safe: tuple[Event, ...] = ()):
        super().__init__(why)
        self.safe = safe


def decode_event(raw: bytes | memoryview, left: Items) -> Event:
    """One event's msgpack: a map tagged by `type` or an array led by its tag, built from what
    its batch has `left`. Anything else, a key that is no field name, an event of more items than
    its fields and EVENT_SLACK (`_cap`), one whose decoding would build more than is left
    (`unpack`), or a field this decoder reads holding the wrong type raises BadEvent, carrying
    what of the event still applies (`_safe`: a removal whose hashes were not read clears)."""
    if (size := header_size(raw)) > _cap(raw):  # too long for any tag: refused unread
        raise BadEvent(f"an event holds {size} {_items(raw)}, over {_cap(raw)}", _safe(_leading(raw, left)))
    try:
        e = unpack(raw, left)
    except (ValueError, msgpack.UnpackException) as bad:  # bad UTF-8, a malformed timestamp, over `left`
        raise BadEvent(f"event does not decode: {bad}", _safe({"type": tag_of(raw, left)})) from None
    fields = _fields(e)
    try:
        if isinstance(e, Pairs) and any(type(k) is not str for k, _ in e):
            raise BadEvent("an event's keys must be field names (strings)")
        if isinstance(e, list) and len(e) > _cap(raw, e[0]):  # a short list, built
            raise BadEvent(f"a {e[0][:40]!r} event holds {len(e)} items, over {_cap(raw, e[0])}")
        return _typed(fields)
    except BadEvent as bad:
        raise BadEvent(str(bad), _safe(fields)) from None


def _typed(fields: dict[str, object]) -> Event:
    """The event `fields` make, each field it reads type-checked."""
    tag = fields.get("type")
    if tag == STORED_TAG:
        return _stored(fields)
    if tag == REMOVED_TAG:
        return Removed(_hashes(fields.get("block_hashes")), _group(fields), _medium(fields))
    if tag == CLEARED_TAG:
        return Cleared()
    # Only a string is shown: another tag may nest too deep to print (RecursionError).
    shown = repr(tag[:40]) if isinstance(tag, str) else f"of type {type(tag).__name__}"
    raise BadEvent(f"unknown event type {shown}")


def _safe(fields: dict[str, object]) -> tuple[Event, ...]:
    """What a malformed event still says: that blocks went. A clear clears; a removal removes the
    blocks it names, from every tier if its medium does not read, and clears if its blocks or
    their group do not. Forgetting a block the engine holds costs one cache miss; remembering one
    it evicted sends requests to a cache that lost it until it is stored and removed again. A
    malformed BlockStored, or an event whose tag does not read, only could have added blocks:
    left out."""
    tag = fields.get("type")
    if tag == CLEARED_TAG:
        return (Cleared(),)
    if tag != REMOVED_TAG:
        return ()
    try:
        hashes, group = _hashes(fields.get("block_hashes")), _group(fields)
    except BadEvent:
        return (Cleared(),)
    try:
        return (Removed(hashes, group, _medium(fields)),)
    except BadEvent:
        return tuple(Removed(hashes, group, m) for m in (DEVICE, HOST, DISK))


def _names(tag: object) -> tuple[str, ...]:
    """The fields after an array event's tag, in order."""
    return STORED_FIELDS if tag == STORED_TAG else REMOVED_FIELDS


def _cap(raw: bytes | memoryview, tag: object = None) -> int:
    """The most items an event may hold: a map's entries MAX_MAP_FIELDS, an array's its tag, the
    tag's fields and EVENT_SLACK (tag None: the longest tag's)."""
    if is_map(raw[0] if raw else 0):
        return MAX_MAP_FIELDS
    return MAX_ARRAY_ITEMS if tag is None else 1 + len(_names(tag)) + EVENT_SLACK


def _items(raw: bytes | memoryview) -> str:
    return "entries" if is_map(raw[0] if raw else 0) else "items"


def _leading(raw: bytes | memoryview, left: Items) -> dict[str, object]:
    """The fields an event too long to read leads with, for its safe reading: an array's tag and
    its tag's fields, a map's string-keyed entries among its first MAX_MAP_FIELDS (a map whose
    tag comes later reads as no clear or removal), built from what is `left` (`value`), each
    field spent as it is read but the tag. A field that does not decode within it ends the
    reading as UNREAD, a value of no type the decoder takes (`_safe` reads a removal of such
    hashes or group as a clear, of such a medium as one from every tier); in a map so does every
    field `_safe` reads that the reading did not reach (its later entries may hold any), and its
    tag, if not reached, is read alone (`tag_of`)."""
    u, fields, mapped = reader(raw, left), dict[str, object](), is_map(raw[0])
    try:
        if mapped:
            u.read_map_header()
            for _ in range(MAX_MAP_FIELDS):
                left.claim(PAIR)
                key = u.unpack()
                v = value(u, raw, left)
                if type(key) is str:
                    fields[key] = v
        else:
            u.read_array_header()
            fields["type"] = UNREAD
            fields["type"] = value(u, raw, left)
            for name in _names(fields["type"]):
                fields[name] = UNREAD
                left.claim(1)
                fields[name] = value(u, raw, left)
    except (ValueError, msgpack.UnpackException) as bad:
        left.failed(len(raw), bad)
        if mapped:  # its entries past the failure may hold any field
            fields = {**dict.fromkeys(SAFE_FIELDS, UNREAD), **fields}
            if "type" not in fields:
                fields["type"] = tag_of(raw, left)
    return fields


UNREAD = object()  # a field `_leading` could not decode
SAFE_FIELDS = ("block_hashes", "medium", "group_idx")  # what `_safe` reads of a removal


SPELLED = Spellings("type", "token_ids", STORED_TAG)  # what `stored_tokens` reads, by its bytes
TOKENS_AT = 1 + STORED_FIELDS.index("token_ids")  # token_ids' place in an array event


def stored_tokens(raw: bytes | memoryview) -> int:
    """The token ids a BlockStored event carries, by the headers of its token_ids (each one a map
    repeats: the decoder builds them all), no item read; 0 for an event of another tag, as
    `decode_event` reads the tag (a map's last "type" among the entries it reads). A batch weighs
    an event against its token budget by this before decoding it: building 16 M one-byte ids
    held the event loop for a second. `raw` is one whole msgpack value, as a batch frames its
    events: read by skips and byte compares, nothing decoded, it raises nothing."""
    first = raw[0] if raw else 0
    u = unpacker(raw)
    if is_array(first):
        if u.read_array_header() <= TOKENS_AT or SPELLED.of(skipped(u, raw)) != STORED_TAG:
            return 0
        for _ in range(TOKENS_AT - 1):  # block_hashes, parent_block_hash
            u.skip()
        return header_size(skipped(u, raw))
    if not is_map(first):
        return 0
    tag, tokens = None, 0
    for _ in range(min(u.read_map_header(), MAX_MAP_FIELDS)):  # as many as decode_event reads
        key, v = SPELLED.of(skipped(u, raw)), skipped(u, raw)
        if key == "type":
            tag = SPELLED.of(v)
        elif key == "token_ids":
            tokens += header_size(v)
    return tokens if tag == STORED_TAG else 0


def tag_of(raw: bytes | memoryview, left: Items) -> object:
    """The tag of an event whose bytes do not all decode, read alone (None where it does not
    either, within what is `left`): a map's value under the key "type" among its first
    MAX_MAP_FIELDS entries, an array's first item. A string tag is read whatever is left (one
    per event, MAX_EVENTS a batch): an event past its batch's items still reads as its tag's
    safe reading (a removal as a clear)."""
    u = reader(raw, left)
    try:
        try:
            pairs = u.read_map_header()
        except ValueError:  # not a map: an array, or no event at all
            return value(u, raw, left) if u.read_array_header() else None
        for _ in range(min(pairs, MAX_MAP_FIELDS)):
            if SPELLED.of(skipped(u, raw)) == "type":
                return value(u, raw, left)
            u.skip()
    except (ValueError, msgpack.UnpackException) as bad:
        left.failed(len(raw), bad)
    return None


def _fields(e: object) -> dict[str, object]:
    """An event's fields by name: an array's in vLLM's order after the tag, those past the known
    ones named `field i` (their meaning is unknown; the first MAX_UNKNOWN, not a dict entry per
    item of a hostile array); a map's under the keys that are names."""
    if isinstance(e, list) and e and isinstance(e[0], str):
        names = _names(e[0])
        past = (f"field {i}" for i in range(len(names) + 1, len(e)) if e[i] is not None)
        return {"type": e[0], **dict(zip(names, e[1:])), **dict.fromkeys(islice(past, MAX_UNKNOWN), True)}
    if not isinstance(e, Pairs):
        raise BadEvent("an event is a map with a 'type' or an array starting with its tag")
    return {k: v for k, v in e if type(k) is str}


def _stored(e: dict[str, object]) -> Stored:
    hashes, parent = _hashes(e.get("block_hashes")), _parent(e.get("parent_block_hash"))
    size, tokens = e.get("block_size"), e.get("token_ids")
    if type(size) is int and size == 0 and tokens == [] and parent is None:  # vLLM's offloading placeholder
        return Stored(hashes, None, (), 0, _group(e), medium=_medium(e))
    if type(size) is not int or size < 1:
        raise BadEvent("BlockStored.block_size must be a positive int")
    lora_id, lora_name = _optional(e, "lora_id", int), _optional(e, "lora_name", str)
    return Stored(
        hashes,
        parent,
        _tokens(tokens, len(hashes) * size),
        size,
        _group(e),
        lora=lora_id is not None or lora_name is not None,
        extra=_extra(e.get("extra_keys"), len(hashes)),
        salt=_optional(e, "cache_salt", str) or None,
        full_attention=_optional(e, "kv_cache_spec_kind", str) in (None, "full_attention"),
        unknown=tuple(heapq.nsmallest(MAX_UNKNOWN, (k for k in e if k not in NEUTRAL_KEYS))),
        medium=_medium(e),
    )


def _tokens(v: object, n: int) -> tuple[int, ...]:
    """`n` token ids, each one kvgate's block hash can pack (`checked_ints` to MAX_TOKEN_ID, which
    runs over every token of every event at C speed)."""
    if not isinstance(v, list) or len(v) != n:
        raise BadEvent("BlockStored.token_ids must be block_size token ids (int64) per block")
    try:
        return checked_ints(v, MAX_TOKEN_ID, "BlockStored.token_ids")
    except ValueError as e:
        raise BadEvent(str(e)) from None


def _extra(v: object, blocks: int) -> tuple[tuple | None, ...]:
    """Per block, its extra hash keys (None: none); nil or an empty list: none for any block."""
    if v is None:
        return ()
    if not isinstance(v, list) or (v and len(v) != blocks):
        raise BadEvent("BlockStored.extra_keys must hold one entry per block")
    return tuple(None if x is None else tuple(x) if isinstance(x, list) else (x,) for x in v)


def _medium(e: dict[str, object]) -> str:
    """kvgate's tier for an event's `medium`; an unknown one is kept as given, lower-cased (the
    translator leaves its blocks out)."""
    m = _optional(e, "medium", str)
    return DEVICE if m is None else MEDIA.get(m.lower(), m.lower())


def _is_hash(h: object) -> TypeGuard[EngineHash]:
    return isinstance(h, int | bytes) and not isinstance(h, bool)


def _hashes(v: object) -> tuple[EngineHash, ...]:
    if not isinstance(v, list) or not set(map(type, v)) <= {int, bytes}:  # exact types: no bool
        raise BadEvent("block_hashes must be a list of ints or bytes")
    return tuple(v)


def _parent(v: object) -> EngineHash | None:
    if v is None or _is_hash(v):
        return v
    raise BadEvent("BlockStored.parent_block_hash must be a hash or nil")


def _group(e: dict[str, object]) -> int:
    return _optional(e, "group_idx", int) or 0


def _optional(e: dict[str, object], key: str, kind: type[T]) -> T | None:
    """Field `key`, nil or a `kind` (a bool is no int): the decoder checks each field it reads, so
    the translator downstream never meets a wrong type."""
    v = e.get(key)
    if v is None or (isinstance(v, kind) and not isinstance(v, bool)):
        return v
    raise BadEvent(f"{key} must be {kind.__name__} or nil")
