"""vLLM / SGLang KV event batches off the wire (gateway/vllm_batch.py): framing of a message, the
live and replayed batch, its envelope and the caps on what one batch may cost."""

import msgpack
import pytest

from gateway import vllm_batch
from gateway.vllm_batch import MAX_BATCH_REASONS, MAX_ENVELOPE, BadBatch, decode_frames, decode_payload
from gateway.vllm_events import MAX_MAP_FIELDS, Removed, Stored, decode_event
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

    def spy(raw: memoryview):
        seen.append(bytes(raw))
        return decode_event(raw)

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
