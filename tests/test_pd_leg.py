"""The gateway's prefill leg runs in the background: its caller's `done` is called exactly once
however it ends, so the prefill worker's in-flight count always closes. A prefill leg parses
wherever its decode leg does, whatever sampling fields the client sent."""

import asyncio
import functools

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from gateway import pd
from workers.model_store import load_tokenizer
from workers.protocol import parse_request
from workers.sampling_params import InvalidRequest
from workers.strict_json import loads

CTX = 96
VOCAB = 1000


class RaisingProxy:
    async def open(self, *args, **kw):
        raise ValueError("a bug, not a connection failure")


class HangingProxy:
    async def open(self, *args, **kw):
        await asyncio.sleep(3600)


def test_done_is_called_when_the_leg_raises_or_is_cancelled():
    async def main() -> list:
        got: list = []
        raised = pd.start_prefill(RaisingProxy(), "http://p", "/v1/completions", b"{}", {}, got.append)
        hung = pd.start_prefill(HangingProxy(), "http://q", "/v1/completions", b"{}", {}, got.append)
        await asyncio.sleep(0.01)
        hung.cancel()
        await asyncio.gather(raised, hung, return_exceptions=True)
        await asyncio.sleep(0)
        return got

    assert asyncio.run(main()) == [None, None]


@functools.cache
def tok():
    return load_tokenizer("smollm2-135m")


def fields(kind: str) -> st.SearchStrategy[dict]:
    """A client's sampling fields, each present or not, mostly in range."""
    token = st.integers(0, VOCAB - 1)
    common = {
        "max_tokens": st.integers(1, 40),
        "min_tokens": st.integers(0, 40),
        "stop": st.lists(st.text(min_size=1, max_size=3), max_size=3),
        "stop_token_ids": st.lists(token, max_size=3),
        "ignore_eos": st.booleans(),
        "logit_bias": st.dictionaries(token.map(str), st.floats(-150, 150), max_size=3),
        "allowed_token_ids": st.lists(token, max_size=3),
        "bad_words": st.lists(st.text(max_size=4), max_size=3),
        "presence_penalty": st.floats(-2, 2),
        "frequency_penalty": st.floats(-2, 2),
        "repetition_penalty": st.floats(0.1, 3),
        "min_p": st.floats(0, 1),
        "temperature": st.floats(0, 2),
        "top_k": st.integers(-1, 50),
        "seed": st.integers(0, 2**31),
        "stream": st.booleans(),
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
        "return_token_ids": st.booleans(),
        "include_stop_str_in_output": st.booleans(),
        "skip_special_tokens": st.booleans(),
        "spaces_between_special_tokens": st.booleans(),
    }
    if kind == "chat":
        own = {
            "max_completion_tokens": st.integers(1, 40),
            "logprobs": st.booleans(),
            "top_logprobs": st.integers(0, 5),
        }
    else:
        own = {"logprobs": st.integers(0, 5), "echo": st.booleans()}
    return st.fixed_dictionaries({}, optional={**common, **own})


def parse(body: dict, kind: str):
    return parse_request(loads(body), kind, tok(), CTX, VOCAB)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_a_prefill_leg_parses_wherever_its_decode_leg_does(data):
    """The prefill leg asks one token of the same prompt: no field the client may send (min_tokens
    above 1 was one) makes a worker refuse it, which would cost the decode worker its wait and a
    recompute."""
    kind = data.draw(st.sampled_from(["completion", "chat"]))
    body = {"model": "m", **data.draw(fields(kind))}
    body |= {"messages": [{"role": "user", "content": "hi there"}]} if kind == "chat" else {"prompt": [5, 6, 7, 8]}
    try:
        decode = parse(pd.decode_leg(body, 5000), kind)
    except InvalidRequest:
        assume(False)
    prefill = parse(pd.prefill_leg(body, "http://decode:1"), kind)
    assert prefill.params.max_tokens == 1 and not prefill.stream
    assert prefill.prompt_ids == decode.prompt_ids and prefill.kv_transfer == {"export_to": "http://decode:1"}
