"""The KV transfer format for P/D: hashed blocks, layer-major, behind a checked header.

    b"KVG1" | u32 header length | header JSON | payload

The header names the model, block size, dtype and K/V shapes, and for every block its hash
and token ids; the payload is one tensor [layers, 2, blocks, block_size, kv_heads, head_dim]
in the sender's dtype, so a layer's K and V for all blocks are contiguous. The receiver
checks the header against its own config and re-derives every hash from the tokens before
anything touches its cache.
"""

import json
import struct
from dataclasses import dataclass

from workers.kv.events import MAX_HASH, checked_ints, checked_number, shown
from workers.kv.hashing import MAX_TOKEN_ID, block_hash, salted_seed
from workers.kv.host_pool import run_copies
from workers.sampling_params import InvalidRequest
from workers.strict_json import loads

MAGIC = b"KVG1"
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "none": 0}
MAX_HEADER_BYTES = 64 << 20  # a 128k-token prompt's header is about 1 MB


@dataclass(frozen=True)
class KVSpec:
    """What must match between sender and receiver for blocks to be interchangeable."""

    model: str
    block_size: int
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def block_bytes(self) -> int:
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]


@dataclass
class KVPayload:
    spec: KVSpec
    hashes: list[int]
    tokens: list[list[int]]
    parent: int | None
    data: bytes | memoryview


def encode_header(
    spec: KVSpec, hashes: list[int], tokens: list[list[int]], parent: int | None, cache_salt: str | None = None
) -> bytes:
    """`cache_salt` is the blocks' requests' salt: the receiver re-derives the chain from its seed."""
    header = json.dumps(
        {
            "spec": spec.__dict__,
            "hashes": [str(h) for h in hashes],
            "tokens": tokens,
            "parent": None if parent is None else str(parent),
            "cache_salt": cache_salt,
        }
    ).encode()
    return MAGIC + struct.pack("<I", len(header)) + header


def decode_header(body: bytes | bytearray, own: KVSpec, seed: int) -> tuple[KVPayload, int]:
    """Parse and validate a transfer's header and re-derive its hashes from its tokens; the
    payload (empty here) starts at the returned offset. Any mismatch is the sender's error, an
    InvalidRequest: the peer holds the token, but a bug or a bad actor there must not stop this
    worker's loop or reach its cache."""
    if len(body) < 8 or body[:4] != MAGIC:
        raise InvalidRequest("not a kvgate KV transfer (bad magic)", code="bad_kv_transfer")
    (n,) = struct.unpack("<I", body[4:8])
    if n > min(MAX_HEADER_BYTES, len(body) - 8):
        raise InvalidRequest(f"KV transfer header of {n} bytes in a body of {len(body)}", code="bad_kv_transfer")
    try:
        spec, hashes, tokens, parent, salt = header_fields(loads(bytes(body[8 : 8 + n]), "the KV transfer header"))
    except (ValueError, KeyError, TypeError) as e:  # InvalidRequest is a ValueError
        raise InvalidRequest(f"malformed KV transfer header: {e}", code="bad_kv_transfer") from None
    if spec != own:
        raise InvalidRequest(
            f"KV transfer does not match this worker: got {str(spec)[:500]}, expected {own}", code="kv_spec_mismatch"
        )
    if len(hashes) != len(tokens):
        raise InvalidRequest(
            f"KV transfer of {len(hashes)} blocks has {len(tokens)} token lists", code="bad_kv_transfer"
        )
    verify_chain(hashes, tokens, parent, salted_seed(seed, salt), spec.block_size)
    return KVPayload(spec, hashes, tokens, parent, b""), 8 + n


def header_fields(head: object) -> tuple[KVSpec, list[int], list[list[int]], int | None, str | None]:
    """(spec, hashes, tokens, parent, cache_salt) of a parsed header, each type- and range-checked
    (ValueError, KeyError or TypeError otherwise): hashes and parent 64-bit unsigned, as
    decimal strings, token ids from 0 to MAX_TOKEN_ID. Out of range, they overflowed the hashing."""
    if type(head) is not dict:
        raise TypeError(f"the header is a JSON object, not {shown(head)}")
    if type(head["spec"]) is not dict:
        raise TypeError(f"spec is a JSON object, not {shown(head['spec'])}")
    hashes, tokens, parent, salt = head["hashes"], head["tokens"], head["parent"], head.get("cache_salt")
    if type(hashes) is not list or type(tokens) is not list:
        raise TypeError(f"hashes and tokens are lists, not {shown(hashes)} and {shown(tokens)}")
    if salt is not None and type(salt) is not str:
        raise TypeError(f"cache_salt is a string, not {shown(salt)}")
    return (
        KVSpec(**head["spec"]),
        [_hash(h, "a block hash") for h in hashes],
        [_token_ids(t) for t in tokens],
        None if parent is None else _hash(parent, "the parent hash"),
        salt,
    )


