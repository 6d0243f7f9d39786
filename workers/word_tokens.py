"""Text -> token ids one pre-token at a time, each pre-token's ids read from a cache.

A byte-level BPE tokenizer whose pre-tokenizer splits text with a regex (GPT-2's inside
`ByteLevel`, or a `Split` before a regex-free `ByteLevel` as Llama 3's and Qwen 2's) encodes
every pre-token on its own, so a text's ids are those of its added tokens and pre-tokens in
order, inside the post-processor's special tokens. The tokenizer spends ~1 ms of CPU on a
256-word prompt (~4 us a word: its regex engine, the merges, offsets and the encoding's
objects); splitting in Python and reading each word's ids from a dict costs ~0.1 ms.

Exact by construction and by test: only ASCII stretches are split here (the two regex engines'
Unicode tables may differ in version elsewhere; ASCII's classes are fixed); the few words around
other characters go to the tokenizer whole, cut where pre-tokens always part (a space after a
non-space, as `workers.prefix_tokens` cuts). Only tokenizers of a shape read here (a BPE model
without dropout; no normalizer but a Unicode normal form, which leaves ASCII as it is; added
tokens without strip or word flags or spaces), and only when a self-test at load, on texts
built to break it, gives the tokenizer's own `encode` ids. Otherwise None.
"""

import json
import random
import re
import string
from bisect import bisect_left
from dataclasses import dataclass
from itertools import accumulate, chain
from typing import cast

import regex

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
NORMAL_FORMS = {"NFC", "NFD", "NFKC", "NFKD"}
MAX_WORDS = 1 << 17  # entries; cleared back to the vocabulary's words when full
MAX_WORD_CHARS = 64  # longer pre-tokens are tokenized but not kept: a client's own words bound the cache's bytes
SELF_TEST_TEXTS = 64


@dataclass(frozen=True)
class Shape:
    """What the tokenizer does to ASCII text, as read from its definition."""

    pattern: str  # the pre-tokenizer's split regex
    added: list[dict[str, int]]  # added tokens' text -> id: non-normalized ones, then normalized


def byte_chars() -> dict[int, str]:
    """GPT-2's byte -> character map, the alphabet byte-level BPE vocabularies are written in."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out = {b: chr(b) for b in keep}
    for n, b in enumerate(b for b in range(256) if b not in out):
        out[b] = chr(256 + n)
    return out


def definition(backend) -> dict | None:
    """A fast tokenizer's definition (its tokenizer.json), or None (~0.1 s: parse it once)."""
    try:
        return json.loads(backend.to_str())
    except (AttributeError, ValueError):
        return None


def read_shape(spec: dict, backend) -> Shape | None:
    """The split regex and added tokens of a byte-level BPE tokenizer (its `definition`) whose
    every step this module reproduces on ASCII text, or None: anything else might encode
    differently."""
    model, norm = spec.get("model") or {}, spec.get("normalizer")
    if model.get("type") != "BPE" or model.get("dropout") or getattr(backend, "encode_special_tokens", False):
        return None
    norms = norm.get("normalizers", []) if norm and norm.get("type") == "Sequence" else [norm] if norm else []
    if any(n.get("type") not in NORMAL_FORMS for n in norms):
        return None
    pattern = _pattern(spec.get("pre_tokenizer"))
    added = _added(spec.get("added_tokens") or [])
    return None if pattern is None or added is None else Shape(pattern, added)


def _pattern(pre: dict | None) -> str | None:
    """GPT-2's regex for `ByteLevel(use_regex)`, a `Split`'s own before a regex-free `ByteLevel`."""
    if not pre or pre.get("add_prefix_space"):
        return None
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return GPT2_PATTERN
    parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
    if len(parts) != 2:
        return None
    split, byte_level = parts
    if byte_level.get("type") != "ByteLevel" or byte_level.get("use_regex", True) or byte_level.get("add_prefix_space"):
        return None
    if split.get("type") != "Split" or split.get("behavior") != "Isolated" or split.get("invert"):
        return None
    return split.get("pattern", {}).get("Regex")


