"""gateway/forward.py without processes: an embeddings request's input tokens, counted exactly
in one batched tokenizer call, and off the event loop when the inputs are many."""

import asyncio
import json
from types import SimpleNamespace

import pytest
from starlette.requests import Request

from gateway import vllm_worker
from gateway.auth import SCOPE_KEY, Access, ApiKey
from gateway.forward import MAX_INPUTS, Forwarder
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
    """What Forwarder.embeddings uses of the gateway's intake: the tokens it charges."""

    def __init__(self):
        self.access, self.charged = Access(), []

    async def charge(self, request, tokens: int, embeddings: bool = False) -> None:
        self.charged.append(tokens)


def charged(tok: ModelTokenizer, texts: list[str], monkeypatch) -> tuple[int, int]:
    """(the tokens an embeddings request of `texts` is charged, how many counts went to a thread)."""
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
    body = {"model": MODEL, "input": texts}
    asyncio.run(fwd.embeddings(request, body, json.dumps(body).encode(), MODEL))
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
