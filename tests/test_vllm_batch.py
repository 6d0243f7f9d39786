"""vLLM / SGLang KV event batches off the wire (gateway/vllm_batch.py): framing of a message, the
live and replayed batch, its envelope and the caps on what one batch may cost."""

import types

import msgpack
import pytest

from gateway import bounded_msgpack, vllm_batch
from gateway.bounded_msgpack import CALL, NESTED, PAIR, Items
from gateway.vllm_batch import MAX_BATCH_REASONS, MAX_ENVELOPE, BadBatch, decode_frames, decode_payload
from gateway.vllm_events import MAX_MAP_FIELDS, BadEvent, Cleared, Removed, Stored, decode_event
from gateway.vllm_translate import Translator
from tests import vllm_data as vd
from tests import vllm_malformed as vm
from tests.test_vllm_events import MANY, reads  # noqa: F401 (reads: a fixture)


def test_recorded_live_and_replayed_batches_decode_alike():
    live = [decode_frames(f) for f in vd.recorded()["live"]]
    replayed = vd.decoded_replay()
    assert [b.seq for b in replayed] == list(range(12)) == [b.seq for b in live]
    assert live == replayed
    kinds = [type(e).__name__ for b in replayed for e in b.events]
    assert kinds.count("Stored") == 12 and kinds.count("Removed") == 40 and kinds.count("Cleared") == 1
    first = replayed[0].events[0]
    assert isinstance(first, Stored) and first.block_size == 32 and len(first.hashes) == 7
    assert first.parent is None and len(first.token_ids) == 7 * 32 and first.unknown == ()
    assert replayed[2].events[0].extra[0] == ("tenant-a",)


@pytest.mark.parametrize(
    "frames",
    [
        [b"kv", b"\x00" * 7, b""],
        [b"kv"],
        [b"kv", b"\x00" * 8, b"\xc1"],
        [b"kv", b"\x00" * 8, msgpack.packb({"ts": 1})],
    ],
)
def test_malformed_frames_are_bad_batches(frames):
    with pytest.raises(BadBatch):
        decode_frames(frames)


@pytest.mark.parametrize("name", list(vm.MALFORMED))
def test_every_malformed_payload_is_a_bad_batch_naming_its_seq(name):
    """Bytes that hide where the events end (nesting deeper than msgpack's stack, a reserved byte,
    a truncated or oversized payload), bad timestamps, a wrong envelope: a BadBatch naming the
    batch's seq (the subscriber steps over it in order), never another exception."""
    with pytest.raises(BadBatch) as e:
        decode_frames([b"kv", (5).to_bytes(8, "big"), vm.MALFORMED[name]])
    assert e.value.seq == 5


@pytest.mark.parametrize("name", list(vm.BAD_ENVELOPES))
def test_a_batch_whose_ts_or_dp_rank_is_malformed_keeps_its_events(name):
    """They are the engine's all the same: dropping the batch kept the blocks it removed
    resident. The field counts as malformed; a ts that did not read is None (it tells the
    subscriber no restart), a rank 0."""
    batch = decode_payload(5, vm.BAD_ENVELOPES[name])
    assert [type(e) for e in batch.events] == [Stored, Removed] and batch.malformed == 1 and batch.rank == 0
    assert (batch.ts is None) == name.endswith(" ts") and batch.reasons[0].startswith(name.split()[-1])


def test_skipped_events_are_all_counted_and_only_the_first_few_named():
    """A hostile batch of many bad events costs a count, not a reason per event."""
    bad = [{"type": f"Nope{i}"} for i in range(10_000)]
    batch = decode_payload(0, vd.payload([*bad, vd.removed([1])]))
    assert batch.events == (Removed((1,)),) and batch.malformed == 10_000
    assert batch.reasons == tuple(f"event {i}: unknown event type 'Nope{i}'" for i in range(MAX_BATCH_REASONS))


@pytest.mark.parametrize(
    "fields",
    [
        [("ts", 1.0), ("events", vm.EVENTS), ("data_parallel_rank", 2)],
        [("data_parallel_rank", 2), ("extra", [1, 2]), (7, "x"), ("events", vm.EVENTS), ("ts", 1.0)],
    ],
)
def test_a_batch_encoded_as_a_map_reads_as_the_array_one(fields):
    """msgspec encodes a struct without `array_like` as a map of its fields: a vLLM whose
    EventBatch is such a struct sends the same batch keyed by name (keys in any order; other
    keys, names or not, skipped)."""
    as_array = decode_payload(3, vm.pack([1.0, vm.EVENTS, 2]))
    as_map = decode_payload(3, vm.pack(vm.Pairs(fields)))
    assert (as_map.ts, as_map.rank, as_map.events, as_map.malformed) == (1.0, 2, as_array.events, 0)
    assert [type(e) for e in as_map.events] == [Stored, Removed]


