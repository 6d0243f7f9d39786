"""vLLM's text fields: `include_stop_str_in_output` (the text keeps the stop string that ended
it, up to its end, and nothing is held back while streaming; a stop token's own text is kept only
then too), `skip_special_tokens: false` (special tokens' text kept) and
`spaces_between_special_tokens: false` (no space between two added tokens a decoder would join
with one). First the detokenizer's rules against a plain statement of vLLM's, then through a
worker: the sim executor's, and a tiny random Llama's whose EOS and special tokens are forced by
`logit_bias`. A stream's deltas always add up to the whole answer's text."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from workers.cli import build_server, parser
from workers.detokenizer import CONTEXT, Detokenizer
from workers.model_store import load_tokenizer
from workers.sampling_params import SamplingParams

PIECES = ["a", "b", "ab", "ba", "abc", "<s>"]  # token i's text; the last one is special
SPECIAL = len(PIECES) - 1


class Pieces:
    """Token i decodes to PIECES[i]: tokens of several characters, so one token may complete
    several stop strings at once."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(PIECES[i] for i in ids if not (skip_special_tokens and i == SPECIAL))


def run(d: Detokenizer, ids: list[int], stop_token: bool = False) -> tuple[list[str], int | None]:
    """The deltas a stream gets after each token (the last token a stop token when `stop_token`),
    and the index of the token that hit a stop string."""
    deltas = []
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        if d.add(t, stop_token and last):
            deltas.append(d.flush(True))
            return deltas, i
        deltas.append(d.flush(last))
    return deltas, None


def reference(ids: list[int], params: SamplingParams, stop_token: bool) -> tuple[str, int | None]:
    """vLLM's rules, plainly: each token's text is appended (a special one only where kept, a
    last stop token only where the stop is included); past `min_tokens` tokens, of the stop
    strings ending in the new text the one ending first (the first listed of equal ends) stops
    the request, the text cut before it, or after it where it is included."""
    text = ""
    for k, t in enumerate(ids):
        if stop_token and k == len(ids) - 1 and not params.include_stop_str_in_output:
            return text, None
        before = len(text)
        text += Pieces().decode([t], params.skip_special_tokens)
        if k + 1 <= params.min_tokens:
            continue
        ends = [
            (at + len(s), i, at)
            for i, s in enumerate(params.stop)
            for at in range(len(text) - len(s) + 1)
            if text.startswith(s, at) and at + len(s) > before
        ]
        if ends:
            end, _, at = min(ends)
            return text[: end if params.include_stop_str_in_output else at], k
    return text, None


@settings(max_examples=500, deadline=None)
@given(
    ids=st.lists(st.integers(0, SPECIAL), max_size=16),
    cuts=st.lists(st.tuples(st.integers(0, 30), st.integers(1, 4)), max_size=3),
    other=st.lists(st.text("abc<s>", min_size=1, max_size=4), max_size=1),
    include=st.booleans(),
    skip=st.booleans(),
    min_tokens=st.integers(0, 4),
    stop_token=st.booleans(),
)
def test_the_text_and_its_deltas_follow_vllms_rules(ids, cuts, other, include, skip, min_tokens, stop_token):
    """Stop strings mostly cut from the text itself, so that they meet, overlap and nest."""
    full = Pieces().decode(ids, skip)
    stop = tuple(full[at : at + n] for at, n in cuts if full[at : at + n]) + tuple(other)
    params = SamplingParams(
        stop=stop, min_tokens=min_tokens, include_stop_str_in_output=include, skip_special_tokens=skip
    )
    d = Detokenizer(Pieces(), [], params)
    deltas, stopped = run(d, ids, stop_token)
    assert ("".join(deltas), stopped) == reference(ids, params, stop_token)
    assert "".join(deltas) == d.text  # nothing streamed was cut away later


def test_one_token_completing_two_stop_strings_stops_at_the_one_ending_first():
    """Token "abc" completes both: "b" ends first, so the text is "a" (vLLM's), not "" (as when
    the stop string that starts first won)."""
    for include, text in ((False, "a"), (True, "ab")):
        d = Detokenizer(Pieces(), [], SamplingParams(stop=("abc", "b"), include_stop_str_in_output=include))
        assert run(d, [4]) == ([text], 0)


def test_with_the_stop_included_nothing_is_held_back():
    """Without it, the stop string's length less one character waits; with it, each token's text
    leaves with it (vLLM's output_text_buffer_length is 0)."""
    ids = [0, 0, 1, 0, 1]  # "aabab", "bab" completed by the last token
    for include, deltas in ((False, ["", "", "a", "a", ""]), (True, ["a", "a", "b", "a", "b"])):
        params = SamplingParams(stop=("bab",), include_stop_str_in_output=include)
        assert run(Detokenizer(Pieces(), [], params), ids) == (deltas, 4)