def _added(tokens: list[dict]) -> list[dict[str, int]] | None:
    """Added tokens' text -> id, non-normalized then normalized (the order the tokenizer splits
    them out in); None if one strips spaces, matches only whole words or holds a space (an
    island's cut might fall inside it)."""
    if any(t.get("lstrip") or t.get("rstrip") or t.get("single_word") or " " in t["content"] for t in tokens):
        return None
    return [{t["content"]: t["id"] for t in tokens if bool(t.get("normalized")) is normed} for normed in (False, True)]


ASCII_CLASSES = {r"\p{L}": "A-Za-z", r"\p{N}": "0-9"}


def ascii_regex(pattern: str) -> re.Pattern | regex.Pattern:
    """The split regex for ASCII text only, in the standard `re` (2x faster than `regex` here):
    letters and numbers as their ASCII ranges, `\\s` and the rest with re.ASCII. A pattern with
    other Unicode classes or nested sets stays with `regex`."""
    out, i, in_set = [], 0, False
    while i < len(pattern):
        name = next((k for k in ASCII_CLASSES if pattern.startswith(k, i)), None)
        c = pattern[i]
        if name is not None:
            out.append(ASCII_CLASSES[name] if in_set else f"[{ASCII_CLASSES[name]}]")
            i += len(name)
            continue
        if c == "\\" and pattern[i + 1 : i + 2] in ("p", "P") or c == "[" and in_set:
            return regex.compile(pattern)
        step = 2 if c == "\\" else 1
        in_set = (in_set or c == "[") and not (in_set and c == "]")
        out.append(pattern[i : i + step])
        i += step
    try:
        return re.compile("".join(out), re.ASCII)
    except re.error:
        return regex.compile(pattern)


_NON_ASCII = re.compile(r"[^\x00-\x7f]")
_CUT = re.compile(r"\S( )")  # a space after a non-space starts a pre-token (workers.prefix_tokens)


def islands(text: str) -> list[tuple[int, int]]:
    """The stretches of `text` around its non-ASCII characters, each from the cut before one to
    the cut after (a cut: a space that follows a non-space, or either end of the text). Pre-tokens
    never cross a cut, so an island encodes alone as it does in place."""
    out, start = [], 0
    while m := _NON_ASCII.search(text, start):
        lo = text.rfind(" ", start, m.start())
        while lo > start and text[lo - 1].isspace():
            lo = text.rfind(" ", start, lo)
        cut = _CUT.search(text, m.start())
        hi = cut.start(1) if cut else len(text)
        out.append((max(lo, start), hi))
        start = hi
    return out


def _alternation(contents: dict[str, int]) -> regex.Pattern | None:
    """A regex matching these strings leftmost-longest, as the tokenizer's Aho-Corasick does."""
    if not contents:
        return None
    return regex.compile("|".join(regex.escape(c) for c in sorted(contents, key=len, reverse=True)))