LONG = {
    "envelope items": [1.0, [], *[0] * MANY],
    "map envelope entries": vm.Pairs([("ts", 1.0), ("events", []), *[(0, 0)] * MANY]),
}


@pytest.mark.parametrize("name", list(LONG))
def test_an_envelope_of_too_many_items_is_refused_by_its_header_unread(name, reads):
    """A batch's envelope of more than MAX_ENVELOPE items or entries is no batch: the decoder once
    read every item, seconds of the gateway's event loop for 16 M in a payload under MAX_PAYLOAD."""
    with pytest.raises(BadBatch, match=f"over {MAX_ENVELOPE}"):
        decode_payload(3, vm.pack(LONG[name]))
    assert reads[0] < 64, f"{reads[0]} values read of {MANY} junk"


def test_block_stored_events_past_the_batch_token_budget_are_left_out_and_removals_kept(monkeypatch):
    """Two 32-token BlockStored events fill a budget of 64 token ids: the third, and every
    BlockStored after it (weighed by its headers), is malformed; the removal between them is read."""
    monkeypatch.setattr(vllm_batch, "MAX_BATCH_TOKENS", 64)
    batch = decode_payload(1, vm.payload(vm.stored(), vm.stored(), vm.stored(), vd.removed([1]), vm.stored()))
    assert [type(e) for e in batch.events] == [Stored, Stored, Removed]
    assert batch.malformed == 2 and "token ids" in batch.reasons[0]


@pytest.fixture
def decoded(monkeypatch) -> list[bytes]:
    """[the bytes of each event gateway.vllm_batch hands decode_event], in order."""
    seen: list[bytes] = []

    def spy(raw: memoryview, left: Items):
        seen.append(bytes(raw))
        return decode_event(raw, left)

    monkeypatch.setattr(vllm_batch, "decode_event", spy)
    return seen


STR8 = {name: vm.Raw(bytes([0xD9, len(name)]) + name.encode()) for name in ("type", "token_ids", "BlockStored")}
TOKENS = list(range(64))
# A 64-token BlockStored as each encoding may send it; msgpack decodes them all to the same event.
BIG = {
    "map": vd.stored([1, 2], TOKENS),
    "array (SGLang)": vd.sglang_stored([1, 2], TOKENS),
    "map keyed by str 8 names": vm.Pairs(
        [(STR8["type"], STR8["BlockStored"]), (STR8["token_ids"], TOKENS)]
        + [(k, v) for k, v in vd.stored([1, 2], TOKENS).items() if k not in ("type", "token_ids")]
    ),
    "map whose last tag is BlockStored": vm.Pairs([("type", "BlockRemoved"), *vd.stored([1, 2], TOKENS).items()]),
    "map of too many entries": vm.stored(*vm.junk(MAX_MAP_FIELDS), token_ids=TOKENS, block_hashes=[1, 2]),
}


@pytest.mark.parametrize("name", list(BIG))
def test_a_block_stored_event_past_the_token_budget_is_left_out_unread(name, decoded, monkeypatch):
    """A budget of 64 token ids, 32 of them spent: a 64-token BlockStored is weighed by the header
    of its token_ids and never decoded (the first past the budget once was: 16 M one-byte ids held
    the event loop ~1 s before being left out); it costs only itself: a 32-token one after it fits
    and is read, and so is the removal."""
    monkeypatch.setattr(vllm_batch, "MAX_BATCH_TOKENS", 64)
    small = vd.stored([3], list(range(32)))
    batch = decode_payload(1, vm.payload(small, BIG[name], small, vd.removed([1])))
    assert vm.pack(BIG[name]) not in decoded and len(decoded) == 3
    assert [type(e) for e in batch.events] == [Stored, Stored, Removed]
    assert batch.malformed == 1 and batch.reasons[0].startswith("event 1: its 64 token ids")


