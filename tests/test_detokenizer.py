"""Detokenizer: the DecodeStream path (fast tokenizers) and the windowed-decode path give the
text `decode` gives, hold back partial characters, and cut at stop strings in the same place."""
import pytest

from workers.detokenizer import Detokenizer
from workers.model_store import load_tokenizer

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
    d = Detokenizer(wrap(tok), prompt)
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
    stream = run(Detokenizer(tok, prompt, (stop,)), out)
    windowed = run(Detokenizer(Windowed(tok), prompt, (stop,)), out)
    assert stream == windowed
    pieces, stopped = stream
    full = tok.decode(out, skip_special_tokens=True)
    if stop in full:
        assert stopped is not None and "".join(pieces) == full[:full.index(stop)]
    else:
        assert stopped is None


def test_special_and_out_of_vocab_ids_add_no_text(tok):
    d = Detokenizer(tok, [1, 2])
    assert run(d, [0, 2, len(tok) + 5]) == (["", "", "", ""], None)
