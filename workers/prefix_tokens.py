"""Tokenizing a prompt once per distinct prefix: the gateway's tokenizer with a prefix cache.

Prompts that share a long prefix (a system prompt, a document, a conversation so far) made the
gateway tokenize the same text again for every request: a 2k-token prompt costs ~10-20 ms of
CPU, most of the gateway's time per request. The cache keeps a prompt's token ids chunk by
chunk, keyed by the chunk's text and the chunk before it, so a new prompt tokenizes only what
follows its longest cached prefix.

A chunk ends at a cut: the first space after `chunk_chars` characters that follows a non-space.
Word-splitting (byte-level BPE) pre-tokenizers start a pre-token at every such space, so the
tokens before a cut never depend on the text after it (the same rule as
`workers.prompt_length.surely_too_long`). Whether a tokenizer really splits there is checked once at
load, on texts made to stress it (spaces, newlines, digits, punctuation, accents, special
tokens); a tokenizer that fails (SentencePiece's prepended "▁", say) gets no cache, and every
chunk stored is checked to start a token. So the ids are exactly the tokenizer's.
"""

import random
import re
import threading
from bisect import bisect_left
from collections import OrderedDict
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

from workers.word_tokens import definition, word_tokenizer

_CUT = re.compile(r"\S( )")
_start = itemgetter(0)  # a token's first character, of its (start, end) offsets
SELF_TEST_TEXTS = 48
MAX_CHUNK_SPAN = 4  # a cached chunk's text is at most this many times `chunk_chars`


@dataclass(frozen=True)
class Chunk:
    """One cached chunk: its id (the next chunk's parent) and its tokens."""

    id: int
    ids: tuple[int, ...]


class Wrapper:
    """A tokenizer wrapper: every public attribute it does not define is the wrapped one's
    (`_tok`: chat template, decode, vocabulary), so it stands in for the tokenizer."""

    _tok: Any

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._tok, name)


class PrefixTokenizer(Wrapper):
    """`encode(text, add_special_tokens)` as the wrapped tokenizer's, through the prefix cache;
    every other attribute is the tokenizer's own (chat template, decode, vocabulary). `words`:
    whether to read text word by word too (`workers.word_tokens`: ~0.3 s of CPU at start to
    seed its cache with the vocabulary)."""

    def __init__(self, tokenizer, chunk_chars: int = 512, max_chunks: int = 16384, words: bool = True):
        self._tok = tokenizer
        self.chunk_chars = chunk_chars
        self.max_chunks = max_chunks
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._chunks: OrderedDict[tuple[int, bool, str], Chunk] = OrderedDict()
        self._next_id = 1
        self._lock = threading.Lock()
        self.hits = self.misses = 0  # characters served from the cache / tokenized
        spec = definition(self._backend)
        self.words = word_tokenizer(tokenizer, spec) if words and spec is not None else None
        self.enabled = spec is not None and splits_words(spec) and self_test(self)

    def encode(self, text: str, add_special_tokens: bool = True, budget: "Budgeted | None" = None) -> list[int]:
        """The token ids of `text`, equal to the tokenizer's `encode`; `budget`: charged the
        characters past the cached prefix before they are tokenized (OverBudget beyond it)."""
        if not self.enabled or self._backend is None or len(text) < 2 * self.chunk_chars:
            if budget is not None:
                budget.spend(len(text))
            ids = self.words.encode(text, add_special_tokens) if self.words is not None else None
            return ids if ids is not None else self._tok.encode(text, add_special_tokens=add_special_tokens)
        cuts = self.cuts(text)
        ids, used, parent = self._cached(text, cuts, add_special_tokens)
        start = cuts[used - 1] if used else 0
        if budget is not None:
            budget.spend(len(text) - start)
        rest_ids, before = self._rest(text[start:], [c - start for c in cuts[used:]], add_special_tokens and start == 0)
        self._store(text, cuts[used:], start, parent, add_special_tokens, rest_ids, before)
        self.hits += start
        self.misses += len(text) - start
        return ids + rest_ids

    def _rest(self, text: str, cuts: list[int], special: bool) -> tuple[list[int], list[int]]:
        """(ids of the uncached rest `text`, how many precede each of its `cuts`, up to the first
        that falls inside a token): word by word where it can, else the tokenizer's offsets."""
        found = self.words.encode_cut(text, cuts, special) if self.words is not None else None
        if found is not None:
            return found
        rest = self._backend.encode(text, add_special_tokens=special)  # type: ignore[union-attr]  # enabled
        return rest.ids, tokens_before(rest.offsets, cuts)

    def cuts(self, text: str) -> list[int]:
        """The chunk ends of `text` (each a space after a non-space, at least `chunk_chars`
        after the previous), short of the text's end, and none past a chunk that would be more
        than `MAX_CHUNK_SPAN` times `chunk_chars` long: chunks are kept by their text, and a
        client's long runs without a space would fill the cache with its bytes."""
        out, pos, start = [], self.chunk_chars, 0
        while pos < len(text) - 1 and (m := _CUT.search(text, pos - 1)):
            if m.start(1) - start > MAX_CHUNK_SPAN * self.chunk_chars:
                break
            start = m.start(1)
            out.append(start)
            pos = start + self.chunk_chars
        return out

    def _cached(self, text: str, cuts: list[int], special: bool) -> tuple[list[int], int, int]:
        """(token ids, how many of `cuts` they cover, last chunk id) of the longest cached prefix."""
        ids: list[int] = []
        start, parent, used = 0, 0, 0
        with self._lock:
            for end in cuts:
                key = (parent, special, text[start:end])
                chunk = self._chunks.get(key)
                if chunk is None:
                    break
                self._chunks.move_to_end(key)
                ids.extend(chunk.ids)
                start, parent, used = end, chunk.id, used + 1
        return ids, used, parent

    def _store(
        self, text: str, cuts: list[int], start: int, parent: int, special: bool, ids: list[int], before: list[int]
    ) -> None:
        """Cache the chunks of text[start:] ending at `cuts` whose tokens are `ids`, `before[k]`
        of them preceding cut k (cuts past `before`'s end split a token: kept nowhere)."""
        i, chunk_start = 0, start
        new = []
        for end, j in zip(cuts, before):
            new.append((chunk_start, end, tuple(ids[i:j])))
            i, chunk_start = j, end
        with self._lock:
            for lo, hi, chunk_ids in new:
                key = (parent, special, text[lo:hi])
                chunk = self._chunks.get(key)
                if chunk is None:
                    chunk = self._chunks[key] = Chunk(self._next_id, chunk_ids)
                    self._next_id += 1
                parent = chunk.id
            while len(self._chunks) > self.max_chunks:
                self._chunks.popitem(last=False)


