"""vLLM / SGLang KV events (gateway/vllm_events.py): one event's decoding and its safe reading when
malformed (batches: tests/test_vllm_batch.py; re-hashing the decoded events into kvgate's chain:
tests/test_vllm_translate.py)."""

import types

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway import bounded_msgpack
from gateway.bounded_msgpack import Items
from gateway.vllm_batch import MAX_BATCH_ITEMS, MAX_BATCH_REASONS, BadBatch, decode_frames, decode_payload
from gateway.vllm_events import (
    EVENT_SLACK,
    MAX_MAP_FIELDS,
    MAX_UNKNOWN,
    BadEvent,
    Removed,
    Stored,
    decode_event,
    stored_tokens,
)
from gateway.vllm_translate import MAX_REASON_LEN, Translator
from tests import vllm_data as vd
from tests import vllm_malformed as vm
from workers.kv.events import CLEARED, DEVICE, DISK, HOST


@pytest.mark.parametrize("name", list(vm.BAD_EVENTS))
def test_a_malformed_event_is_left_out_and_its_batch_keeps_the_others(name):
    """Map keys that are no field name (ints, floats, arrays, maps: once refused by msgpack for
    the whole batch), bad UTF-8, ids kvgate cannot hash, wrong field types, unknown tags, nesting
    deeper than Python recurses: the event is skipped and counted, the batch's good events stay,
    its removals among them (dropping the batch whole once left evicted blocks resident)."""
    good = vd.stored([2], list(range(32)))
    batch = decode_frames([b"kv", (5).to_bytes(8, "big"), vm.payload(good, vm.BAD_EVENTS[name], vd.removed([2]))])
    assert batch.seq == 5 and [type(e) for e in batch.events] == [Stored, Removed]
    assert batch.malformed == 1 and len(batch.reasons) == 1 and batch.reasons[0].startswith("event 1: ")


def test_a_map_keyed_by_anything_inside_a_field_is_a_value_and_costs_nothing_else():
    """vLLM's extra_keys hold any msgpack value: a map there keyed by an int or an array failed
    msgpack, and the whole batch with it. It is the block's extra hash key (kvgate cannot hash
    the block, which is left out), and in a field the decoder does not read it is nothing."""
    keyed = vm.Pairs([(1, "x"), ([2], "y")])
    removal = vm.Pairs([*vd.removed([1]).items(), ("note", keyed)])
    batch = decode_payload(0, vm.payload(vm.stored(extra_keys=[keyed]), removal))
    assert batch.malformed == 0 and [type(e) for e in batch.events] == [Stored, Removed]
    t = Translator(vd.MODEL, 16)
    assert t.apply(batch.events) == [] and t.stats.reasons == {"extra hash keys (multimodal, prompt embeddings)": 1}


@pytest.mark.parametrize("name", list(vm.SAFE_READINGS))
def test_a_malformed_clear_still_clears_and_a_malformed_removal_still_removes(name):
    """What a malformed clear or removal still says is that blocks went: the ones it names, in
    every tier where its medium does not read, else all of them. Forgetting a resident block costs
    a cache miss; the clear or removal left out kept blocks the engine no longer holds resident."""
    bad, safe = vm.SAFE_READINGS[name]
    good = vd.stored([2], list(range(32)))
    batch = decode_payload(5, vm.payload(good, bad, vd.removed([2])))
    assert batch.events[1:] == (*safe, Removed((2,))) and type(batch.events[0]) is Stored
    assert batch.malformed == 1 and batch.reasons[0].startswith("event 1: ")


def test_the_safe_reading_of_a_malformed_clear_leaves_nothing_resident():
    """A clear whose map holds an int key once was left out, and every block stayed resident."""
    t = Translator(vd.MODEL, 16)
    t.apply(
        decode_payload(0, vd.payload([vd.stored([1], list(range(32))), vd.stored([2], list(range(32, 64)))])).events
    )
    assert len(t.resident) == 4
    bad, _ = vm.SAFE_READINGS["clear with an int key"]
    assert [c.kind for c in t.apply(decode_payload(1, vm.payload(bad)).events)] == [CLEARED] and t.resident == set()


def test_a_block_whose_parent_was_skipped_is_an_orphan_not_an_error():
    """A batch missing a stored event: the child chaining from it has no kvgate hash (left out,
    an under-statement), and removing the skipped block removes nothing."""
    tokens = list(range(64))
    bad_parent = vd.stored([1], tokens[:31])  # one token short
    batch = decode_payload(0, vd.payload([bad_parent, vd.stored([2], tokens[32:], parent=1), vd.removed([1])]))
    assert batch.malformed == 1
    t = Translator(vd.MODEL, 16)
    assert t.apply(batch.events) == [] and t.resident == set()
    assert t.stats.orphan_blocks == 1 and t.stats.reasons == {"parent not seen": 1}


