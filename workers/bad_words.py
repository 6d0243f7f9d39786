"""vLLM's `bad_words` as token sequences (its SamplingParams.update_from_tokenizer), read by the
one parse the gateway and the workers share (workers/protocol.py), with vLLM's 400s and limits."""

from workers.prompt_length import surely_too_long, token_chars
from workers.sampling_params import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS, InvalidRequest, vllm_message


def bad_words_token_ids(words: tuple[str, ...], tokenizer, vocab_size: int | None) -> tuple[tuple[int, ...], ...]:
    """vLLM's tokenization of `bad_words` (SamplingParams.update_from_tokenizer), with its 400s:
    each word's forms (`_forms`) in order, a word of none refused, and past MAX_BAD_WORDS forms
    as they are counted; then a token outside the model's `vocab_size`; then, as vLLM's GPU
    runner refuses them, more than MAX_BAD_WORD_TOKENS tokens in all (a word that surely
    tokenizes to more is refused before it is tokenized, as a prompt is: a client's megabyte
    word costs no tokenizer time, nor do words that together surely do: what is tokenized is at
    most twice the characters of MAX_BAD_WORD_TOKENS of the longest tokens)."""
    per_token = token_chars(tokenizer)
    if any(surely_too_long(w.lstrip(), tokenizer, MAX_BAD_WORD_TOKENS + 1) for w in words) or (
        per_token is not None and sum(len(w.lstrip()) for w in words) > per_token * MAX_BAD_WORD_TOKENS
    ):
        raise InvalidRequest(_too_many_tokens(f"more than {MAX_BAD_WORD_TOKENS}"), "bad_words")
    sequences: list[tuple[int, ...]] = []
    for word in words:
        forms = _forms(word, tokenizer)
        if not forms:
            raise _refused("bad_words entries must tokenize to at least one token.", words)
        for form in forms:
            sequences.append(form)
            if len(sequences) > MAX_BAD_WORDS:
                count = f"{len(sequences)}. The max number is {MAX_BAD_WORDS}."
                raise _refused(f"Too many bad words after tokenization: {count}", words)
    if vocab_size is not None and (bad := [t for seq in sequences for t in seq if t >= vocab_size]):
        raise _refused(
            f"The model vocabulary size is {vocab_size}, but the following tokens were specified as bad: {bad}. "
            f"All token id values should be integers satisfying: 0 <= token_id <= {vocab_size - 1}.",
            words,
        )
    if (total := sum(map(len, sequences))) > MAX_BAD_WORD_TOKENS:
        raise InvalidRequest(_too_many_tokens(str(total)), "bad_words")
    return tuple(sequences)


def _forms(word: str, tokenizer) -> tuple[tuple[int, ...], ...]:
    """A bad word's token sequences, as vLLM makes them: the word, its leading whitespace
    stripped, without special tokens (at a text's start); then with one leading space, where
    that makes as many tokens and another first one (the word inside a text). None where the
    word makes no token."""
    plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
    if not plain:
        return ()
    spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
    return (plain, spaced) if spaced and spaced[0] != plain[0] and len(spaced) == len(plain) else (plain,)


def _refused(message: str, words: tuple[str, ...]) -> InvalidRequest:
    return InvalidRequest(vllm_message(message, "bad_words", list(words)), "bad_words")


def _too_many_tokens(count: str) -> str:
    return f"Too many total bad word tokens: {count}. The max is {MAX_BAD_WORD_TOKENS}."
