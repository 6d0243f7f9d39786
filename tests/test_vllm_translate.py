"""vLLM / SGLang KV events re-hashed into kvgate's chain (gateway/vllm_translate.py): recorded
and hand-made events' blocks get the gateway's hashes, evictions, copies and tiers are mirrored,
and what no kvgate hash can name is left out and counted (decoding: tests/test_vllm_events.py)."""

import msgpack
import pytest

from gateway.index import ResidencyIndex
from gateway.vllm_batch import decode_frames, decode_payload, decode_replay
from gateway.vllm_events import Cleared, Removed, Stored
from gateway.vllm_translate import MAX_REASONS, Change, Translator
from gateway.vllm_worker import IndexSink
from tests import vllm_data as vd
from workers.kv.events import CLEARED, DEVICE, HOST, REMOVED, STORED


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
