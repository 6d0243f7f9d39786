"""vLLM's stop rules in the answer's text: of the stop strings one token completes, the one that
ends first stops the request; a stop token's own text is left out, as a stop string is. First the
detokenizer's rules against a plain statement of vLLM's, then through a sim worker. A stream's
deltas always add up to the whole answer's text."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from workers.cli import build_server, parser
from workers.detokenizer import Detokenizer
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
    """vLLM's rules, plainly: each token's text is appended (a special one skipped, a last stop
    token's left out); past `min_tokens` tokens, of the stop strings ending in the new text the one
    ending first (the first listed of equal ends) stops the request, the text cut before it."""
    text = ""
    for k, t in enumerate(ids):
        if stop_token and k == len(ids) - 1:
            return text, None
        before = len(text)
        text += Pieces().decode([t])
        if k + 1 <= params.min_tokens:
            continue
        ends = [
            (at + len(s), i, at)
            for i, s in enumerate(params.stop)
            for at in range(len(text) - len(s) + 1)
            if text.startswith(s, at) and at + len(s) > before
        ]
        if ends:
            return text[: min(ends)[2]], k
    return text, None


@settings(max_examples=500, deadline=None)
@given(
    ids=st.lists(st.integers(0, SPECIAL), max_size=16),
    cuts=st.lists(st.tuples(st.integers(0, 30), st.integers(1, 4)), max_size=3),
    other=st.lists(st.text("abc<s>", min_size=1, max_size=4), max_size=1),
    min_tokens=st.integers(0, 4),
    stop_token=st.booleans(),
)
def test_the_text_and_its_deltas_follow_vllms_rules(ids, cuts, other, min_tokens, stop_token):
    """Stop strings mostly cut from the text itself, so that they meet, overlap and nest."""
    full = Pieces().decode(ids)
    stop = tuple(full[at : at + n] for at, n in cuts if full[at : at + n]) + tuple(other)
    params = SamplingParams(stop=stop, min_tokens=min_tokens)
    d = Detokenizer(Pieces(), [], params)
    deltas, stopped = run(d, ids, stop_token)
    assert ("".join(deltas), stopped) == reference(ids, params, stop_token)
    assert "".join(deltas) == d.text  # nothing streamed was cut away later


def test_one_token_completing_two_stop_strings_stops_at_the_one_ending_first():
    """Token "abc" completes both: "b" ends first, so the text is "a" (vLLM's), not "" (as when
    the stop string that starts first won)."""
    assert run(Detokenizer(Pieces(), [], SamplingParams(stop=("abc", "b"))), [4]) == (["a"], 0)


def test_a_stop_tokens_text_is_left_out():
    assert run(Detokenizer(Pieces(), [], SamplingParams()), [2, 0], stop_token=True) == (["ab", ""], None)


# -- through a worker ------------------------------------------------------------------------------

MODEL = "smollm2-135m"


def answer(client: TestClient, kind: str, stream: bool = False, **fields) -> dict:
    """One choice's text, token ids and finish reason: a whole answer's, or a stream's deltas
    joined."""
    body = {"model": MODEL, "return_token_ids": True, "stream": stream, **fields}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if kind == "chat" else {"prompt": "Once upon a"}
    r = client.post("/v1/chat/completions" if kind == "chat" else "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    if not stream:
        c = r.json()["choices"][0]
        text = c["message"]["content"] if kind == "chat" else c["text"]
        return {"text": text, "token_ids": c["token_ids"], "finish": c["finish_reason"]}
    got: dict = {"text": "", "token_ids": [], "finish": None}
    for line in r.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for c in json.loads(line[len("data: ") :])["choices"]:
            got["text"] += (c["delta"].get("content") or "") if kind == "chat" else c["text"]
            got["token_ids"] += c.get("token_ids") or []
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
def test_a_stop_token_ids_text_is_left_out(sim, kind, stream):
    """The token stays in token_ids; its text is the stop, left out as a stop string is (vLLM's
    detokenizer skips a stop-terminated token's text)."""
    tokens = answer(sim, kind, max_tokens=12, ignore_eos=True)["token_ids"]
    k = next(k for k in range(2, 12) if tokens[k] not in tokens[:k])
    got = answer(sim, kind, stream, max_tokens=12, stop_token_ids=[tokens[k]])
    assert got["token_ids"] == tokens[: k + 1] and got["finish"] == "stop"
    assert got["text"] == answer(sim, kind, max_tokens=k, ignore_eos=True)["text"]
