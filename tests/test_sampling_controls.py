"""presence_penalty, frequency_penalty, repetition_penalty, min_p, min_tokens and logit_bias as a
hostile client sends them: parsed into SamplingParams with vLLM's ranges, anything else a 400
naming the field, alike in parse_request, check_request (the gateway without a tokenizer) and a
sim worker's HTTP answers, which accept every valid one for completions and chat."""

import functools
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.json_values import json_values
from starlette.testclient import TestClient

from workers.config import EngineConfig
from workers.engine import Engine
from workers.executors.sim import SimExecutor
from workers.kv.cost_model import CostModel
from workers.model_store import load_tokenizer
from workers.protocol import check_request, parse_request
from workers.sampling_params import InvalidRequest
from workers.server import WorkerServer
from workers.strict_json import loads

CTX = 64
VOCAB = 1000


@functools.cache
def tok():
    return load_tokenizer("smollm2-135m")


def parse(body: dict, kind: str = "completion"):
    body = {"prompt": [5, 6, 7], "messages": [{"role": "user", "content": "hi"}], **body}
    if kind == "completion":
        del body["messages"]
    else:
        del body["prompt"]
    return parse_request(loads(json.dumps(body).encode()), kind, tok(), CTX, VOCAB)


def refused(body: dict, kind: str = "completion") -> InvalidRequest:
    with pytest.raises(InvalidRequest) as e:
        parse(body, kind)
    return e.value


def test_the_fields_become_the_params():
    p = parse(
        {
            "presence_penalty": -2,
            "frequency_penalty": 1.5,
            "repetition_penalty": 1.3,
            "min_p": 0.05,
            "min_tokens": 4,
            "logit_bias": {"9": 2, "3": -100},
        }
    ).params
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p) == (-2.0, 1.5, 1.3, 0.05)
    assert p.min_tokens == 4 and p.logit_bias == ((3, -100.0), (9, 2.0))
    assert p.penalized and p.processes_logits(10)


def test_logit_bias_reads_as_vllm_reads_it():
    """Keys as Python's int() reads them (the last of equal ids wins), biases clamped to
    [-100, 100] and not refused (vLLM clamps them); null and {} ask for nothing."""
    assert parse({"logit_bias": {"007": 1, "7": 3, " 8 ": 500, "9": -1e9}}).params.logit_bias == (
        (7, 3.0),
        (8, 100.0),
        (9, -100.0),
    )
    for empty in (None, {}):
        assert parse({"logit_bias": empty}).params.logit_bias == ()
    assert not parse({"logit_bias": {}, "presence_penalty": 0, "repetition_penalty": 1}).params.processes_logits(0)


@pytest.mark.parametrize(
    "field, value",
    [
        ("presence_penalty", 2.0001),
        ("presence_penalty", -3),
        ("presence_penalty", "0.5"),
        ("frequency_penalty", False),
        ("frequency_penalty", [1]),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -0.5),
        ("repetition_penalty", True),
        ("min_p", 2),
        ("min_p", -0.01),
        ("min_p", {}),
        ("min_tokens", -1),
        ("min_tokens", 0.5),
        ("min_tokens", "3"),
        ("min_tokens", 17),  # more than a completion's default max_tokens (16)
        ("min_tokens", 10**30),
        ("logit_bias", {"a": 1}),
        ("logit_bias", {"1.5": 1}),
        ("logit_bias", {"": 1}),
        ("logit_bias", {"-3": 1}),
        ("logit_bias", {str(VOCAB): 1}),  # past the model's vocabulary
        ("logit_bias", {"1": None}),
        ("logit_bias", {"1": True}),
        ("logit_bias", {"1": "2"}),
        ("logit_bias", {"1": [2]}),
        ("logit_bias", [1, 2]),
        ("logit_bias", "x"),
        ("logit_bias", {"9" * 5000: 1}),
        ("logit_bias", {str(i): 1 for i in range(1025)}),
    ],
)
@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_bad_value_is_a_400_naming_its_field(field, value, kind):
    body = {field: value, "max_tokens": 16} if kind == "chat" and field == "min_tokens" else {field: value}
    assert refused(body, kind).param == field


def test_min_tokens_is_held_to_the_completion_budget():
    """vLLM's rule: at most max_tokens; unset, a completion's 16 or what the context leaves a chat."""
    assert parse({"min_tokens": 5, "max_tokens": 5}).params.min_tokens == 5
    assert refused({"min_tokens": 6, "max_tokens": 5}).param == "min_tokens"
    assert refused({"min_tokens": 6, "max_completion_tokens": 5}, "chat").param == "min_tokens"
    left = CTX - len(parse({}, "chat").prompt_ids)
    assert parse({"min_tokens": left}, "chat").params.max_tokens == left
    assert refused({"min_tokens": left + 1}, "chat").param == "min_tokens"


def test_check_request_refuses_the_same_without_a_tokenizer():
    check_request({"prompt": [1], "min_tokens": 16, "logit_bias": {str(10**6): 1}}, "completion")  # no vocab here
    check_request({"messages": [{"role": "user", "content": "x"}], "min_tokens": 999}, "chat")  # budget unknown
    for body in (
        {"prompt": [1], "min_tokens": 17},
        {"prompt": [1], "presence_penalty": 9},
        {"prompt": [1], "logit_bias": {"-1": 0}},
        {"prompt": [1], "logit_bias": {str(2**31): 0}},
    ):
        with pytest.raises(InvalidRequest):
            check_request(body, "completion")


@settings(max_examples=200, deadline=None)
@given(
    field=st.sampled_from(
        ["presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "logit_bias"]
    ),
    value=json_values(6, 3),
)
def test_any_value_parses_or_is_a_400_naming_its_field(field, value):
    try:
        p = parse({field: value}).params
    except InvalidRequest as e:
        assert e.param == field
        return
    assert math.isfinite(p.presence_penalty + p.frequency_penalty + p.repetition_penalty + p.min_p)
    assert all(0 <= t < VOCAB and -100 <= b <= 100 for t, b in p.logit_bias)


@pytest.fixture(scope="module")
def client():
    sim = SimExecutor(CostModel(), VOCAB, (2,), 4096, lambda s: None, first_token_id=3)
    eng = Engine(sim, tok(), EngineConfig("m", block_size=4, num_blocks=64, max_batched_tokens=64, max_num_seqs=8))
    eng.start()
    with TestClient(WorkerServer(eng, "m", vocab_size=VOCAB).app, raise_server_exceptions=False) as c:
        yield c


CONTROLS = {
    "presence_penalty": 0.5,
    "frequency_penalty": -0.5,
    "repetition_penalty": 1.2,
    "min_p": 0.1,
    "min_tokens": 3,
    "logit_bias": {"5": -100},
}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_sim_worker_serves_the_controls_and_refuses_bad_ones_by_name(client, path):
    base = {"model": "m", "max_tokens": 4, "prompt": [5, 6, 7], "messages": [{"role": "user", "content": "hi"}]}
    r = client.post(path, json={**base, **CONTROLS})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 3
    r = client.post(path, json={**base, "logit_bias": {str(VOCAB): 1}})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "logit_bias" and error["type"] == "invalid_request_error"
