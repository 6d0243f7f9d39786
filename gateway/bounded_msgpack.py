"""msgpack read with bounded work, for what another process of the fleet sends (vLLM's KV events:
gateway/vllm_events.py, their batches: gateway/vllm_batch.py).

A container's header says how many items it holds before any is built (`header_size`, read
alone), and a value's bytes can be found and compared without decoding them (`skipped`,
`Spellings`). A value is built within an allowance of items (`Items`): whole at C speed where its
bytes could not hold more, else field by field (`unpack`), each of its arrays spent by its header
before any item is built and everything inside under msgpack's per-container limit (NESTED), its
containers spent by msgpack's hooks as they are built.
"""

from itertools import islice

import msgpack

# Items of a container inside a field (read where a value's bytes exceed its items). vLLM's are an
# extra_keys entry (a LoRA name, a cache salt, a prompt-embeds digest and an (id, offset) pair per
# multimodal item in its block: at most a block's tokens and 3, at vLLM's block sizes up to 256)
# and such a pair; a longer entry would name multimodal keys, whose blocks kvgate leaves out
# anyway. msgpack applies one limit at every depth, so a field's own array, which may hold a
# batch's token ids, is read by its header instead; under this limit containers nested 1024 deep
# (msgpack's stack), each full but for the next, build ~266 K items before any is counted.
NESTED = 256 + 3


class Pairs(tuple):
    """A msgpack map as its (key, value) pairs, in order; the decoder checks the keys itself.
    Built as a dict, a map keyed by an array or a map fails inside msgpack (TypeError:
    unhashable), and with `strict_map_key` any key but a string fails the whole payload, the
    good events of its batch with it."""


READ = {"raw": False, "strict_map_key": False, "object_pairs_hook": Pairs}
# What building a container or an ext value costs beyond its items, in items: msgpack calls a
# Python hook for it (the decoder's count, an ext's constructor) and the object it builds is one
# the collector tracks. Counted as one item, a payload of empty arrays, one-entry maps or ext
# values cost 10 to 30 times one of ints of the same count (2.8 M ext values ~3.8 s).
CALL = 16
PAIR = 3  # a map entry builds its key, its value and the pair holding them
# A string or bytes value is one item whatever its length: one copy at C speed (16 MiB, all a
# payload holds, in 1 to 12 ms), so its length needs no bound of its own; its count has one.


class Ext:
    """An ext value (msgpack's extension types) as read here, one object for all, in place of the
    msgpack.ExtType msgpack builds through Python: no field a KV event's decoder reads takes one."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "Ext()"


EXT = Ext()


class Refused(ValueError):
    """Items refused by their container's header, before any was built."""


class Items:
    """The items a decoding may still build, spent as they are built: each array item 1, each map
    entry PAIR, each container and ext value CALL more. A container read by its header is spent
    before its items are built (`claim`: past what is left, refused unbuilt); msgpack's hooks
    spend the others as they are completed (`array`, `pairs`, `ext`: past what is left,
    ValueError, as msgpack's own limits raise). A read that fails but by `claim` spends its bytes,
    at most all that is left (`failed`): the containers still open and their items, built, were
    not counted, and each took a byte at least. Once all is spent every container is refused by
    its header (`reader` limits each to what is left).

    `options` are msgpack's for reading within them, built once (a decoding's): every container
    and ext value spent through its hook. A timestamp, which no hook sees, is read as a float, an
    item of its container (no field takes either): as a msgpack.Timestamp, built through Python,
    it cost four times as much, ~0.5 us. (As an int, cheaper still, it would pass for a hash.)"""

    __slots__ = ("allowed", "left", "options")

    def __init__(self, allowed: int):
        self.allowed = self.left = allowed
        self.options = {**READ, "object_pairs_hook": self.pairs, "list_hook": self.array, "ext_hook": self.ext}
        self.options["timestamp"] = 1

    def claim(self, n: int) -> None:
        if n > self.left:
            raise Refused(f"{n} items, over the {self.left} left of the {self.allowed} its batch may build")
        self.left -= n

    def failed(self, size: int, why: Exception) -> None:
        """A read of `size` bytes failed of `why`."""
        if not isinstance(why, Refused):
            self.left -= min(self.left, size)

    # The hooks, one Python call each per container msgpack builds: each checks for itself.
    def array(self, items: list) -> list:
        n = CALL + len(items)
        if n > self.left:
            raise self.over()
        self.left -= n
        return items

    def pairs(self, pairs: list[tuple[object, object]]) -> Pairs:
        n = CALL + PAIR * len(pairs)
        if n > self.left:
            raise self.over()
        self.left -= n
        return Pairs(pairs)

    def ext(self, code: int, data: bytes) -> Ext:
        if CALL > self.left:
            raise self.over()
        self.left -= CALL
        return EXT

    def over(self) -> ValueError:
        return ValueError(f"decoding builds over the {self.allowed} items its batch may")