NAMES = st.sampled_from(
    [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "lora_name",
        "medium",
        "extra_keys",
        "group_idx",
        "cache_salt",
        "kv_cache_spec_kind",
        "zz",
    ]
)
LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8)
    | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "GPU", "CPU"])
)
# Any msgpack value: scalars, arrays, and maps keyed by names or by any value, mixed in one map.
ANY = st.recursive(
    LEAVES,
    lambda c: st.lists(c, max_size=6) | st.lists(st.tuples(NAMES | c, c), max_size=6).map(vm.Pairs),
    max_leaves=30,
)
# Values whose maps are keyed by names alone: past msgpack, into the decoder's field checks.
NAMED = st.recursive(LEAVES, lambda c: st.lists(c, max_size=6) | st.dictionaries(NAMES, c, max_size=6), max_leaves=30)
VALID = [
    vd.stored([1, 2], list(range(64))),
    vd.stored([3], list(range(64, 96)), parent=2, extra_keys=[["tenant"]]),
    vd.removed([1]),
    {"type": "AllBlocksCleared"},
    vd.sglang_stored([4], list(range(32))),
]


def spoiled(event: dict | list, junk: list[tuple]) -> object:
    """A valid event with `junk` pairs added to its map (a repeated key replaces the field) or
    their values appended to its array."""
    if isinstance(event, dict):
        return vm.Pairs([*event.items(), *junk])
    return [*event, *(v for _, v in junk)]


def either(*strategies: st.SearchStrategy) -> st.SearchStrategy:
    """One of `strategies`, each as likely: `st.one_of` flattens nested choices, so a valid
    timestamp would be one draw in eight against LEAVES."""
    return st.integers(0, len(strategies) - 1).flatmap(lambda i: strategies[i])


JUNK = either(st.tuples(NAMES, NAMED), st.tuples(NAMES | ANY, ANY))
EVENTS = either(st.builds(spoiled, st.sampled_from(VALID), st.lists(JUNK, max_size=2)), NAMED, ANY)
BODIES = either(
    ANY,
    st.builds(
        lambda ts, events, rest: [ts, events, *rest],
        either(st.floats(0, 2e9), LEAVES),
        st.lists(EVENTS, max_size=2),
        st.lists(either(st.integers(0, 8), ANY), max_size=1),
    ),
)


@settings(max_examples=500, deadline=None)
@given(body=BODIES)
def test_any_msgpack_value_decodes_or_is_a_bad_batch_and_translates_without_error(body):
    """Whatever msgpack value stands where a batch or an event is expected (ints, floats, bytes,
    nested arrays and maps, maps keyed by non-strings, by several types, by arrays or maps), the
    decoder gives a batch the translator takes, its malformed events counted as skipped, or a
    BadBatch naming the seq, nothing else."""
    try:
        batch = decode_payload(7, vm.pack(body))
    except BadBatch as e:
        assert e.seq == 7
        return
    kept = len(body[1]) - batch.malformed  # and of each malformed one its safe reading: none, one or a removal per tier
    assert kept <= len(batch.events) <= kept + 3 * batch.malformed and len(batch.reasons) <= MAX_BATCH_REASONS
    Translator(vd.MODEL, 16).apply(batch.events)


@settings(max_examples=500, deadline=None)
@given(event=EVENTS)
def test_an_events_token_ids_are_weighed_as_it_decodes(event):
    """`stored_tokens`, read by headers alone, counts at least a decoded BlockStored's token ids,
    and none of a clear or a removal: a batch over its token budget still reads those."""
    raw = vm.pack(event)
    weighed = stored_tokens(raw)
    try:
        decoded = decode_event(raw, Items(MAX_BATCH_ITEMS))
    except BadEvent as bad:
        assert weighed == 0 or bad.safe == ()
        return
    assert weighed >= len(decoded.token_ids) if isinstance(decoded, Stored) else weighed == 0


STR8_TYPE, STR32_TAG = vm.Raw(b"\xd9\x04type"), vm.Raw(b"\xdb\x00\x00\x00\x0bBlockStored")
WEIGHED = {
    "map": (vd.stored([1, 2], list(range(64))), 64),
    "array (SGLang)": (vd.sglang_stored([1], list(range(32))), 32),
    "removal": (vd.removed([1]), 0),
    "clear": ({"type": "AllBlocksCleared"}, 0),
    "array of no token_ids": (["BlockStored", [1], None], 0),
    "no event": (7, 0),
    "token_ids a map": (vm.stored(token_ids=vm.Pairs([(1, 2)] * 5)), 5),
    "token_ids nil": (vm.stored(token_ids=None), 0),
    "tag and key spelled long": (vm.Pairs([(STR8_TYPE, STR32_TAG), ("token_ids", [1] * 9)]), 9),
    "token_ids repeated": (vm.Pairs([("type", "BlockStored"), ("token_ids", [1] * 3), ("token_ids", [1] * 4)]), 7),
    "last tag a removal's": (vm.stored(("type", "BlockRemoved")), 0),
    "token_ids past the entries read": (
        vm.Pairs([("type", "BlockStored"), *vm.junk(MAX_MAP_FIELDS), ("token_ids", [1])]),
        0,
    ),
}


