"""gateway/forward.py and gateway/pooling.py without processes: an embeddings request's input tokens, counted exactly
in one batched tokenizer call, and off the event loop when the inputs are many."""

import asyncio
import json
from types import SimpleNamespace

import pytest
from starlette.requests import Request

from gateway import vllm_worker
from gateway.auth import LIMITED_PATHS, SCOPE_KEY, Access, ApiKey
from gateway.forward import PATHS, Forwarder
from gateway.pooling import MAX_INPUTS, POOLING_KINDS, pooling_inputs
from gateway.intake import ApiError
from gateway.tokenize import ModelTokenizer
from workers.model_store import load_tokenizer

MODEL = "smollm2-135m"
TEXTS = ["a", "", "hello world", "é ü 中文 x", "The cache holds the prefix of the prompt. " * 40, " leading space"]


@pytest.fixture(scope="module")
def tok() -> ModelTokenizer:
    return ModelTokenizer(MODEL, load_tokenizer(MODEL), 16)


def test_a_batched_count_is_the_tokenizers_own(tok):
    assert tok.count(TEXTS) == sum(len(tok.tokenizer.encode(t)) for t in TEXTS)
    assert tok.count(["a"] * MAX_INPUTS) == MAX_INPUTS * len(tok.tokenizer.encode("a"))


class Intake:
    """What Forwarder.pooling uses of the gateway's intake: the tokens it charges."""

    def __init__(self):
        self.access, self.charged = Access(), []

    async def charge(self, request, tokens: int, embeddings: bool = False) -> None:
        self.charged.append(tokens)


def charged(tok: ModelTokenizer, texts: list[str] | dict, monkeypatch, kind: str = "embeddings") -> tuple[int, int]:
    """(the tokens a `kind` request of `texts` (or that body) is charged, how many counts went to a thread)."""
    worker = SimpleNamespace(model=MODEL, healthy=True, kind=vllm_worker.KIND)
    tokenizers = SimpleNamespace(get=lambda name: asyncio.sleep(0, tok))
    intake = Intake()
    fwd = Forwarder(SimpleNamespace(workers={"w": worker}), None, None, None, None, None, intake, tokenizers)
    key = ApiKey("k", b"digest", "t", "tenant:t", tpm=10**9)
    request = Request({"type": "http", "method": "POST", "path": "/v1/embeddings", "headers": [], SCOPE_KEY: key})
    threads = []
    to_thread = asyncio.to_thread

    async def counted(fn, *args):
        threads.append(fn)
        return await to_thread(fn, *args)

    monkeypatch.setattr(asyncio, "to_thread", counted)
    body = texts if isinstance(texts, dict) else {"model": MODEL, "input": texts}
    asyncio.run(fwd.pooling(request, kind, body, json.dumps(body).encode(), MODEL))
    (tokens,) = intake.charged
    return tokens, len(threads)


def test_many_short_inputs_are_counted_off_the_event_loop(tok, monkeypatch):
    """2048 one-character inputs are 2048 characters, under the inline limit, yet their count
    is the tokenizer's work per input: a thread's, not the event loop's."""
    texts = ["a"] * MAX_INPUTS
    assert charged(tok, texts, monkeypatch) == (MAX_INPUTS * len(tok.tokenizer.encode("a")), 1)


def test_a_few_short_inputs_are_counted_inline(tok, monkeypatch):
    texts = TEXTS[:4]
    assert charged(tok, texts, monkeypatch) == (sum(len(tok.tokenizer.encode(t)) for t in texts), 0)


# -- vLLM's other pooling endpoints: their main inputs' shapes, checked before forwarding ------

