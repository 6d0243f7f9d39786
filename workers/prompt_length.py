"""How long a prompt is, bounded before it is tokenized whole: a client's megabyte of text costs
neither the memory nor the CPU of its tokens where it surely passes a limit (the prompt's
context, the bad words' token budget). Pure: the gateway and the workers bound by this one code."""

import re
import weakref

# A prompt longer than this many characters per allowed token is first counted on a prefix.
PREFIX_CHARS_PER_TOKEN = 8
CUT_MARGIN = 16  # tokens a prefix cut at a word boundary may over-count (special tokens, prefix spaces)
_LAST_CUT = re.compile(r".*\S( )", re.S)
_token_chars: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def surely_too_long(text: str, tokenizer, limit: int) -> bool:
    """True only if `text` must tokenize to at least `limit` tokens, decided without tokenizing
    all of it, so a megabyte prompt costs neither the memory nor the CPU of its tokens.

    A text of n characters has at least n / `token_chars` tokens. Past that bound, a prefix cut
    just before a space that follows a non-space is counted: word-splitting pre-tokenizers split
    there anyway, so the prefix's tokens start the full text's (up to CUT_MARGIN for tokens added
    at either end). False means only "not decided": the caller tokenizes the whole text."""
    if len(text) <= PREFIX_CHARS_PER_TOKEN * limit:
        return False
    per_token = token_chars(tokenizer)
    if per_token is not None and len(text) > per_token * limit:
        return True
    cut = _LAST_CUT.match(text, 0, PREFIX_CHARS_PER_TOKEN * limit)
    if cut is None:
        return False
    return len(tokenizer.encode(text[: cut.start(1)], add_special_tokens=False)) - CUT_MARGIN >= limit


def token_chars(tokenizer) -> int | None:
    """The most characters of text one token can stand for (cached per tokenizer): its longest
    vocabulary entry, tripled when a normaliser may compose characters (NFC folds up to three
    into one). None when the tokenizer does not list its vocabulary."""
    try:
        return _token_chars[tokenizer]
    except KeyError:
        pass
    except TypeError:
        return None
    try:
        longest = max(map(len, tokenizer.get_vocab()))
    except (AttributeError, TypeError, ValueError):
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    chars = longest * (1 if backend is not None and backend.normalizer is None else 3)
    _token_chars[tokenizer] = chars
    return chars
