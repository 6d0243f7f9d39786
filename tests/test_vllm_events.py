"""vLLM / SGLang KV events (gateway/vllm_events.py): one event's decoding, its safe reading when
malformed, and re-hashing the decoded events into kvgate's chain (batches: tests/test_vllm_batch.py)."""

import types

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway import vllm_events
from gateway.vllm_batch import MAX_BATCH_REASONS, BadBatch, decode_frames, decode_payload, decode_replay
from gateway.vllm_events import (
    EVENT_SLACK,
    MAX_MAP_FIELDS,
    MAX_UNKNOWN,
    BadEvent,
    Cleared,
    Removed,
    Stored,
    decode_event,
    stored_tokens,
)
from gateway.index import ResidencyIndex
from gateway.vllm_translate import MAX_REASON_LEN, MAX_REASONS, Change, Translator
from gateway.vllm_worker import IndexSink
from tests import vllm_data as vd
from tests import vllm_malformed as vm
from workers.kv.events import CLEARED, DEVICE, DISK, HOST, REMOVED, STORED


@pytest.mark.parametrize("block_size", [16, 32])
def test_recorded_blocks_get_the_hashes_the_gateway_computes_for_the_same_prompts(block_size):
    t = Translator(vd.MODEL, block_size)
    batches = vd.decoded_replay()
    a, chat = vd.prompt_ids("A"), vd.prompt_ids("chat")
    for b in batches[:4]:
        t.apply(b.events)
    assert set(vd.ours(a, block_size)) <= t.resident  # A, unsalted
    assert set(vd.ours(a, block_size, salt="tenant-a")) <= t.resident  # A with cache_salt: another chain
    assert set(vd.ours(chat, block_size)) <= t.resident  # chat content parts, as the gateway renders them
    assert not set(vd.ours(a, block_size)) & set(vd.ours(a, block_size, salt="tenant-a"))
    for b in batches[4:]:
        t.apply(b.events)
    assert t.resident == set(vd.ours(vd.prompt_ids("C"), block_size))  # cleared, then C alone


def test_evictions_are_mirrored_block_for_block():
    t = Translator(vd.MODEL, 16)
    cached: set = set()
    for b in vd.decoded_replay():
        changes = t.apply(b.events)
        for e in b.events:
            if isinstance(e, Stored):
                cached |= set(e.hashes)
            elif isinstance(e, Removed):
                cached -= set(e.hashes)
            else:
                cached.clear()
        assert len(t.resident) == 2 * len(cached), f"after seq {b.seq}"
        if any(isinstance(e, Removed) for e in b.events):
            assert any(c.kind == REMOVED for c in changes)
    assert [c.kind for c in t.apply([Cleared()])] == [CLEARED] and t.resident == set()


def test_a_block_stored_twice_stays_resident_until_removed_twice():
    t = Translator(vd.MODEL, 16)
    tokens = list(range(100, 164))
    ev = Stored((11, 12), None, tuple(tokens), 32)
    first = t.apply([ev])
    assert [c.kind for c in first] == [STORED] and len(first[0].hashes) == 4
    assert t.apply([ev]) == []  # a second copy: nothing new
    assert t.apply([Removed((12,))]) == [] and len(t.resident) == 4
    gone = t.apply([Removed((12,)), Removed((12,))])  # the second copy, then one too many
    assert [c.kind for c in gone] == [REMOVED] and gone[0].hashes == first[0].hashes[2:]
    assert t.apply([Removed((99,))]) == []  # never stored


def test_children_chain_from_their_parents_kvgate_hash():
    t = Translator(vd.MODEL, 16)
    tokens = list(range(200, 296))
    t.apply([Stored((1,), None, tuple(tokens[:32]), 32)])
    t.apply([Stored((2, 3), 1, tuple(tokens[32:]), 32)])
    assert t.resident == set(vd.ours(tokens))


def test_lora_multimodal_and_other_groups_are_left_out_and_so_are_their_children():
    t = Translator(vd.MODEL, 16)
    tok = tuple(range(32))
    t.apply([Stored((1,), None, tok, 32, lora=True)])
    t.apply([Stored((2,), 1, tok, 32)])  # child of a LoRA block: its chain is unknown
    t.apply([Stored((3,), None, tok, 32, extra=((("img-hash", 0),),))])  # multimodal
    t.apply([Stored((4,), None, tok, 32, extra=((b"embeds-digest",),))])  # prompt embeddings
    t.apply([Stored((5,), None, tok, 32, full_attention=False)])  # a sliding-window group
    t.apply([Stored((6,), None, tok, 32, unknown=("field 9",))])
    t.apply([Stored((7,), None, tok, 24)])  # engine blocks the gateway's cannot tile
    assert t.resident == set() and t.stats.skipped_blocks == 7 and t.stats.orphan_blocks == 1
    assert t.stats.reasons["parent not seen"] == 1 and t.stats.reasons["lora"] == 1


def test_a_gateway_block_size_that_does_not_divide_the_engines_indexes_nothing():
    t = Translator(vd.MODEL, 64)
    for b in vd.decoded_replay():
        t.apply(b.events)
    assert t.resident == set() and t.stats.skipped_blocks > 0


