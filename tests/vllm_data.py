"""Recorded vLLM 0.32 KV event bytes (tests/data/README.md) and SGLang-shaped batches built to
its wire format, for the unit tests of the vLLM worker kind."""

from functools import lru_cache
from pathlib import Path

import msgpack

from gateway.vllm_batch import decode_replay
from workers.kv.hashing import block_hashes, salted_seed, seed_hash

DATA = Path(__file__).parent / "data"
MODEL = "smollm2-135m"
END = b"\xff" * 8


@lru_cache(maxsize=1)
def recorded() -> dict:
    return msgpack.unpackb((DATA / "vllm-0.32-events.msgpack").read_bytes(), raw=False)


def replay_frames() -> list[list[bytes]]:
    """The DEALER's replay from seq 0: one message per batch, then the end marker."""
    return recorded()["replay"]


def prompt_ids(name: str) -> list[int]:
    """The token ids the gateway gives a recorded prompt (A and C are completions, chat a chat)."""
    from workers.model_store import load_tokenizer
    from workers.protocol import parse_request

    prompt = recorded()["prompts"][name]
    kind, body = ("chat", {"messages": prompt}) if name == "chat" else ("completion", {"prompt": prompt})
    return parse_request(body, kind, load_tokenizer(MODEL), 1024).prompt_ids


def ours(ids: list[int], block_size: int = 16, salt: str | None = None, engine_block: int = 32) -> list[int]:
    """kvgate's hashes of the blocks of `ids` that lie in full engine blocks."""
    full = len(ids) // engine_block * engine_block
    return block_hashes(ids[:full], block_size, salted_seed(seed_hash(MODEL, block_size), salt))


def payload(events: list, ts: float = 1.0, rank: int | None = None) -> bytes:
    body = [ts, events] if rank is None else [ts, events, rank]
    return msgpack.packb(body, use_bin_type=True)


def stored(hashes: list[int], tokens: list[int], parent: int | None = None, block_size: int = 32, **extra) -> dict:
    """A vLLM 0.32 BlockStored as a tagged map."""
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": block_size,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        **extra,
    }


def removed(hashes: list[int]) -> dict:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}


def sglang_stored(
    hashes: list[int], tokens: list[int], parent: int | None = None, block_size: int = 32, lora_id: int | None = None
) -> list:
    """SGLang's BlockStored: an array-like struct, the tag first."""
    return ["BlockStored", hashes, parent, tokens, block_size, lora_id]


def sglang_removed(hashes: list[int]) -> list:
    return ["BlockRemoved", hashes]


def decoded_replay() -> list:
    """The recorded replay's batches, decoded (its end marker checked and dropped)."""
    batches = [decode_replay(f) for f in replay_frames()]
    assert batches[-1] is None
    return batches[:-1]
