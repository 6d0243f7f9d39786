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

from workers.kv.hashing import block_hash, salted_seed
from workers.kv.host_pool import run_copies
from workers.sampling_params import InvalidRequest

MAGIC = b"KVG1"
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "none": 0}


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


def decode_header(body: bytes, own: KVSpec, seed: int) -> tuple[KVPayload, int]:
    """Parse and validate a transfer's header and re-derive its hashes from its tokens; the
    payload (empty here) starts at the returned offset. Any mismatch is the sender's error."""
    if len(body) < 8 or body[:4] != MAGIC:
        raise InvalidRequest("not a kvgate KV transfer (bad magic)", code="bad_kv_transfer")
    (n,) = struct.unpack("<I", body[4:8])
    try:
        head = json.loads(body[8 : 8 + n])
        spec = KVSpec(**head["spec"])
        hashes = [int(h) for h in head["hashes"]]
        tokens = [list(map(int, t)) for t in head["tokens"]]
        parent = None if head["parent"] is None else int(head["parent"])
        salt = head.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise TypeError("cache_salt must be a string")
    except (ValueError, KeyError, TypeError) as e:
        raise InvalidRequest(f"malformed KV transfer header: {e}", code="bad_kv_transfer") from e
    if spec != own:
        raise InvalidRequest(
            f"KV transfer does not match this worker: got {spec}, expected {own}", code="kv_spec_mismatch"
        )
    if len(hashes) != len(tokens):
        raise InvalidRequest(
            f"KV transfer of {len(hashes)} blocks has {len(tokens)} token lists", code="bad_kv_transfer"
        )
    verify_chain(hashes, tokens, parent, salted_seed(seed, salt), spec.block_size)
    return KVPayload(spec, hashes, tokens, parent, b""), 8 + n


def decode(body: bytes, own: KVSpec, seed: int, ipc: bool = False) -> KVPayload:
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