def test_malformed_block_stored_events_spend_the_budget_and_removals_are_still_read(decoded, monkeypatch):
    """A malformed BlockStored costs the budget its bytes, at most what is left: uncounted, a
    payload of them was decoded whole whatever the budget. Once it is spent the next ones are
    left out unread; a removal, of no token ids, still fits."""
    bad = vm.BAD_EVENTS["wrong token count"]
    monkeypatch.setattr(vllm_batch, "MAX_BATCH_TOKENS", 3 * len(vm.pack(bad)) - 1)
    batch = decode_payload(1, vm.payload(*[bad] * 10, vd.removed([1])))
    assert decoded == [vm.pack(bad)] * 3 + [vm.pack(vd.removed([1]))]
    assert batch.events == (Removed((1,)),) and batch.malformed == 10


@pytest.fixture
def built(monkeypatch) -> list[int]:
    """[items msgpack built for gateway.vllm_events (by gateway.bounded_msgpack)]: each array item
    and map entry, counted as its container is completed (a hook run before the decoder's own),
    and each value an Unpacker hands out."""
    n = [0]

    def counting(kw: dict) -> dict:
        arrays, pairs = kw.get("list_hook", list), kw["object_pairs_hook"]

        def list_hook(v: list) -> object:
            n[0] += len(v)
            return arrays(v)

        def pairs_hook(v: list) -> object:
            n[0] += len(v)
            return pairs(v)

        return {**kw, "list_hook": list_hook, "object_pairs_hook": pairs_hook}

    class Unpacker(msgpack.Unpacker):
        def __init__(self, **kw):
            super().__init__(**counting({"object_pairs_hook": dict, **kw}))

        def __next__(self):
            n[0] += 1
            return super().__next__()

        def unpack(self):
            n[0] += 1
            return super().unpack()

    def unpackb(packed, /, **kw):
        return msgpack.unpackb(packed, **counting(kw))

    monkeypatch.setattr(
        bounded_msgpack, "msgpack", types.SimpleNamespace(**{**vars(msgpack), "Unpacker": Unpacker, "unpackb": unpackb})
    )
    return n


ALLOWED, MANY = 1000, 100_000  # items a batch may build here; items a hostile event holds


def staircase(levels: int, per: int) -> list:
    """`levels` arrays of `per` items, each but the innermost ending with the next: every level
    nearly full, so msgpack's one limit per container, at a batch's token ids, lets them all be built."""
    inner: list = [1] * per
    for _ in range(levels - 1):
        inner = [*[1] * (per - 1), inner]
    return inner


