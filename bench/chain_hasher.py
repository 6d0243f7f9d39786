"""`block_hashes` memoised for a simulation's many requests that share long prefixes."""

from array import array

from workers.kv.hashing import block_hash


class ChainHasher:
    """`block_hashes` with memos: requests share long prefixes, and a dict lookup is far
    cheaper than a blake2b. A prompt is looked up in runs of `span` blocks, keyed by (parent,
    the run's tokens): one lookup per run, not per block. A run not seen whole before falls
    back to a memo of (parent, block tokens) -> hash, and is remembered whole only when its
    first block was there already (content seen twice is shared; unique questions would only
    fill the memo). Same values as `block_hashes`."""

    def __init__(self, block_size: int, seed: int, span: int = 32, limit: int = 1 << 19):
        self.block_size = block_size
        self.seed = seed
        self.span = span
        self.limit = limit
        self.runs: dict[tuple, list[int]] = {}
        self.memo: dict[tuple, int] = {}

    def hashes(self, tokens: list[int]) -> list[int]:
        B, span, runs = self.block_size, self.span, self.runs
        if len(self.memo) + len(runs) * span > self.limit:
            self.memo.clear()
            runs.clear()
        n = len(tokens) // B
        out, h = [], self.seed
        for i in range(0, n, span):
            end = min(i + span, n)
            key = (h, tuple(tokens[i * B : end * B]))
            run = runs.get(key)
            if run is None:
                run, seen = self._blocks(h, tokens, i, end)
                if seen:
                    runs[key] = run
            out += run
            h = run[-1]
        return out

    def _blocks(self, h: int, tokens: list[int], start: int, end: int) -> tuple[list[int], bool]:
        """Hashes of blocks start..end-1 after parent `h`, and whether the first was memoised."""
        B, memo = self.block_size, self.memo
        raw, width = array("q", tokens[start * B : end * B]).tobytes(), 8 * B
        out, seen = [], False
        for k in range(end - start):
            key = (h, raw[k * width : (k + 1) * width])
            nh = memo.get(key)
            if nh is None:
                nh = memo[key] = block_hash(h, tokens[(start + k) * B : (start + k + 1) * B])
            elif k == 0:
                seen = True
            out.append(nh)
            h = nh
        return out, seen
