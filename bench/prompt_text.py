"""Seeded token-id prompts as text that the workers' tokenizer reads back to the same ids.

Routers that take only text (sglang-router) get the workloads' prompts decoded; random ids
decode to fragments that re-encode into other and more tokens (4% more with SmolLM2's
tokenizer), so the real fleet computed more than the simulator, given the ids, was asked to.
Each id is mapped to one of the vocabulary's whole lowercase words with a leading space
(" cat"): the byte-level BPE pre-tokenizer splits text at those spaces, so a sequence of them
encodes back token for token, and a prompt's length and block boundaries are the simulator's.
"""

import re
from collections.abc import Callable

WORD = re.compile(r" [a-z]{2,}")


def stable_words(tokenizer) -> list[int]:
    """Ids that decode to a single " word" which encodes back to that id alone."""
    return [
        tid
        for tid in range(len(tokenizer))
        if WORD.fullmatch(s := tokenizer.decode([tid])) and tokenizer.encode(s, add_special_tokens=False) == [tid]
    ]


def as_text(tokenizer) -> Callable[[list[int]], str]:
    """A prompt renderer: each id becomes a stable word (`id % len(words)`), joined as text.
    Equal id sequences give equal text, so shared prefixes stay shared."""
    words = stable_words(tokenizer)
    if not words:
        raise ValueError("the tokenizer has no whole-word tokens to write prompts with")
    return lambda ids: tokenizer.decode([words[i % len(words)] for i in ids])
