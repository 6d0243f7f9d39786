"""Incremental detokenization and stop-string matching for one request.

With a fast (Rust) tokenizer, `tokenizers`' own `DecodeStream` turns each token into its new
text: about 1 us a token against 6.5 us for two windowed `decode` calls through transformers,
on the engine thread that every stream's step waits for. Other tokenizers decode a short
window of ids per token, which keeps that O(1) per step too. Either way, text that could still
become a stop string is held back until it can't, unless the request keeps its stop string
(`include_stop_str_in_output`): then nothing is held back, as vLLM holds back nothing then.
The request's text fields (special tokens kept or skipped, spaces between added tokens, the
stop string kept or cut) follow vLLM's detokenizer for fast tokenizers.
"""

import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from tokenizers.decoders import DecodeStream

from workers.sampling_params import SamplingParams

CONTEXT = 4  # prompt ids before the output that show text: how the first output token's text starts
MAX_REACH = 64  # how far back a prompt's trailing special tokens are passed over to find them
_added: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_special: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
T = TypeVar("T")


def _per_tokenizer(cache: "weakref.WeakKeyDictionary", tokenizer, make: Callable[[Any], T]) -> T:
    """`make(tokenizer)`, cached in `cache` per tokenizer (made again for one no weak reference
    can name): read only when a request asks."""
    try:
        return cache[tokenizer]
    except (KeyError, TypeError):
        pass
    value = make(tokenizer)
    try:
        cache[tokenizer] = value
    except TypeError:
        pass
    return value


def _added_decoder(tokenizer) -> dict:
    """A fast tokenizer's added tokens by id (tokenizers' AddedToken); none without a Rust backend."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return {} if backend is None else backend.get_added_tokens_decoder()


def added_tokens(tokenizer) -> dict[int, str]:
    """A fast tokenizer's added tokens (special or not) by id, with their text; none for a
    tokenizer without a Rust backend. Cached per tokenizer."""
    return _per_tokenizer(_added, tokenizer, lambda tok: {i: t.content for i, t in _added_decoder(tok).items()})


def special_ids(tokenizer) -> frozenset[int]:
    """A tokenizer's special token ids (which `skip_special_tokens` drops): its Rust backend's
    special added tokens, which its decoder skips, and transformers' own; cached per tokenizer."""

    def make(tok) -> frozenset[int]:
        special = {i for i, t in _added_decoder(tok).items() if t.special}
        return frozenset(getattr(tok, "all_special_ids", ()) or ()) | special

    return _per_tokenizer(_special, tokenizer, make)


def context_ids(tokenizer, prompt_ids: list[int], skip_special: bool) -> list[int]:
    """The prompt's last ids the first output token is decoded after: CONTEXT of them that show
    text (a skipped special token shows none: after a prompt ending in several, the first output
    token would decode as a text's start, losing a leading space vLLM keeps, as it decodes after
    the whole prompt), looking back at most MAX_REACH ids."""
    if not skip_special:
        return list(prompt_ids[-CONTEXT:])
    special, shown, start = special_ids(tokenizer), 0, len(prompt_ids)
    while start > 0 and shown < CONTEXT and len(prompt_ids) - start < MAX_REACH:
        start -= 1
        shown += prompt_ids[start] not in special
    return list(prompt_ids[start:])


class Detokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], params: SamplingParams):
        """The text fields of `params`: its stop strings, which count only once more tokens than
        `min_tokens` were added and only where they end in the text after the first `min_tokens`
        tokens' (vLLM's rule); `include_stop_str_in_output`, `skip_special_tokens` and
        `spaces_between_special_tokens`."""
        self.tokenizer = tokenizer
        self.skip_special = params.skip_special_tokens
        self.ids = context_ids(tokenizer, prompt_ids, self.skip_special)
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.emitted = 0
        self.stop = params.stop
        self.min_tokens = params.min_tokens
        self.include_stop = params.include_stop_str_in_output
        self.num_added = 0
        self.holdback = 0 if self.include_stop else max((len(s) for s in self.stop), default=1) - 1
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        self.stream = DecodeStream(self.ids, skip_special_tokens=self.skip_special) if self._streamable() else None
        # Added tokens shown as their own text when one follows another (no space between them).
        keep_spaces = self.skip_special or params.spaces_between_special_tokens
        self.unspaced = {} if keep_spaces else added_tokens(tokenizer)
        self.after_added = False

    def _streamable(self) -> bool:
        """Whether DecodeStream gives the same text here. Not where transformers edits decoded
        text (`clean_up_tokenization_spaces`), and not where the prompt's last ids end in a
        partial character: the stream would take them for unseen output and emit them."""
        if self.backend is None or getattr(self.tokenizer, "clean_up_tokenization_spaces", False):
            return False
        return not self._decode(self.ids).endswith("\ufffd")

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def _new_text(self, token_id: int) -> str | None:
        """The text `token_id` completes, or None while it ends in a partial character."""
        self.ids.append(token_id)
        if self.stream is not None:
            try:
                return self.stream.step(self.backend, token_id)
            except Exception:  # tokenizers raises when byte-fallback text it emitted changes
                self.stream = None  # windowed from here; what the stream emitted stays emitted
                self.read_offset = len(self.ids) - 1
                self.prefix_offset = max(0, self.read_offset - CONTEXT)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new = self._decode(self.ids[self.prefix_offset :])
        if len(new) <= len(prefix) or new.endswith("\ufffd"):
            return None
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return new[len(prefix) :]

    def _unspaced(self, token_id: int, new: str | None) -> str | None:
        """With `spaces_between_special_tokens` false, an added token right after another is its
        own text: a decoder that joins tokens with spaces (WordPiece's, or none) puts none
        between the two. vLLM's rule; ByteLevel and Metaspace decoders join without spaces anyway."""
        content = self.unspaced.get(token_id)
        after, self.after_added = self.after_added, content is not None
        return content if content is not None and after else new

    def add(self, token_id: int, stop_token: bool = False) -> bool:
        """Append a token; True when a stop string has appeared: the text is then cut before it,
        or after it with `include_stop_str_in_output`. A token that ends the request as a stop
        token (`stop_token`: EOS or a stop token id) adds its text only with that flag too
        (vLLM's rule: its text is the stop, kept or not as a stop string is)."""
        self.num_added += 1
        if stop_token and not self.include_stop:
            return False
        new = self._new_text(token_id)
        if self.unspaced:
            new = self._unspaced(token_id, new)
        if not new:
            return False
        before = len(self.text)
        self.text += new
        if self.num_added <= self.min_tokens:
            return False
        hit = self._first_stop(before)
        if hit is not None:
            self.text = self.text[: hit[1] if self.include_stop else hit[0]]
        return hit is not None

    def _first_stop(self, before: int) -> tuple[int, int] | None:
        """(start, end) of the stop string that ends first past character `before`, the first
        listed of those ending together: where vLLM stops when one token completes several."""
        first = None
        for s in self.stop:
            at = self.text.find(s, max(0, before - len(s) + 1))
            if at >= 0 and (first is None or at + len(s) < first[1]):
                first = (at, at + len(s))
        return first

    def flush(self, final: bool) -> str:
        """Text not yet emitted; while not final, keep back what may be a stop string's start."""
        end = len(self.text) if final else max(self.emitted, len(self.text) - self.holdback)
        out = self.text[self.emitted : end]
        self.emitted = end
        return out