class WordTokenizer:
    """`encode(text, add_special_tokens)` from cached pre-token ids; None for text it does not
    take. Build one with `word_tokenizer`, which tests it first."""

    def __init__(self, tokenizer, shape: Shape, max_words: int = MAX_WORDS):
        backend = tokenizer.backend_tokenizer
        self._tokenize = backend.model.tokenize
        self._encode = backend.encode
        self._split = ascii_regex(shape.pattern).findall
        self._added = [p for p in map(_alternation, shape.added) if p is not None]
        self._any_added = _alternation({c: i for added in shape.added for c, i in added.items()})
        self._bytes = str.maketrans({chr(b): c for b, c in byte_chars().items() if b < 128})
        self._prefix, self._suffix = _special_ends(tokenizer)
        self.max_words = max_words
        self._seed = self._vocabulary_words(backend, shape)
        self._words = dict(self._seed)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int] | None:
        """The token ids of `text` (as the tokenizer's `encode`), or None."""
        found = self._pieces(text)
        if found is None:
            return None
        return self._wrap(list(chain.from_iterable(found[1])), add_special_tokens)

    def encode_cut(self, text: str, cuts: list[int], add_special_tokens: bool) -> tuple[list[int], list[int]] | None:
        """(ids of `text`, how many of them precede each of `cuts`), the cuts cut short at the
        first that falls inside a piece; None where `encode` is None."""
        found = self._pieces(text)
        if found is None:
            return None
        pieces, ids_of = found
        ends = list(accumulate(map(len, pieces)))
        counts = list(accumulate(map(len, ids_of), initial=len(self._prefix) if add_special_tokens else 0))
        before = []
        for cut in cuts:
            i = bisect_left(ends, cut)
            if i >= len(ends) or ends[i] != cut:
                break
            before.append(counts[i + 1])
        return self._wrap(list(chain.from_iterable(ids_of)), add_special_tokens), before

    def _wrap(self, ids: list[int], add_special_tokens: bool) -> list[int]:
        """`ids` inside the post-processor's special tokens, when asked for."""
        return [*self._prefix, *ids, *self._suffix] if add_special_tokens else ids

    def _pieces(self, text: str) -> tuple[list[str], list[tuple[int, ...]]] | None:
        """(pieces of `text`, each one's ids): its ASCII stretches' pre-tokens and added tokens
        from the cache, each stretch holding other characters encoded whole by the tokenizer
        (`islands`); None if the split regex skips characters (a shape this does not reproduce)."""
        if not text:
            return None
        if text.isascii():
            return self._ascii(text)
        pieces: list[str] = []
        ids_of: list[tuple[int, ...]] = []
        start = 0
        for lo, hi in islands(text):
            found = self._ascii(text[start:lo]) if lo > start else ([], [])
            if found is None:
                return None
            pieces += found[0] + [text[lo:hi]]
            ids_of += found[1] + [tuple(self._encode(text[lo:hi], add_special_tokens=False).ids)]
            start = hi
        tail = self._ascii(text[start:]) if start < len(text) else ([], [])
        return None if tail is None else (pieces + tail[0], ids_of + tail[1])

    def _ascii(self, text: str) -> tuple[list[str], list[tuple[int, ...]]] | None:
        """`_pieces` of ASCII text: its pre-tokens and added tokens, ids from the cache."""
        any_added = self._any_added is not None and self._any_added.search(text)
        pieces = self._split_added(text, 0) if any_added else self._split(text)
        if sum(map(len, pieces)) != len(text):
            return None
        cached = list(map(self._words.get, pieces))
        return pieces, self._fill(pieces, cached) if None in cached else cast(list[tuple[int, ...]], cached)

    def _split_added(self, text: str, level: int) -> list[str]:
        """`text` split into added tokens (by `self._added[level:]`, in turn) and pre-tokens."""
        if level == len(self._added) or not (found := self._added[level].search(text)):
            return self._split(text) if level == len(self._added) else self._split_added(text, level + 1)
        out, start = [], 0
        for m in chain((found,), self._added[level].finditer(text, found.end())):
            if m.start() > start:
                out += self._split_added(text[start : m.start()], level + 1)
            out.append(m.group())
            start = m.end()
        if start < len(text):
            out += self._split_added(text[start:], level + 1)
        return out

    def _fill(self, pieces: list[str], cached: list[tuple[int, ...] | None]) -> list[tuple[int, ...]]:
        """Each piece's ids: `cached`'s, else tokenized now and cached (back to the seed when full)."""
        if len(self._words) >= self.max_words:
            self._words = dict(self._seed)
        return [ids if ids is not None else self._tokenize_new(piece) for piece, ids in zip(pieces, cached)]

    def _tokenize_new(self, piece: str) -> tuple[int, ...]:
        """The BPE model's ids of one pre-token (in the byte alphabet), cached unless longer than
        `MAX_WORD_CHARS`: a hostile client's megabyte-long words would otherwise fill the cache's
        entries with its bytes (~25 MB at the bound for words of up to 64 characters)."""
        ids = tuple(t.id for t in self._tokenize(piece.translate(self._bytes)))
        if len(piece) <= MAX_WORD_CHARS:
            self._words[piece] = ids
        return ids

    def _vocabulary_words(self, backend, shape: Shape) -> dict[str, tuple[int, ...]]:
        """The cache's seed: the added tokens, and every ASCII vocabulary entry that is one
        pre-token, with its ids (most words of English text are such entries)."""
        text_of = {o: "\x80" for o in range(128)}  # an ASCII character outside the byte alphabet: not a word
        text_of.update((ord(c), chr(b)) for b, c in byte_chars().items() if b < 128)
        seed = {}
        for entry in backend.get_vocab(with_added_tokens=False):
            word = entry.translate(text_of)
            if word.isascii() and self._split(word) == [word]:
                seed[word] = tuple(t.id for t in self._tokenize(entry))
        seed.update((content, (i,)) for added in shape.added for content, i in added.items())
        return seed