def test_a_stop_tokens_text_is_kept_only_with_the_stop():
    for include, text in ((False, "ab"), (True, "ab<s>")):
        params = SamplingParams(include_stop_str_in_output=include, skip_special_tokens=False)
        assert "".join(run(Detokenizer(Pieces(), [], params), [2, SPECIAL], stop_token=True)[0]) == text


# -- real tokenizers: special tokens and the spaces between added tokens -------------------------


class Windowed:
    """A fast tokenizer made to take the windowed-decode path (as transformers' text clean-up does)."""

    clean_up_tokenization_spaces = True

    def __init__(self, tok):
        self.decode = tok.decode
        self.backend_tokenizer = tok.backend_tokenizer


@pytest.fixture(scope="module")
def smol():
    return load_tokenizer("smollm2-135m")


@pytest.mark.parametrize("wrap", [lambda t: t, Windowed], ids=["stream", "windowed"])
def test_special_tokens_are_kept_when_not_skipped(smol, wrap):
    ids = smol.encode("<|im_start|>assistant\nHi there<|im_end|>\n<|endoftext|>")
    for skip in (True, False):
        d = Detokenizer(wrap(smol), smol.encode("User: hi\n"), SamplingParams(skip_special_tokens=skip))
        assert (d.stream is not None) == (wrap is not Windowed)
        assert "".join(run(d, ids)[0]) == smol.decode(ids, skip_special_tokens=skip)