class OverBudget(Exception):
    """More text is left to tokenize past the cached prefixes than the caller would do where it is."""


class Budgeted(Wrapper):
    """A PrefixTokenizer that tokenizes at most `left` characters past its prompts' cached
    prefixes, over its calls, and raises OverBudget (having tokenized nothing more) beyond: so
    a caller can tokenize on the spot what its cache mostly holds, and elsewhere what it does
    not. Every other attribute is the PrefixTokenizer's (one object per PrefixTokenizer: the
    prompt checks cache what they read of a tokenizer by its identity)."""

    def __init__(self, tokenizer: PrefixTokenizer):
        self._tok: PrefixTokenizer = tokenizer
        self.left = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens, budget=self)

    def spend(self, chars: int) -> None:
        self.left -= chars
        if self.left < 0:
            raise OverBudget(f"{-self.left} characters over the budget")


def tokens_before(offsets: list[tuple[int, int]], cuts: list[int]) -> list[int]:
    """How many tokens (with character `offsets`) precede each of `cuts`, up to the
    first cut that falls inside a token or before the first. A cut's token is found by
    bisection on the tokens' start offsets (non-decreasing): a Python step per token was most
    of the cost of a prompt no other prompt shares."""
    out, i = [], 0
    for cut in cuts:
        j = bisect_left(offsets, cut, lo=i, key=_start)
        if j == i or j >= len(offsets) or offsets[j - 1][1] > cut:
            break
        out.append(j)
        i = j
    return out


WORD_SPLITTERS = {"ByteLevel", "Metaspace", "Whitespace", "WhitespaceSplit", "Split", "BertPreTokenizer"}


def splits_words(spec: dict) -> bool:
    """Whether the tokenizer (its `definition`) pre-tokenizes into words (so no token can span
    a space after a word): without that, BPE merges may cross a cut in one text and not in
    another, which no test on sample texts rules out."""
    pre = spec.get("pre_tokenizer")
    parts = pre.get("pretokenizers", []) if pre and pre.get("type") == "Sequence" else [pre]
    return any(
        p and p.get("type") in WORD_SPLITTERS and (p["type"] != "ByteLevel" or p.get("use_regex", True)) for p in parts
    )


def self_test(cached: PrefixTokenizer, seed: int = 0) -> bool:
    """Whether the cache's ids equal the tokenizer's on texts built to break the cut rule:
    each text twice (the second from the cache), and again after a changed tail."""
    rng = random.Random(seed)
    specials = [t for t in getattr(cached._tok, "all_special_tokens", []) if t][:4]
    pieces = [
        "the",
        "Über",
        "naïve",
        "x",
        "12345",
        "3.14",
        "!!",
        "?",
        "—",
        "  ",
        "\n",
        "\n\n",
        "\t",
        "'s",
        "日本語",
        "🙂",
    ]
    pieces += specials
    step, cached.chunk_chars = cached.chunk_chars, 24  # many cuts in short texts
    try:
        for _ in range(SELF_TEST_TEXTS):
            words = [rng.choice(pieces) + (" " if rng.random() < 0.7 else "") for _ in range(rng.randint(20, 120))]
            text = "".join(words)
            tail = text + " and" + "".join(rng.choice(pieces) for _ in range(5))
            for special in (True, False):
                want = [cached._tok.encode(t, add_special_tokens=special) for t in (text, text, tail)]
                cached.enabled = True
                got = [cached.encode(t, special) for t in (text, text, tail)]
                if got != want:
                    return False
        return True
    finally:
        cached.chunk_chars = step
        cached._chunks.clear()
        cached.hits = cached.misses = 0
        cached.enabled = False
