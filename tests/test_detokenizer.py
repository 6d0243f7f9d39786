"""Detokenizer: the DecodeStream path (fast tokenizers) and the windowed-decode path give the
text `decode` gives, hold back partial characters, and cut at stop strings in the same place."""

import pytest

from workers.detokenizer import Detokenizer
from workers.model_store import load_tokenizer
from workers.sampling_params import SamplingParams

PLAIN = SamplingParams()
TEXT = "Héllo, wörld! 日本語のテキスト 🎉🦊 emojis, tabs\tand\nnew lines. " * 4


class Windowed:
    """The same tokenizer without its Rust backend: forces the windowed-decode path."""

    def __init__(self, tok):
        self.decode = tok.decode


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("smollm2-135m")


def run(d: Detokenizer, ids: list[int]) -> tuple[list[str], int | None]:
    """Pieces flushed after each token, and the index of the token that hit a stop string."""
    pieces = []
    for i, t in enumerate(ids):
        if d.add(t):
            pieces.append(d.flush(True))
            return pieces, i
        pieces.append(d.flush(False))
    pieces.append(d.flush(True))
    return pieces, None


@pytest.mark.parametrize("wrap", [lambda t: t, Windowed], ids=["stream", "windowed"])
def test_text_matches_decode_and_holds_back_partial_characters(tok, wrap):
    ids = tok.encode(TEXT)
    prompt, out = ids[:7], ids[7:]
    d = Detokenizer(wrap(tok), prompt, PLAIN)
    assert (d.stream is not None) == (wrap is not Windowed)
    pieces, stopped = run(d, out)
    assert stopped is None
    assert "".join(pieces) == tok.decode(out, skip_special_tokens=True)
    assert not any("\ufffd" in p for p in pieces)
    emoji_tokens = [t for t in tok.encode("🎉")]
    assert len(emoji_tokens) > 1, "the emoji should span byte tokens, or this test checks nothing"


@pytest.mark.parametrize("stop", ["wörld", "テキスト", "\ttabs", "🦊 em"])
def test_stop_strings_cut_alike_on_both_paths(tok, stop):
    ids = tok.encode(TEXT)
    prompt, out = ids[:3], ids[3:]
    stream = run(Detokenizer(tok, prompt, SamplingParams(stop=(stop,))), out)
    windowed = run(Detokenizer(Windowed(tok), prompt, SamplingParams(stop=(stop,))), out)
    assert stream == windowed
    pieces, stopped = stream
    full = tok.decode(out, skip_special_tokens=True)
    if stop in full:
        assert stopped is not None and "".join(pieces) == full[: full.index(stop)]
    else:
        assert stopped is None


def test_special_and_out_of_vocab_ids_add_no_text(tok):
    d = Detokenizer(tok, [1, 2], PLAIN)
    assert run(d, [0, 2, len(tok) + 5]) == (["", "", "", ""], None)


def test_prompt_ending_mid_character_does_not_leak_into_the_output(tok):
    """A token-id prompt may end inside a character (a continuation of an output cut there):
    its text is not output, and a stop string found only in the prompt stops nothing."""
    prompt = tok.encode("I like 🎉")[:-1]
    assert tok.decode(prompt).endswith("\ufffd")
    out = tok.encode(" The answer is 42.")
    for stop in ((), ("like",)):
        got = run(Detokenizer(tok, prompt, SamplingParams(stop=stop)), out)
        assert got == run(Detokenizer(Windowed(tok), prompt, SamplingParams(stop=stop)), out)
        assert got[1] is None and "like" not in "".join(got[0])


def byte_fallback_tokenizer():
    """A Llama-2-style tokenizer (byte fallback, `▁` for spaces) built in place."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{i:02X}>": 3 + i for i in range(256)}}
    for t in ("▁", "a", "▁a"):
        vocab[t] = len(vocab)
    tk = Tokenizer(models.BPE(vocab, [], byte_fallback=True, unk_token="<unk>"))
    tk.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tk, clean_up_tokenization_spaces=False), vocab


def test_a_byte_run_the_stream_cannot_reconcile_falls_back_instead_of_raising():
    """tokenizers' DecodeStream raises when a byte-fallback run rewrites text it already gave
    (here "日" then a stray lead byte); on the engine thread that would stop every request."""
    tok, vocab = byte_fallback_tokenizer()
    d = Detokenizer(tok, [vocab["▁a"]], PLAIN)
    assert d.stream is not None
    pieces, stopped = run(d, [vocab[t] for t in ("<0xE6>", "<0x97>", "<0xA5>", "<0xE2>", "▁a", "a")])
    assert stopped is None and d.stream is None
    assert "".join(pieces).startswith("日") and "".join(pieces).endswith("aa")