def wordpiece():
    """A fast tokenizer whose decoder (WordPiece's) joins tokens with spaces, special ones too."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate("[UNK] [CLS] [SEP] the cat ##s".split())}
    tk = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tk.decoder = decoders.WordPiece()
    tk.add_special_tokens([AddedToken("[CLS]", special=True), AddedToken("[SEP]", special=True)])
    tk.add_tokens([AddedToken("<x>", special=False)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, clean_up_tokenization_spaces=False), vocab


@pytest.mark.parametrize("wrap", [lambda t: t, Windowed], ids=["stream", "windowed"])
def test_without_spaces_between_special_tokens_consecutive_added_tokens_are_not_spaced(wrap):
    """As vLLM's fast detokenizer: an added token right after another added token is its own
    text; after other text it keeps the decoder's space. Skipping special tokens, or a decoder
    that puts no space there (ByteLevel, SmolLM2's), leaves nothing to change."""
    tok, vocab = wordpiece()
    x = tok.convert_tokens_to_ids("<x>")
    ids = [vocab["the"], vocab["[SEP]"], vocab["[SEP]"], x, vocab["cat"], vocab["##s"], x]

    def text(**fields) -> str:
        return "".join(run(Detokenizer(wrap(tok), [vocab["the"]], SamplingParams(**fields)), ids)[0])

    assert text(skip_special_tokens=False) == " the [SEP] [SEP] <x> cats <x>"
    assert text(skip_special_tokens=False, spaces_between_special_tokens=False) == " the [SEP][SEP]<x> cats <x>"
    assert text(spaces_between_special_tokens=False) == text() == " the <x> cats <x>"


# -- through a worker ------------------------------------------------------------------------------

MODEL = "smollm2-135m"


def answer(client: TestClient, kind: str, stream: bool = False, model: str = MODEL, **fields) -> dict:
    """One choice's text, token ids and finish reason (and completions' logprob tokens): a whole
    answer's, or a stream's deltas joined."""
    body = {"model": model, "return_token_ids": True, "stream": stream, **fields}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if kind == "chat" else {"prompt": "Once upon a"}
    r = client.post("/v1/chat/completions" if kind == "chat" else "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    if not stream:
        c = r.json()["choices"][0]
        text = c["message"]["content"] if kind == "chat" else c["text"]
        tokens = (c["logprobs"] or {}).get("tokens")
        return {"text": text, "token_ids": c["token_ids"], "finish": c["finish_reason"], "logprob_tokens": tokens}
    got: dict = {"text": "", "token_ids": [], "finish": None, "logprob_tokens": None}
    for line in r.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for c in json.loads(line[len("data: ") :])["choices"]:
            got["text"] += (c["delta"].get("content") or "") if kind == "chat" else c["text"]
            got["token_ids"] += c.get("token_ids") or []
            if c["logprobs"] and kind == "completion":
                got["logprob_tokens"] = (got["logprob_tokens"] or []) + c["logprobs"]["tokens"]
            got["finish"] = c["finish_reason"] or got["finish"]
    return got


@pytest.fixture(scope="module")
def sim():
    """A sim worker (synthetic tokens, SmolLM2's tokenizer) whose steps take no time."""
    args = ["--executor", "sim", "--model", MODEL, "--num-blocks", "64", "--max-model-len", "512"]
    server = build_server(parser().parse_args(args))
    server.engine.executor.wait = lambda s: None
    try:
        with TestClient(server.app, raise_server_exceptions=False) as client:
            yield client
    finally:
        server.engine.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_stop_string_is_cut_before_or_kept_up_to_its_end(sim, kind, stream):
    free = answer(sim, kind, max_tokens=24, ignore_eos=True)["text"]
    stop = free[10:13]
    at = free.index(stop)
    for include, text in ((False, free[:at]), (True, free[: at + len(stop)])):
        got = answer(sim, kind, stream, max_tokens=24, ignore_eos=True, stop=stop, include_stop_str_in_output=include)
        assert (got["text"], got["finish"]) == (text, "stop")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_stop_token_ids_text_is_shown_only_with_the_stop_included(sim, kind, stream):
    """The token stays in token_ids either way; its text is the stop, left out as a stop string is
    unless included (vLLM's detokenizer skips a stop-terminated token's text)."""
    tokens = answer(sim, kind, max_tokens=12, ignore_eos=True)["token_ids"]
    k = next(k for k in range(2, 12) if tokens[k] not in tokens[:k])
    for include, upto in ((False, k), (True, k + 1)):
        got = answer(sim, kind, stream, max_tokens=12, stop_token_ids=[tokens[k]], include_stop_str_in_output=include)
        assert got["token_ids"] == tokens[: k + 1] and got["finish"] == "stop"
        assert got["text"] == answer(sim, kind, max_tokens=upto, ignore_eos=True)["text"]


@pytest.mark.parametrize(
    "field", ["include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens"]
)
@pytest.mark.parametrize("value", [1, 0.0, "false", [True]])
def test_the_fields_take_booleans_or_null_only(sim, field, value):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    for ok in (True, False, None):
        assert sim.post("/v1/completions", json={**body, field: ok}).status_code == 200
    r = sim.post("/v1/completions", json={**body, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field


@pytest.fixture(scope="module")
def llama(tiny_llama):
    """A worker on a tiny random Llama with SmolLM2's tokenizer: (client, tokenizer)."""
    from workers.config import EngineConfig
    from workers.engine import Engine
    from workers.executors.torch_runner import TorchRunner
    from workers.server import WorkerServer

    runner = TorchRunner(str(tiny_llama), 128, 4)
    tok = load_tokenizer(str(tiny_llama))
    engine = Engine(runner, tok, EngineConfig("m", 4, 128, 64, 8))
    engine.start()
    try:
        with TestClient(WorkerServer(engine, "m", runner.vocab_size).app, raise_server_exceptions=False) as client:
            yield client, tok
    finally:
        engine.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_special_tokens_show_unless_skipped(llama, kind, stream):
    """EOS (ignored) and a chat template marker, forced by logit_bias: their text is skipped by
    default and kept with skip_special_tokens false."""
    client, tok = llama
    eos, start = tok.eos_token_id, tok.convert_tokens_to_ids("<|im_start|>")
    for forced in (eos, start):
        fields = dict(model="m", max_tokens=3, temperature=0, ignore_eos=True, logit_bias={str(forced): 100})
        assert answer(client, kind, stream, **fields)["text"] == ""
        got = answer(client, kind, stream, skip_special_tokens=False, **fields)
        assert got["token_ids"] == [forced] * 3 and got["text"] == tok.convert_ids_to_tokens(forced) * 3


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_an_eos_that_stops_shows_its_text_only_kept_and_included(llama, kind, stream):
    client, tok = llama
    fields = dict(model="m", max_tokens=5, temperature=0, logit_bias={str(tok.eos_token_id): 100})
    for skip, include, text in ((False, False, ""), (True, True, ""), (False, True, tok.eos_token)):
        got = answer(client, kind, stream, skip_special_tokens=skip, include_stop_str_in_output=include, **fields)
        assert (got["text"], got["token_ids"], got["finish"]) == (text, [tok.eos_token_id], "stop")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_logprob_tokens_show_special_tokens_whether_skipped_or_not(llama, stream):
    """vLLM decodes each logprob token on its own, special tokens kept: skip_special_tokens
    changes the text only."""
    client, tok = llama
    fields = dict(model="m", max_tokens=2, temperature=0, ignore_eos=True, logprobs=1)
    fields |= {"logit_bias": {str(tok.eos_token_id): 100}}
    for skip in (True, False):
        got = answer(client, "completion", stream, skip_special_tokens=skip, **fields)
        assert got["logprob_tokens"] == [tok.eos_token] * 2


def test_after_a_prompt_ending_in_special_tokens_the_first_token_keeps_its_space():
    """Skipping special tokens, a prompt ending in more of them than the detokenizer's context
    (CONTEXT) left no text before the first output token, which then decoded as a text's start
    ('the'); vLLM decodes after the whole prompt (' the'). The context reaches past them."""
    from tokenizers.decoders import DecodeStream

    tok, vocab = wordpiece()
    prompt = [vocab["cat"], *[vocab["[SEP]"]] * (CONTEXT + 1)]
    out = [vocab["the"], vocab["cat"]]
    stream = DecodeStream(prompt, skip_special_tokens=True)  # vLLM's: primed with the whole prompt
    want = "".join(stream.step(tok.backend_tokenizer, t) or "" for t in out)
    assert want.startswith(" the")
    assert "".join(run(Detokenizer(tok, prompt, SamplingParams()), out)[0]) == want