@pytest.mark.parametrize("name", list(WEIGHED))
def test_a_block_stored_events_token_ids_are_counted_by_their_headers(name):
    """A map's every token_ids among the entries the decoder reads (a long event's first
    MAX_MAP_FIELDS), an array's fourth item, under the tag the decoder reads (a map's last), in
    any of msgpack's string encodings; an array's or map's header gives its count, unread."""
    event, tokens = WEIGHED[name]
    assert stored_tokens(vm.pack(event)) == tokens


@pytest.mark.parametrize(
    "medium, ours", [("GPU", DEVICE), (None, DEVICE), ("CPU", HOST), ("cpu", HOST), ("STORAGE", DISK), ("disk", DISK)]
)
def test_an_events_medium_is_kvgates_tier(medium, ours):
    """vLLM names its tiers GPU, CPU (the offloading connector) and STORAGE (file and object tiers)."""
    tokens = list(range(32))
    batch = decode_payload(
        0, vd.payload([vd.stored([1], tokens, medium=medium), {**vd.removed([1]), "medium": medium}])
    )
    assert [e.medium for e in batch.events] == [ours, ours]


def test_an_event_with_all_the_unknown_fields_it_may_hold_names_a_few_and_no_reason_grows_long():
    """An array event's items past the known ones each became a named field (a dict entry per
    item: gigabytes for a payload of one-byte items), and a map's unknown keys all went into one
    skip reason the translator keeps for good."""
    many = [*vm.STORED_ARRAY, *([1] * EVENT_SLACK)]
    keyed = {**vd.stored([2], list(range(32)))}
    keyed |= {f"x{i:06}" + "y" * 100: 1 for i in range(MAX_MAP_FIELDS - len(keyed))}
    batch = decode_payload(0, vd.payload([many, keyed]))
    assert batch.malformed == 0
    assert [len(e.unknown) for e in batch.events] == [MAX_UNKNOWN] * 2
    assert batch.events[0].unknown == ("field 10", "field 11", "field 9")  # names in sorted order
    assert batch.events[1].unknown == tuple(f"x{i:06}" + "y" * 100 for i in range(MAX_UNKNOWN))
    t = Translator(vd.MODEL, 16)
    t.apply(batch.events)
    assert t.stats.skipped_blocks == 2 and all(len(r) <= MAX_REASON_LEN for r in t.stats.reasons)


@pytest.fixture
def reads(monkeypatch) -> list[int]:
    """[values the decoder reads]: each an Unpacker unpacks or skips, and each item of the array or
    map msgpack.unpackb builds, counted as gateway.vllm_batch and vllm_events call them (by
    gateway.bounded_msgpack)."""
    n = [0]

    class Unpacker(msgpack.Unpacker):
        def unpack(self):
            n[0] += 1
            return super().unpack()

        def skip(self):
            n[0] += 1
            return super().skip()

    def unpackb(packed, /, **kw):
        v = msgpack.unpackb(packed, **kw)
        n[0] += len(v) if isinstance(v, list | tuple) else 1
        return v

    monkeypatch.setattr(
        bounded_msgpack, "msgpack", types.SimpleNamespace(**{**vars(msgpack), "Unpacker": Unpacker, "unpackb": unpackb})
    )
    return n


MANY = 100_000  # one-byte items past a batch's or an event's fields: a 16 MiB payload holds 16 M
LONG = {
    "array event items": [1.0, [["BlockRemoved", [1, 2], "gpu", *[None] * MANY]]],
    "map event entries": [1.0, [vm.Pairs([*vd.removed([1, 2]).items(), *[(0, 0)] * MANY])]],
}


@pytest.mark.parametrize("name", list(LONG))
def test_an_event_of_too_many_items_is_refused_by_its_header_unread(name, reads):
    """An event of more than its fields and EVENT_SLACK is a malformed one, its removal still
    applied (its leading fields): the decoder once read every item, seconds of the gateway's event
    loop for 16 M in a payload under MAX_PAYLOAD, and took the array event as valid."""
    batch = decode_payload(3, vm.pack(LONG[name]))
    assert batch.events == (Removed((1, 2)),) and batch.malformed == 1 and "over" in batch.reasons[0]
    assert reads[0] < 64, f"{reads[0]} values read of {MANY} junk"
