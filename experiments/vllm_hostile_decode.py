"""What a hostile vLLM KV-event payload costs the gateway's event loop to decode
(`gateway.vllm_batch.decode_payload`, the GC settled as a gateway's is): payloads under
MAX_PAYLOAD whose items sit where the decoder once built them all (two removals of 8 M hashes,
sixteen of 1 M, an envelope's ts or dp_rank of 16 M items, a map envelope's key), that build
costly objects (ext types, timestamps, empty arrays, map entries, short strings) or that cost
Python steps per event (65535 junk maps once the token budget is spent), beside two valid
batches. Prints each case's milliseconds (best of --repeats) and what the batch kept. Run it
from each checkout to compare:

    PYTHONPATH=. python experiments/vllm_hostile_decode.py [--repeats 3]
"""

import argparse
import gc
import time

import msgpack

from gateway.vllm_batch import MAX_PAYLOAD, BadBatch, decode_payload
from workers.startup_heap import settle_gc

ROOM = MAX_PAYLOAD - 4096  # the bytes a case's items may take


def pack(v: object) -> bytes:
    return msgpack.packb(v, use_bin_type=True)


def array(n: int, item: bytes) -> bytes:
    """An array of `n` items, each the msgpack bytes `item`."""
    return msgpack.Packer().pack_array_header(n) + item * n


def removal(hashes: bytes, *extra: tuple[bytes, bytes]) -> bytes:
    """A BlockRemoved map whose block_hashes are the msgpack bytes `hashes`, then `extra` entries."""
    head = msgpack.Packer().pack_map_header(3 + len(extra))
    body = pack("type") + pack("BlockRemoved") + pack("block_hashes") + hashes + pack("medium") + pack("GPU")
    return head + body + b"".join(k + v for k, v in extra)


def batch(events: list[bytes], ts: bytes = b"\xcb" + bytes(8), rank: bytes = b"\x00") -> bytes:
    """[ts, events, dp_rank], each given as msgpack bytes."""
    return msgpack.Packer().pack_array_header(3) + ts + _events(events) + rank


def _events(events: list[bytes]) -> bytes:
    return msgpack.Packer().pack_array_header(len(events)) + b"".join(events)


def note(items: bytes, size: int) -> bytes:
    """A removal of one hash with an unknown field 'note' of items `items` (each `size` bytes)."""
    return removal(array(1, b"\x01"), (pack("note"), array(ROOM // size, items)))


def stored(tokens: int) -> bytes:
    """A valid BlockStored of `tokens` token ids (3 bytes each) in blocks of 16."""
    ids = list(range(1000, 1000 + tokens))
    return pack(
        {
            "type": "BlockStored",
            "block_hashes": list(range(tokens // 16)),
            "parent_block_hash": None,
            "token_ids": ids,
            "block_size": 16,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
        }
    )


def cases() -> dict[str, bytes]:
    half, sixteenth = ROOM // 2 - 64, ROOM // 16 - 64
    return {
        "valid: a BlockStored of 2M token ids": batch([stored(1 << 21)]),
        "valid: 65536 removals of one hash": batch([removal(array(1, b"\x01"))] * 65536),
        "2M token ids, then 65535 maps of 24 entries": batch(
            [stored(1 << 21), *[msgpack.Packer().pack_map_header(24) + b"\x00\x00" * 24] * 65535]
        ),
        "2 removals of 8M hashes": batch([removal(array(half, b"\x01"))] * 2),
        "16 removals of 1M hashes": batch([removal(array(sixteenth, b"\x01"))] * 16),
        "ts an array of 16M items": batch([removal(array(1, b"\x01"))], ts=array(ROOM, b"\x01")),
        "ts [[16M items]]": batch([removal(array(1, b"\x01"))], ts=array(1, array(ROOM, b"\x01"))),
        "dp_rank an array of 16M items": batch([removal(array(1, b"\x01"))], rank=array(ROOM, b"\x01")),
        "map envelope key of 16M items": msgpack.Packer().pack_map_header(3)
        + array(ROOM, b"\x01")
        + b"\x00"
        + pack("ts")
        + pack(1.0)
        + pack("events")
        + _events([removal(array(1, b"\x01"))]),
        "removal, a note of 2.8M ext types": batch([note(b"\xd4\x05\x00", 3)]),
        "removal, a note of 2.8M timestamps": batch([note(b"\xd6\xff" + bytes(4), 6)]),
        "removal, a note of 16M empty arrays": batch([note(b"\x90", 1)]),
        "removal, a note of 16M empty maps": batch([note(b"\x80", 1)]),
        "removal, a note of 16M empty strings": batch([note(b"\xa0", 1)]),
        "removal, a note of 5M {nil: nil}": batch([note(b"\x81\xc0\xc0", 3)]),
        "removal, hashes 16M empty arrays": batch([removal(array(ROOM, b"\x90"))]),
    }


def run(payload: bytes, repeats: int) -> tuple[float, str]:
    """The best milliseconds of `repeats` decodes of `payload`, and what the batch kept."""
    best, kept = float("inf"), ""
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        try:
            b = decode_payload(0, payload)
            kept = f"{[type(e).__name__ for e in b.events][:4]} malformed {b.malformed}"
        except BadBatch as e:
            kept = f"BadBatch: {str(e)[:60]}"
        best = min(best, time.perf_counter() - t0)
    return best * 1e3, kept


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--case", action="append", help="only these cases (by name)")
    args = p.parse_args()
    settle_gc()
    for name, payload in cases().items():
        if args.case and name not in args.case:
            continue
        assert len(payload) <= MAX_PAYLOAD, (name, len(payload))
        ms, kept = run(payload, args.repeats)
        print(f"{name:40s} {len(payload) / 2**20:5.1f} MiB {ms:8.1f} ms  {kept}", flush=True)


if __name__ == "__main__":
    main()
