"""The gateway's prefix token cache: ids always equal the tokenizer's own; cached when it can."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from workers.prefix_tokens import Budgeted, OverBudget, PrefixTokenizer
from workers.model_store import load_tokenizer

WORDS = [
    "the",
    "cache",
    "Über",
    "naïve",
    "42",
    "3.14",
    "!",
    "?",
    "—",
    "\n",
    "  ",
    "\t",
    "'s",
    "日本",
    "🙂",
    "<|im_start|>",
]


@pytest.fixture(scope="module")
def smollm2():
    return load_tokenizer("smollm2-135m")


def texts():
    word = st.sampled_from(WORDS).map(lambda w: w + " ") | st.sampled_from(WORDS)
    return st.lists(word, min_size=1, max_size=400).map("".join)


@pytest.fixture(scope="module")
def cached64(smollm2):
    """One PrefixTokenizer for every example (building one runs its self-test, 0.4 s); each
    example empties its cache first."""
    return PrefixTokenizer(smollm2, chunk_chars=64)


@settings(max_examples=60, deadline=None)
@given(prefix=texts(), tails=st.lists(texts(), min_size=1, max_size=3), special=st.booleans())
def test_ids_equal_the_tokenizers_on_shared_prefixes(smollm2, cached64, prefix, tails, special):
    cached = cached64
    cached._chunks.clear()
    assert cached.enabled
    for tail in tails:
        text = prefix + tail
        assert cached.encode(text, special) == smollm2.encode(text, add_special_tokens=special)


def test_a_shared_prefix_is_tokenized_once(smollm2):
    cached = PrefixTokenizer(smollm2, chunk_chars=128)
    assert cached.enabled
    prefix = " ".join(f"word{i} and some more text, {i * 7}." for i in range(300))
    for q in ("What is first?", "What is last?", "And in between?"):
        assert cached.encode(prefix + " " + q) == smollm2.encode(prefix + " " + q)
    assert cached.hits > 1.8 * len(prefix)  # the second and third prompts read it from the cache
    assert cached.misses < 1.3 * len(prefix)


def test_a_budget_is_charged_only_what_follows_the_cached_prefix(smollm2):
    """A Budgeted tokenizer pays for the characters past a prompt's cached prefix, over its
    calls; past its budget it raises before tokenizing them, having stored nothing of them."""
    cached = PrefixTokenizer(smollm2, chunk_chars=128)
    budgeted = Budgeted(cached)
    prefix = " ".join(f"word{i} and some more text, {i * 7}." for i in range(300))
    budgeted.left = 1000
    with pytest.raises(OverBudget):
        budgeted.encode(prefix + " What is first?")
    assert cached.misses == 0 and not cached._chunks
    assert cached.encode(prefix + " What is first?") == smollm2.encode(prefix + " What is first?")
    budgeted.left = 1000
    for q in ("What is last?", "And in between?"):
        assert budgeted.encode(prefix + " " + q) == smollm2.encode(prefix + " " + q)
    assert 0 < budgeted.left < 1000 - 2 * len(" And in between?")
    budgeted.left = 10
    with pytest.raises(OverBudget):
        budgeted.encode("a short prompt, under the cache's chunks, still costs its length")
    assert budgeted.vocab_size == smollm2.vocab_size  # everything else is the tokenizer's


def test_chunks_stay_within_the_bound(smollm2):
    cached = PrefixTokenizer(smollm2, chunk_chars=32, max_chunks=10)
    for i in range(20):
        text = f"prompt {i} " + "lorem ipsum dolor sit amet " * 20
        assert cached.encode(text) == smollm2.encode(text)
    assert len(cached._chunks) <= 10


def test_a_clients_long_runs_without_spaces_are_not_kept(smollm2):
    cached = PrefixTokenizer(smollm2, chunk_chars=32)
    text = "short words come first, " * 4 + "x" * 5000 + " and more words after it " * 8
    assert cached.encode(text) == smollm2.encode(text)
    assert cached.encode(text) == smollm2.encode(text)
    assert cached._chunks and max(len(key[2]) for key in cached._chunks) <= 4 * 32


def test_a_tokenizer_that_does_not_split_words_gets_no_cache():
    """No pre-tokenizer: BPE merges may cross spaces (here they do), so a prefix's tokens may
    depend on what follows it; the cache stays off and the ids are the tokenizer's."""
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    corpus = ["the cache holds the prefix of the prompt " * 3, "naive Uber 42 3.14 and more words here"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    assert any(" " in t.strip() for t in fast.get_vocab())  # merges across a space exist
    cached = PrefixTokenizer(fast, chunk_chars=16)
    text = "the cache holds " * 40 + "naive"
    assert not cached.enabled
    assert cached.encode(text) == fast.encode(text)


def test_sentencepiece_style_metaspace_splits_at_spaces():
    """Metaspace turns each space into the next word's '▁' and starts a piece there, so the
    cut rule holds and the cache is on; ids equal the tokenizer's."""
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    corpus = ["the cache holds the prefix of the prompt " * 3, "naïve Über 42 3.14 and more words here"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=200, special_tokens=["[UNK]"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    cached = PrefixTokenizer(fast, chunk_chars=16)
    assert cached.enabled
    for tail in ("naïve", " more words", "42"):
        text = "the cache holds " * 40 + tail
        assert cached.encode(text) == fast.encode(text)