DOC = {"content": [{"type": "text", "text": "a document"}]}  # vLLM's ScoreMultiModalParam
GOOD_POOLING = [
    ("classify", {"input": ["a", "b"]}, (["a", "b"], 0, False)),
    ("pooling", {"input": [[1, 2], [3]]}, ([], 3, False)),
    ("pooling", {"data": {"plugin": "input"}}, ([], 0, True)),
    ("embed", {"texts": ["a", "b"], "input_type": "search_query"}, (["a", "b"], 0, False)),
    ("embed", {"inputs": [DOC]}, ([], 0, True)),
    ("score", {"text_1": "q", "text_2": ["a", "b"]}, (["q", "q", "a", "b"], 0, False)),
    ("score_v1", {"queries": ["q1", "q2"], "documents": ["a", "b"]}, (["q1", "q2", "a", "b"], 0, False)),
    ("score", {"queries": "q", "items": [DOC]}, (["q"], 0, True)),
    ("score", {"data_1": "q", "data_2": "a"}, (["q", "a"], 0, False)),
    ("rerank", {"query": "q", "documents": ["a", "b", "c"], "top_n": 2}, (["q"] * 3 + ["a", "b", "c"], 0, False)),
    ("rerank_v1", {"query": "q", "documents": "a", "top_n": 0}, (["q", "a"], 0, False)),
    ("rerank_v2", {"query": "q", "documents": ["a", DOC]}, (["q", "q", "a"], 0, True)),
]
BAD_POOLING = [
    ("classify", {}, "input"),
    ("classify", {"input": ["a", 1]}, "input"),
    ("pooling", {"input": []}, "input"),
    ("embed", {}, "texts"),
    ("embed", {"texts": "a"}, "texts"),
    ("embed", {"texts": ["a", 1]}, "texts"),
    ("embed", {"images": ["x"] * 2049}, "images"),
    ("embed", {"inputs": [{"text": "no content"}]}, "inputs"),
    ("score", {}, "text_1"),
    ("score", {"text_1": "q"}, "text_2"),
    ("score", {"queries": ["q"]}, "documents"),
    ("score_v1", {"text_1": 5, "text_2": "a"}, "text_1"),
    ("score", {"text_1": "q", "text_2": []}, "text_2"),
    ("score", {"text_1": "q", "text_2": ["a"] * 2049}, "text_2"),
    ("score", {"data_1": "q", "data_2": [{"text": "no content"}]}, "data_2"),
    ("rerank", {"documents": ["a"]}, "query"),
    ("rerank", {"query": ["q"], "documents": ["a"]}, "query"),
    ("rerank_v1", {"query": "q"}, "documents"),
    ("rerank_v2", {"query": "q", "documents": ["a", 1]}, "documents"),
    ("rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
    ("rerank", {"query": "q", "documents": ["a"], "top_n": "2"}, "top_n"),
    ("rerank", {"query": "q", "documents": ["a"], "top_n": True}, "top_n"),
    ("rerank", {"query": "q", "documents": ["a"], "user": 5}, "user"),
    ("score", {"text_1": "q", "text_2": "a", "cache_salt": 7}, "cache_salt"),
]


@pytest.mark.parametrize("kind, body, inputs", GOOD_POOLING)
def test_a_pooling_bodys_inputs_are_what_its_key_is_charged(kind, body, inputs):
    """A score's or rerank's texts are its pairs' (a query paired with N documents counts N
    times); objects (multimodal parts, a plugin's data) are estimated by bytes."""
    assert pooling_inputs(kind, body) == inputs


@pytest.mark.parametrize("kind, body, param", BAD_POOLING)
def test_a_bad_pooling_shape_names_its_param(kind, body, param):
    with pytest.raises(ApiError) as e:
        pooling_inputs(kind, body)
    assert e.value.status == 400 and e.value.param == param, str(e.value)


def test_every_pooling_path_is_a_keys_rate_limited_path():
    assert {PATHS[k] for k in POOLING_KINDS} <= LIMITED_PATHS
    assert len(POOLING_KINDS) == 9


def test_a_rerank_is_charged_for_its_pairs(tok, monkeypatch):
    body = {"model": MODEL, "query": "what holds the prefix", "documents": ["the cache", "a tree"]}
    expected = sum(len(tok.tokenizer.encode(t)) for t in [body["query"]] * 2 + body["documents"])
    assert charged(tok, body, monkeypatch, "rerank") == (expected, 0)
