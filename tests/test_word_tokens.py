"""Word-by-word token ids: always the tokenizer's own, for the shapes it reads; off for others."""

import re

import pytest
import regex
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from workers.model_store import load_tokenizer
from workers.prefix_tokens import PrefixTokenizer
from workers.word_tokens import ascii_regex, islands, word_tokenizer

LLAMA3_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
PIECES = ["the", "The", "'s", "'S", "don't", "12345", "3.14", "!!", "  ", "\n", "\r\n", "\t", "\x0b", "\x1c"]
PIECES += ["naïve", "café ", "字", "🙂 ", "e\u0301", "\xa0", "\u3000 ", "ﬁ"]
CORPUS = ["The cache holds the prefix of the prompt, 12345 times; don't it's 3.14!\n\n  x\ty"] * 30


@pytest.fixture(scope="module")
def smollm2():
    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="module")
def smollm2_words(smollm2):
    words = word_tokenizer(smollm2)
    assert words is not None
    return words


def byte_level(split: pre_tokenizers.PreTokenizer, normalizer=None) -> PreTrainedTokenizerFast:
    """A small byte-level BPE tokenizer trained here, with a BOS-adding post-processor."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = split
    tok.decoder = decoders.ByteLevel()
    if normalizer is not None:
        tok.normalizer = normalizer
    specials = ["<|begin_of_text|>", "<|eot_id|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[(specials[0], 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=specials[0], eos_token=specials[1])


def llama3_shaped() -> PreTrainedTokenizerFast:
    split = pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated")
    return byte_level(
        pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    )


def texts(specials: list[str]):
    piece = st.sampled_from(PIECES + specials) | st.text(st.characters(max_codepoint=127), max_size=12)
    return st.lists(piece, max_size=60).map("".join)


@settings(max_examples=80, deadline=None)
@given(text=texts(["<|im_start|>", "<|im_end|>", "<|endoftext|>"]), special=st.booleans())
def test_smollm2_ids_equal_the_tokenizers(smollm2, smollm2_words, text, special):
    want = smollm2.encode(text, add_special_tokens=special)
    got = smollm2_words.encode(text, special)
    assert got == want or (got is None and not text)


def test_llama3_shaped_split_and_bos():
    tok = llama3_shaped()
    words = word_tokenizer(tok)
    assert words is not None
    for text in ["The cache's 12345 <|eot_id|> x", "don't\r\n\n  y", "AB'S 3.14!!\t"] + CORPUS[:1]:
        for special in (True, False):
            assert words.encode(text, special) == tok.encode(text, add_special_tokens=special)
    assert words.encode("x", True)[0] == tok.convert_tokens_to_ids("<|begin_of_text|>")


@pytest.fixture(scope="module")
def llama3():
    tok = llama3_shaped()
    words = word_tokenizer(tok)
    assert words is not None
    return tok, words


@settings(max_examples=40, deadline=None)
@given(text=texts(["<|begin_of_text|>", "<|eot_id|>"]), special=st.booleans())
def test_llama3_shaped_ids_equal_the_tokenizers(llama3, text, special):
    tok, words = llama3
    got = words.encode(text, special)
    assert got == tok.encode(text, add_special_tokens=special) or (got is None and not text)


@pytest.mark.parametrize(
    "shape",
    [
        pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel()]),
        pre_tokenizers.ByteLevel(add_prefix_space=True),
        pre_tokenizers.Whitespace(),
    ],
)
def test_shapes_it_does_not_read_get_none(shape):
    assert word_tokenizer(byte_level(shape)) is None


def test_a_normalizer_that_changes_ascii_gets_none():
    assert word_tokenizer(byte_level(pre_tokenizers.ByteLevel(add_prefix_space=False), normalizers.Lowercase())) is None
    assert word_tokenizer(byte_level(pre_tokenizers.ByteLevel(add_prefix_space=False), normalizers.NFC())) is not None


def test_words_around_other_characters_go_to_the_tokenizer_whole(smollm2, smollm2_words):
    text = "the naïve café 🙂 costs 3€, and  日本語 too\u3000 x"
    assert smollm2_words.encode(text) == smollm2.encode(text)
    assert PrefixTokenizer(smollm2).encode(text) == smollm2.encode(text)
    # each from a space after a non-space to the next (a space after U+3000, a space, is no cut)
    assert [text[lo:hi] for lo, hi in islands(text)] == [" naïve", " café", " 🙂", " 3€,", "  日本語", " too\u3000 x"]


def test_vocabulary_words_are_cached_from_the_start_and_the_cache_stays_bounded(smollm2, smollm2_words):
    known = len(smollm2_words._words)
    assert smollm2_words.encode(" the cache holds the prefix") == smollm2.encode(" the cache holds the prefix")
    assert len(smollm2_words._words) == known  # every word was a vocabulary entry
    smollm2_words.max_words = known + 3
    novel = " ".join(f"zq{i}xv" for i in range(40))
    assert smollm2_words.encode(novel) == smollm2.encode(novel)
    assert len(smollm2_words._words) <= known + 3 + novel.count(" ") * 3


def test_a_clients_long_words_are_encoded_exactly_but_not_kept(smollm2, smollm2_words):
    long_words = " ".join("q" * 500 + str(i) for i in range(3))
    before = set(smollm2_words._words)
    assert smollm2_words.encode(long_words) == smollm2.encode(long_words)
    assert not any(len(w) > 64 for w in set(smollm2_words._words) - before)
    assert smollm2_words.encode(long_words) == smollm2.encode(long_words)  # again, not from a cache


def test_long_prompts_use_both_caches_and_stay_exact(smollm2):
    cached = PrefixTokenizer(smollm2, chunk_chars=128)
    assert cached.words is not None and cached.enabled
    prefix = " ".join(f"word{i} and some more text, {i * 7}." for i in range(300))
    for q in ("What is first?", "What is last?", "Und dazwischen — naïve?"):
        assert cached.encode(prefix + " " + q) == smollm2.encode(prefix + " " + q)
    assert cached.hits > 1.8 * len(prefix)


def test_ascii_regex_splits_ascii_as_the_unicode_pattern_does():
    text = "".join(map(chr, range(128))) * 2 + " don't 'S 12345 x  y\n\n z\r\n\t "
    for pattern in (LLAMA3_SPLIT, r"""'s| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""):
        fast = ascii_regex(pattern)
        assert isinstance(fast, re.Pattern)
        assert fast.findall(text) == regex.compile(pattern).findall(text)
    assert not isinstance(ascii_regex(r"\p{Lu}+|\s+"), re.Pattern)  # a class it does not rewrite