REFUSED_UNBUILT, BUILT = Removed((2,)), Cleared()  # how a removal after the refused event reads
TOO_MANY = {  # (an event holding MANY items, what a batch keeps of it, how a removal after it reads)
    "token_ids nested one level": (vm.stored(token_ids=[[1] * MANY]), (), BUILT),
    "token_ids, a staircase": (vm.stored(token_ids=staircase(MANY // ALLOWED, ALLOWED)), (), REFUSED_UNBUILT),
    "block_hashes": (vm.stored(block_hashes=[1] * MANY), (), REFUSED_UNBUILT),
    "extra_keys": (vm.stored(extra_keys=[1] * MANY), (), REFUSED_UNBUILT),
    "extra_keys entries": (vm.stored(extra_keys=[[1] * 250] * (MANY // 250)), (), BUILT),
    "an unknown field of a map": (vm.stored(("note", vm.Pairs([(i, 0) for i in range(MANY)]))), (), BUILT),
    "block_hashes of an array event": (["BlockStored", [1] * MANY, None, [], 32], (), REFUSED_UNBUILT),
    "the tag": (vm.Pairs([("type", [1] * MANY), ("x", vm.Raw(b"\xa1\xff"))]), (), REFUSED_UNBUILT),
    "a removal's block_hashes": (vd.removed([1] * MANY), (Cleared(),), REFUSED_UNBUILT),
    "a removal's block_hashes, its event too long": (
        vm.Pairs([*vd.removed([1] * MANY).items(), *vm.junk(MAX_MAP_FIELDS)]),
        (Cleared(),),
        REFUSED_UNBUILT,
    ),
    "a removal's medium": (
        vm.Pairs([*vd.removed([1]).items(), ("medium", [1] * MANY)]),
        (Cleared(),),
        REFUSED_UNBUILT,
    ),
    "a removal's block_hashes before its tag, its event too long": (
        vm.Pairs([("block_hashes", [1] * MANY), ("type", "BlockRemoved"), *vm.junk(MAX_MAP_FIELDS)]),
        (Cleared(),),
        REFUSED_UNBUILT,
    ),
}


@pytest.mark.parametrize("name", list(TOO_MANY))
def test_an_event_is_refused_before_building_more_items_than_its_batch_may(name, built, monkeypatch):
    """Whatever field holds them, at whatever depth, an event builds at most about what its batch
    has left (MAX_BATCH_ITEMS) before it is refused: the decoder once built all of a payload's 16
    M one-byte items (~0.6 s) wherever they were but in a flat token_ids. Refused, it is
    malformed: a BlockStored left out, a removal whose hashes were not read a clear. Refused by a
    header, unbuilt, it leaves the batch its items: a removal after it is read; refused once
    built (msgpack's limit inside a field, a hook), it spends what its bytes could have built,
    and a removal after it, past the batch's items, reads as a clear."""
    monkeypatch.setattr(vllm_batch, "MAX_BATCH_ITEMS", ALLOWED)
    event, kept, after = TOO_MANY[name]
    batch = decode_payload(1, vm.payload(vd.stored([2], list(range(32))), event, vd.removed([2])))
    assert batch.events[1:] == (*kept, after) and type(batch.events[0]) is Stored
    assert batch.malformed == 1 + (after == BUILT)
    assert built[0] < ALLOWED + NESTED + 100, f"{built[0]} items built of {MANY}"


def test_a_batchs_events_build_no_more_than_its_items_together_and_a_removal_past_them_clears(built, monkeypatch):
    """Each event's decoding takes from what the batch's earlier ones left (MAX_BATCH_ITEMS), so
    one batch's decoding is bounded whatever its event count: with an allowance per event, two
    removals of 8 M hashes in one payload built 16 M items (~0.7 s). Once the items are spent, a
    removal, its hashes unread, is read as a clear, as any unreadable removal: the index forgets
    blocks no removal named rather than keep ones an unread removal evicted."""
    monkeypatch.setattr(vllm_batch, "MAX_BATCH_ITEMS", ALLOWED)
    t = Translator(vd.MODEL, 16)
    t.apply(decode_payload(0, vd.payload([vd.stored([1], list(range(32)))])).events)
    named = [list(range(1000 + i * 100, 1100 + i * 100)) for i in range(20)]
    batch = decode_payload(1, vm.payload(*(vd.removed(h) for h in named)))
    read = [e for e in batch.events if e != Cleared()]
    assert 0 < len(read) < len(named) and read == [Removed(tuple(h)) for h in named[: len(read)]]
    assert batch.events[len(read) :] == (Cleared(),) * (len(named) - len(read))
    assert batch.malformed == len(named) - len(read) and built[0] < ALLOWED + 64  # and keys, values handed out
    t.apply(batch.events)
    assert t.resident == set()


# A field's values of one kind, each of which costs the decoder a Python call and an object the
# collector tracks, or map entries: under a batch's 500 items by their count, over by their cost.
COSTLY = {
    "empty arrays": [[]] * 100,
    "empty maps": [vm.Pairs([])] * 100,
    "one-entry maps": [vm.Pairs([(None, None)])] * 100,
    "ext values": [msgpack.ExtType(5, b"")] * 100,
    "map entries": vm.Pairs([(i, None) for i in range(200)]),
}


@pytest.mark.parametrize("name", list(COSTLY))
def test_a_value_spends_what_building_it_costs_not_only_its_count(name, monkeypatch):
    """A container or an ext value spends CALL items more than its own, a map entry PAIR (its
    key, its value, their pair): counted as one item, 2.8 M ext values in a 16 MiB payload cost
    ~3.8 s, 5 M one-entry maps ~2 s, within an allowance of 8 M. A removal whose unknown field
    holds more than its batch may build is read as a clear."""
    monkeypatch.setattr(vllm_batch, "MAX_BATCH_ITEMS", 500)
    batch = decode_payload(1, vm.payload(vm.Pairs([*vd.removed([1]).items(), ("note", COSTLY[name])])))
    assert batch.events == (Cleared(),) and "over the" in batch.reasons[0]


def test_a_timestamp_is_read_as_a_float_and_no_msgpack_timestamp_is_built(monkeypatch):
    """msgpack builds a Timestamp through Python, uncounted by any hook (~0.5 us each: 2.8 M in a
    payload ~1 s); as a float it is an item of its container. No field the decoder reads takes
    either: a removal's note of them is nothing, its hashes of them unreadable (a clear)."""
    made = []
    init = msgpack.Timestamp.__init__

    def counted(self, *args):
        made.append(1)
        init(self, *args)

    stamps = [msgpack.Timestamp(1, 0)] * 100
    monkeypatch.setattr(msgpack.Timestamp, "__init__", counted)
    note = vm.Pairs([*vd.removed([1]).items(), ("note", stamps)])
    batch = decode_payload(1, vm.payload(note, vd.removed(stamps)))
    assert batch.events == (Removed((1,)), Cleared()) and made == []


def test_a_string_or_bytes_value_is_one_item_whatever_its_length(monkeypatch):
    """A string or bytes value is built by one copy at C speed (a 16 MiB one in ~10 ms, and a
    payload holds no more): its length needs no bound of its own, its count does, and has one as
    its container's items."""
    monkeypatch.setattr(vllm_batch, "MAX_BATCH_ITEMS", ALLOWED)
    long = vm.Pairs([*vd.removed([1]).items(), ("note", ["x" * (1 << 20), b"y" * (1 << 20)])])
    many = vm.Pairs([*vd.removed([1]).items(), ("note", [""] * ALLOWED)])
    assert decode_payload(1, vm.payload(long)).events == (Removed((1,)),)
    assert decode_payload(1, vm.payload(many)).events == (Cleared(),)


# A batch whose envelope holds MANY items where a scalar or a name is due, and its malformed fields.
ENVELOPE_JUNK = {
    "ts an array": ([[1] * MANY, vm.EVENTS], 1),
    "ts nested": ([[[1] * MANY], vm.EVENTS], 1),
    "ts a map": ([vm.Pairs([(i, 0) for i in range(MANY)]), vm.EVENTS], 1),
    "dp_rank an array": ([1.0, vm.EVENTS, [1] * MANY], 1),
    "a map envelope's key": (vm.Pairs([([1] * MANY, 0), ("ts", 1.0), ("events", vm.EVENTS)]), 0),
}


@pytest.mark.parametrize("name", list(ENVELOPE_JUNK))
def test_an_envelope_field_of_many_items_is_refused_by_its_header_unbuilt(name, built):
    """`ts` and `dp_rank` are scalars and a map envelope's keys names: a container there is
    malformed (a key no name) by its header, as cheap as any other bad field; each was built
    whole, ~0.2 s for 16 M items in a payload under MAX_PAYLOAD. The batch's events stay."""
    body, malformed = ENVELOPE_JUNK[name]
    batch = decode_payload(1, vm.pack(body))
    assert [type(e) for e in batch.events] == [Stored, Removed] and batch.malformed == malformed
    assert built[0] < 64, f"{built[0]} items built of {MANY}"


def held(v: object) -> int:
    """The items building `v` spends (bounded_msgpack.Items): a container CALL and its items, a
    map's entries PAIR each, then theirs, at every depth."""
    if isinstance(v, vm.Pairs):  # a list of pairs: before a list
        return CALL + PAIR * len(v) + sum(held(k) + held(x) for k, x in v)
    if isinstance(v, list):
        return CALL + len(v) + sum(map(held, v))
    return 0


def recorded_events() -> list[bytes]:
    """Each event of the recorded vLLM batches that holds items (a clear holds none), packed alone."""
    bodies = [msgpack.unpackb(frames[-1], strict_map_key=False) for frames in vd.recorded()["live"]]
    return [msgpack.packb(e, use_bin_type=True) for body in bodies for e in body[1] if e["type"] != "AllBlocksCleared"]


SALTED_LORA = vd.stored([1, 2], list(range(64)), lora_name="a", extra_keys=[["a", "salt"], ["a"]])
REAL = {
    **{f"recorded {i}": raw for i, raw in enumerate(recorded_events())},
    "salted LoRA map": msgpack.packb(SALTED_LORA),
    "array (SGLang)": msgpack.packb(vd.sglang_stored([1, 2], list(range(1000, 1064)), lora_id=3)),
}


@pytest.mark.parametrize("name", list(REAL))
def test_an_event_read_field_by_field_reads_and_spends_as_it_does_whole_and_not_an_item_more(name):
    """A vLLM event (its block hashes, token ids, extra_keys per block, LoRA fields, medium) given
    exactly the items it holds, fewer than its bytes, is read field by field and decodes as it
    does whole, each way spending them all; an item less is refused."""
    raw = REAL[name]
    items = held(msgpack.unpackb(raw, strict_map_key=False, object_pairs_hook=vm.Pairs))
    exact, whole = Items(items), Items(len(raw))
    assert items < len(raw)
    assert decode_event(raw, exact) == decode_event(raw, whole) and exact.left == 0
    assert whole.allowed - whole.left == items
    with pytest.raises(BadEvent, match="over the"):
        decode_event(raw, Items(items - 1))
