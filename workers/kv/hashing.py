"""The block hash of the design contract: one function, used by the gateway and every worker.

A prompt is cut into full blocks of B tokens; block i's hash chains the hash of block i-1 with
its own token ids, so equal hashes mean equal prefixes (up to 64-bit collisions, which the
worker's prefix cache guards against by also comparing token ids). A request's `cache_salt`
(per tenant) is folded into the chain's seed, so requests with different salts never share
a block: one tenant cannot learn from cache hits what another tenant's prompts were.
"""

from array import array
from hashlib import blake2b

MASK64 = (1 << 64) - 1
MAX_TOKEN_ID = (1 << 63) - 1  # a block's token ids are packed as int64: a larger one names no block


def seed_hash(model_id: str, block_size: int) -> int:
    """h_0: ties every chain to one model and block size, so pools never mix."""
    digest = blake2b(f"{model_id}\x00{block_size}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def salted_seed(seed: int, salt: str | None) -> int:
    """h_0 of a request with `cache_salt` `salt`: the model's seed hashed with the salt; no salt
    (None or "") keeps the seed, so unsalted requests share one cache."""
    if not salt:
        return seed
    h = blake2b(seed.to_bytes(8, "little"), digest_size=8, person=b"kvgate-salt")
    h.update(salt.encode("utf-8", "surrogatepass"))
    return int.from_bytes(h.digest(), "little")


def block_hash(parent: int, tokens: list[int] | tuple[int, ...]) -> int:
    """h_i = H(h_{i-1}, tokens of block i) as an unsigned 64-bit int."""
    return _chain(parent, array("q", tokens).tobytes())


def _chain(parent: int, packed: bytes) -> int:
    """H itself: blake2b-64 of the parent's 8 bytes and the block's ids packed as int64."""
    h = blake2b(parent.to_bytes(8, "little"), digest_size=8)
    h.update(packed)
    return int.from_bytes(h.digest(), "little")


def block_hashes(tokens: list[int], block_size: int, seed: int, start: int = 0, parent: int | None = None) -> list[int]:
    """Hashes of the full blocks of `tokens` from block index `start` on.

    `parent` is the hash of block start-1 (or the seed when start is 0); passing it lets a
    caller extend a chain without rehashing the prefix.
    """
    prev = seed if parent is None else parent
    out: list[int] = []
    end = len(tokens) // block_size
    if end <= start:
        return out
    step = 8 * block_size  # bytes of a block's ids, packed as `block_hash` packs them
    packed = array("q", tokens[start * block_size : end * block_size]).tobytes()
    for lo in range(0, len(packed), step):  # the ids packed once, not block by block: ~25% less time
        prev = _chain(prev, packed[lo : lo + step])
        out.append(prev)
    return out
