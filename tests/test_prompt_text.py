"""bench.prompt_text: seeded id prompts written as text come back from the workers' tokenizer
as one token per id, so a real fleet computes the prompt lengths the simulator does."""

import functools

from hypothesis import given, settings
from hypothesis import strategies as st

from bench.prompt_text import as_text, stable_words
from workers.model_store import load_tokenizer


@functools.cache
def _tok():
    return load_tokenizer("smollm2-135m")


@functools.cache
def _words() -> list[int]:
    return stable_words(_tok())


@functools.cache
def _text():
    return as_text(_tok())


def test_stable_words_are_many_and_each_reads_back_alone():
    words = _words()
    assert len(words) > 10_000
    tok = _tok()
    for tid in words[:: len(words) // 50]:
        text = tok.decode([tid])
        assert text.startswith(" ") and tok.encode(text, add_special_tokens=False) == [tid]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=49_151), min_size=1, max_size=400))
def test_a_prompt_reads_back_one_token_per_id(ids):
    words, tok = _words(), _tok()
    back = tok.encode(_text()(ids), add_special_tokens=False)
    assert back == [words[i % len(words)] for i in ids]


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 31_999), min_size=1, max_size=64), st.lists(st.integers(0, 31_999), max_size=64))
def test_equal_prefixes_are_equal_text(prefix, rest):
    assert _text()(prefix + rest).startswith(_text()(prefix))