def _hash(v: object, what: str) -> int:
    """A hash as `encode_header` writes it: the decimal string of a 64-bit unsigned integer."""
    if type(v) is not str or not (v.isascii() and v.isdigit()) or len(v) > 20:
        raise ValueError(f"{what} is a decimal string, not {shown(v)}")
    return checked_number(int(v), MAX_HASH, what)


def _token_ids(block: object) -> list[int]:
    """One block's token ids: a list of integers from 0 to MAX_TOKEN_ID (`checked_ints`)."""
    if type(block) is not list:
        raise TypeError(f"a block's tokens are a list of integers, not {shown(block)}")
    checked_ints(block, MAX_TOKEN_ID, "a block's token ids")
    return block


def decode(body: bytes | bytearray, own: KVSpec, seed: int, ipc: bool = False) -> KVPayload:
    """`decode_header`, then the payload: the blocks' bytes, or with `ipc` a CUDA IPC handle
    (workers/transfer_ipc.py)."""
    payload, start = decode_header(body, own, seed)
    data = memoryview(body)[start:]
    n = len(payload.hashes)
    if ipc:
        from workers.transfer_ipc import open_shared

        data = open_shared(bytes(data), (own.num_layers, 2, n))
    elif len(data) != n * own.block_bytes():
        raise InvalidRequest(
            f"KV transfer of {n} blocks has {len(data)} payload bytes ({own.block_bytes()} per block expected)",
            code="bad_kv_transfer",
        )
    payload.data = data
    return payload


def verify_chain(hashes: list[int], tokens: list[list[int]], parent: int | None, seed: int, block_size: int) -> None:
    """Every hash must be the chain hash of its tokens: no block enters the cache unproven."""
    prev = seed if parent is None else parent
    for i, (h, toks) in enumerate(zip(hashes, tokens)):
        if len(toks) != block_size:
            raise InvalidRequest(f"block {i} has {len(toks)} tokens, expected {block_size}", code="bad_kv_transfer")
        if block_hash(prev, toks) != h:
            raise InvalidRequest(f"block {i}: hash does not match its tokens", code="kv_hash_mismatch")
        prev = h


def executor_spec(model: str, block_size: int, executor) -> KVSpec:
    """The KVSpec of a worker: the sim executor carries no K/V data (dtype "none")."""
    dtype = str(getattr(executor, "dtype", "none")).removeprefix("torch.")
    return KVSpec(
        model,
        block_size,
        dtype,
        getattr(executor, "num_layers", 0),
        getattr(executor, "num_kv_heads", 0),
        getattr(executor, "head_dim", 0),
    )


@dataclass
class Reservation:
    """The blocks an import will publish, held (ref'd) until it does: `fresh` ones are newly
    allocated and wait for their K/V, which is block `positions[i]` of the payload."""

    blocks: list
    fresh: list
    positions: list[int]

    @property
    def fresh_ids(self) -> list[int]:
        return [b.block_id for b in self.fresh]


def reserve(pool, payload: KVPayload) -> Reservation:
    """Hold the transfer's blocks (engine thread): resident ones are touched, the others
    allocated. Stops at the first block the pool has no room for, since later blocks of a chain
    are useless without it. Nothing is published yet, so nothing reads the fresh blocks."""
    blocks, fresh, positions = [], [], []
    for i, (h, toks) in enumerate(zip(payload.hashes, payload.tokens)):
        block = pool.lookup(h, tuple(toks))
        if block is None:
            if not pool.can_allocate(1):
                break
            block = pool.allocate(1)[0]
            fresh.append(block)
            positions.append(i)
        else:
            pool.touch(block)
        blocks.append(block)
    return Reservation(blocks, fresh, positions)


def publish(pool, payload: KVPayload, res: Reservation) -> tuple[int, int]:
    """Register the reserved blocks, their K/V now written, as cached and let them go (engine
    thread); returns (imported, present)."""
    n = len(res.blocks)
    pool.register(res.blocks, payload.hashes[:n], [tuple(t) for t in payload.tokens[:n]], payload.parent)
    pool.free(res.blocks)
    return len(res.fresh), n - len(res.fresh)


def import_payload(pool, executor, payload: KVPayload) -> tuple[int, int]:
    """`reserve`, write, `publish` in one go, all on the calling (engine) thread. The HTTP
    receiver runs the write on another thread instead (workers/transfer_http.py)."""
    res = reserve(pool, payload)
    run_copies(pool.take_copies(), executor)  # blocks the reservation evicted leave before the write
    if res.fresh:
        executor.import_blocks(res.fresh_ids, payload.data, res.positions, len(payload.hashes))
    return publish(pool, payload, res)