def test_sglang_shaped_batches_decode_and_translate():
    tokens = list(range(300, 364))
    salted = msgpack.packb(
        [
            2.0,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [9],
                    "parent_block_hash": None,
                    "token_ids": tokens[:32],
                    "block_size": 32,
                    "lora_id": None,
                    "cache_salt": "t1",
                    "session_id": "s",
                }
            ],
        ],
        use_bin_type=True,
    )
    live = [b"kv", (0).to_bytes(8, "big"), vd.payload([vd.sglang_stored([1, 2], tokens)])]
    replay = [
        b"",
        (1).to_bytes(8, "big"),
        vd.payload([vd.sglang_removed([2]), vd.sglang_stored([5], tokens[:32], lora_id=3)]),
    ]
    b0, b1, b2 = decode_frames(live), decode_replay(replay), decode_payload(2, salted)
    assert decode_replay([b"", vd.END, b""]) is None
    assert b0.seq == 0 and b0.rank == 0 and b1.seq == 1 and b2.events[0].salt == "t1"
    t = Translator(vd.MODEL, 16)
    t.apply(b0.events)
    assert t.resident == set(vd.ours(tokens))
    t.apply(b1.events)
    assert t.resident == set(vd.ours(tokens[:32]))  # the removed block went; the LoRA one never came
    t.apply(b2.events)
    assert set(vd.ours(tokens[:32], salt="t1")) <= t.resident


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
        decoded = decode_event(raw)
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


def test_array_events_with_fields_past_the_known_ones_are_left_out():
    """A newer array-shaped BlockStored may carry fields (a cache salt, say) that change the
    block's hash: without knowing them the block cannot be named, so it is skipped."""
    tokens = list(range(32))
    known = ["BlockStored", [1], None, tokens, 32, None, "GPU", None, None]
    newer = known + ["salt?"]
    t = Translator(vd.MODEL, 16)
    t.apply([decode_payload(0, vd.payload([newer])).events[0]])
    assert t.resident == set() and t.stats.reasons == {"unknown fields field 9": 1}
    t.apply(decode_payload(1, vd.payload([known + [None]])).events)
    assert t.resident == set(vd.ours(tokens))


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


def test_offloaded_copies_are_their_own_tier_and_outlive_the_device_copy():
    """vLLM's offloading connector stores a device block's copy in CPU memory: the same engine
    hash, medium CPU. Evicting the device copy leaves the host one; a child offloaded later
    continues the chain of a parent seen in either tier."""
    t = Translator(vd.MODEL, 16)
    tokens = tuple(range(300, 396))
    gpu = t.apply([Stored((1, 2), None, tokens[:64], 32)])
    cpu = t.apply([Stored((1, 2), None, tokens[:64], 32, medium=HOST)])
    assert gpu == [Change(STORED, gpu[0].hashes, DEVICE)] and cpu == [Change(STORED, gpu[0].hashes, HOST)]
    gone = t.apply([Removed((1, 2))])
    assert gone == [Change(REMOVED, gpu[0].hashes, DEVICE)] and t.resident == set()
    child = t.apply([Stored((3,), 2, tokens[64:], 32, medium=HOST)])
    assert child[0].hashes == tuple(vd.ours(list(tokens))[4:]), "the parent's chain, from the host copy"
    assert t.tiers() == {HOST: sorted(vd.ours(list(tokens)))}
    assert t.apply([Removed((3,), medium=HOST)]) == [Change(REMOVED, child[0].hashes, HOST)]


def test_placeholders_and_unknown_media_are_left_out():
    """A placeholder (vLLM offloads a block it has no token ids for) decodes, and is skipped."""
    t = Translator(vd.MODEL, 16)
    placeholder = {**vd.stored([7], [], block_size=0), "medium": "CPU"}
    [ev] = decode_payload(0, vd.payload([placeholder])).events
    assert t.apply([ev]) == [] and t.stats.reasons == {"no token ids": 1}
    [ev] = decode_payload(0, vd.payload([vd.stored([8], list(range(32)), medium="TAPE")])).events
    assert t.apply([ev]) == [] and t.stats.reasons["medium tape"] == 1


def test_skip_reasons_stay_bounded_whatever_the_publisher_names():
    """A reason may hold a publisher's field or medium name: a new name per event must not grow
    the counts without end."""
    t = Translator(vd.MODEL, 16)
    for i in range(MAX_REASONS + 50):
        [ev] = decode_payload(i, vd.payload([vd.stored([i], list(range(32)), medium=f"tier{i}")])).events
        t.apply([ev])
    assert len(t.stats.reasons) == MAX_REASONS + 1 and t.stats.reasons["other"] == 50
    assert t.stats.skipped_blocks == MAX_REASONS + 50


def test_the_index_keeps_an_engines_host_tier():
    index, t = ResidencyIndex(), Translator(vd.MODEL, 16)
    sink = IndexSink(index, "vllm@x", lambda: False)
    sink.reset()
    tokens = tuple(range(64))
    sink.apply(t.apply([Stored((1,), None, tokens[:32], 32), Stored((1,), None, tokens[:32], 32, medium=HOST)]))
    sink.apply(t.apply([Removed((1,))]))
    assert index.num_blocks("vllm@x") == 0 and index.num_blocks("vllm@x", HOST) == 2


def test_an_engine_hash_stored_with_other_tokens_in_another_tier_releases_what_each_copy_held():
    """A publisher contradicting itself (one engine hash, two contents) once left the translator
    removing hashes a tier never held (KeyError): the content first seen stands for both copies."""
    t = Translator(vd.MODEL, 16)
    first = t.apply([Stored((1,), None, tuple(range(32)), 32)])
    t.apply([Stored((1,), None, tuple(range(100, 132)), 32, medium=HOST)])
    assert t.apply([Removed((1,))]) == [Change(REMOVED, first[0].hashes, DEVICE)]
    assert t.tiers() == {HOST: sorted(first[0].hashes)}
    assert t.apply([Removed((1,), medium=HOST)]) == [Change(REMOVED, first[0].hashes, HOST)]


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
    map msgpack.unpackb builds, counted as gateway.vllm_batch and vllm_events call them."""
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
        vllm_events, "msgpack", types.SimpleNamespace(**{**vars(msgpack), "Unpacker": Unpacker, "unpackb": unpackb})
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