def _special_ends(tokenizer) -> tuple[list[int], list[int]]:
    """The ids `encode(..., add_special_tokens=True)` puts before and after a text's own."""
    plain = tokenizer.encode("a", add_special_tokens=False)
    full = tokenizer.encode("a", add_special_tokens=True)
    for i in range(len(full) - len(plain) + 1):
        if full[i : i + len(plain)] == plain:
            return full[:i], full[i + len(plain) :]
    return full, []  # no text ids in the middle: the self-test fails it


def word_tokenizer(tokenizer, spec: dict | None = None) -> WordTokenizer | None:
    """A tested WordTokenizer for `tokenizer` (`spec`: its `definition`, if parsed already), or
    None if its shape is not one read here or the self-test finds an id that differs."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    spec = spec if spec is not None else definition(backend)
    shape = read_shape(spec, backend) if spec is not None else None
    if shape is None:
        return None
    words = WordTokenizer(tokenizer, shape)
    return words if self_test(words, tokenizer) else None


def self_test(words: WordTokenizer, tokenizer, seed: int = 0) -> bool:
    """Whether `words` gives the tokenizer's ids on texts built to break it (every ASCII
    character, runs of spaces and newlines, digits, contractions, the added tokens, non-ASCII
    letters, marks, spaces and symbols among them), each text twice (the second from the
    cache) with and without special tokens."""
    rng = random.Random(seed)
    specials = [t for t in getattr(tokenizer, "all_special_tokens", []) if t and t.isascii()][:6]
    pieces = ["the", "The", "x", "12345", "3.14", "1,000", "!!", "?", "'s", "'S", "'ll", "don't", " ", "  ", "   "]
    pieces += ["\n", "\n\n", "\r\n", "\t", " \n ", "\x0b", "\x0c", "\x1c", "\x1f", "\x00", "\x7f", "a_b", "__init__"]
    pieces += ["naïve", "🙂", "字 ", "e\u0301 ", "\xa0", "\u3000", "\u2028", "\x85", " \u200b", "Ⅻ", "ﬁ"]
    pieces += [*specials, *(c for c in map(chr, range(128)))]
    texts = [
        "".join(rng.choice(pieces) + (" " if rng.random() < 0.5 else "") for _ in range(rng.randint(1, 80)))
        for _ in range(SELF_TEST_TEXTS)
    ]
    texts += ["".join(rng.choice(string.printable) for _ in range(rng.randint(1, 200))) for _ in range(16)]
    taken = 0
    for text in texts:
        for special in (True, False):
            want = tokenizer.encode(text, add_special_tokens=special)
            for _ in range(2):
                got = words.encode(text, special)
                if got is not None and got != want:
                    return False
                taken += got is not None
    return taken >= len(texts)