def unpack(raw: bytes | memoryview, left: Items) -> object:
    """The value `raw` holds, built within `left` (and the containers still open when it runs
    out: NESTED). A value of no more bytes than are left is unpacked whole at C speed: what it
    builds uncounted before a refusal, a byte each at least, its failure spends. A longer one
    (vLLM's largest event, a step's megabytes of token ids, among them) is read field by field
    (`value`): its own items and an array by their header, spent before any is built; each value
    inside an array, and every other field, under NESTED, its containers spent as built. vLLM's
    long arrays are an event's own fields (token ids, block hashes, extra_keys entries), so both
    ways read its events alike and spend the same."""
    try:
        if len(raw) <= left.left:
            return msgpack.unpackb(raw, **left.options)
        return _by_field(raw, left)
    except (ValueError, msgpack.UnpackException) as bad:
        left.failed(len(raw), bad)
        raise


def _by_field(raw: bytes | memoryview, left: Items) -> object:
    u, first = reader(raw, left), raw[0]
    e: object
    if is_map(first):
        n = u.read_map_header()
        left.claim(CALL + PAIR * n)
        e = Pairs([(u.unpack(), value(u, raw, left)) for _ in range(n)])
    elif is_array(first):
        n = u.read_array_header()
        left.claim(CALL + n)
        e = [value(u, raw, left) for _ in range(n)]
    else:
        e = u.unpack()
    if u.tell() != len(raw):
        raise ValueError("an event has bytes past its value")
    return e


def reader(raw: bytes | memoryview, left: Items) -> msgpack.Unpacker:
    """An Unpacker of `raw` whose containers hold at most NESTED items each, and no more than
    `left` has, and spend what they build from it."""
    most = min(NESTED, left.left)
    u = msgpack.Unpacker(max_buffer_size=max(len(raw), 1), max_array_len=most, max_map_len=most, **left.options)
    u.feed(raw)
    return u


def value(u: msgpack.Unpacker, raw: bytes | memoryview, left: Items) -> object:
    """The field `u` is at: an array of any length `left` allows, read by its header and spent
    before any item is built, then each item under NESTED; any other value under NESTED."""
    if not (u.tell() < len(raw) and is_array(raw[u.tell()])):
        return u.unpack()
    n = u.read_array_header()
    left.claim(CALL + n)
    v = list(islice(u, n))
    if len(v) < n:  # islice stops quietly where the bytes end
        raise ValueError("an event's array is truncated")
    return v


def scalar(raw: bytes | memoryview) -> object:
    """The value msgpack bytes `raw` hold where a scalar is due (a number, a string, nil): a
    container is refused by its header, unbuilt (ValueError), as is what does not decode."""
    if is_map(raw[0] if raw else 0) or is_array(raw[0] if raw else 0):
        raise ValueError("a container where a scalar is due")
    return msgpack.unpackb(raw, **READ)


def unpacker(buf: bytes | memoryview) -> msgpack.Unpacker:
    """An Unpacker holding `buf`, its lengths capped by `buf`'s size as `msgpack.unpackb` caps
    them: an array header claiming 2**32 items must not allocate them."""
    u = msgpack.Unpacker(max_buffer_size=max(len(buf), 1), **READ)
    u.feed(buf)
    return u


def is_map(first: int) -> bool:
    """Whether msgpack bytes starting with `first` are a map (fixmap, map 16, map 32)."""
    return 0x80 <= first <= 0x8F or first in (0xDE, 0xDF)


def is_array(first: int) -> bool:
    return 0x90 <= first <= 0x9F or first in (0xDC, 0xDD)


def header_size(raw: bytes | memoryview) -> int:
    """The items (entries) of the array (map) `raw` holds, as its header says, read alone: a
    fix header's low nibble, else the big-endian count after its first byte (an Unpacker's
    read_array_header costs more than a small event's decoding); 0 for another value."""
    first = raw[0] if raw else 0
    if is_map(first) or is_array(first):
        return first & 0x0F if first < 0xA0 else int.from_bytes(raw[1 : 3 if first in (0xDC, 0xDE) else 5], "big")
    return 0


def skipped(u: msgpack.Unpacker, raw: bytes | memoryview) -> bytes | memoryview:
    """The bytes of the value `u` is at, skipped."""
    start = u.tell()
    u.skip()
    return raw[start : u.tell()]


class Spellings:
    """Names by their every msgpack encoding: a fixstr, a str 8, 16 or 32 all decode to a name,
    and a publisher may send any. `of` reads which name msgpack bytes spell by comparing them,
    nothing decoded."""

    def __init__(self, *names: str):
        self.names: dict[bytes, str] = {}
        for name in names:
            data, n = name.encode(), len(name.encode())
            for head in (
                bytes([0xA0 | n]),
                bytes([0xD9, n]),
                b"\xda" + n.to_bytes(2, "big"),
                b"\xdb" + n.to_bytes(4, "big"),
            ):
                self.names[head + data] = name
        self.longest = max(map(len, self.names))

    def of(self, value: bytes | memoryview) -> str | None:
        """The name msgpack bytes `value` spell, or None."""
        return self.names.get(bytes(value)) if len(value) <= self.longest else None
