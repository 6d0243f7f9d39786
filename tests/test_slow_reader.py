"""A worker's answers to a reader that lags behind its engine, in-process (sim executor, the
SmolLM2 tokenizer, the ASGI app driven as uvicorn drives it): what piled up meanwhile comes as
one merged chunk per choice, with the same text and tokens as an answer read as it came.
Timing is never asserted: the reader waits until the engine has delivered everything."""

import asyncio
import json

import pytest

from workers import job_runner
from workers.outputs import RequestOutput
from tests.asgi_worker import MODEL, Call, server, until  # noqa: F401 (server: a fixture)

TOKENS = 40  # per choice


PATHS = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}


def request(kind: str, stream: bool) -> dict:
    """Two choices with their token ids: completions of two prompts, both started at once and
    echoed; chat's n=2 for one prompt, the second started on the first's first token."""
    body = {"model": MODEL, "max_tokens": TOKENS, "ignore_eos": True, "return_token_ids": True, "stream": stream}
    if kind == "chat":
        return {**body, "messages": [{"role": "user", "content": "hi"}], "n": 2}
    return {**body, "prompt": ["hi", "there"], "echo": True}


class SlowCall(Call):
    """A client that reads the stream's first chunk, then nothing until `resume`: the worker's
    send waits meanwhile, as uvicorn's does on a paused transport."""

    def __init__(self, app, path: str, body: dict):
        self.reading = asyncio.Event()
        super().__init__(app, path, body)

    async def _send(self, msg: dict) -> None:
        await self.sent.put(msg)
        if msg["type"] == "http.response.body" and msg.get("body"):
            await self.reading.wait()

    def resume(self) -> None:
        self.reading.set()


def choices_of(body: bytes) -> list[dict]:
    """The choices of a whole answer, without what differs between two answers (id, created)."""
    return json.loads(body)["choices"]


def text_of(part: dict) -> str:
    """A choice's text, of a whole answer or of a chunk, completions' or chat's."""
    if "text" in part:
        return part["text"]
    return (part.get("message") or part["delta"]).get("content", "")


def events_of(body: bytes) -> list[dict]:
    """A stream's choices, one per chunk, in order (the usage chunk has none)."""
    return [json.loads(line[6:])["choices"][0] for line in body.decode().splitlines() if line.startswith("data: {")]


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_stream_read_late_comes_as_one_chunk_per_choice_with_the_same_text(server, monkeypatch, kind):
    """The client reads the first chunk, then nothing until both choices have all their tokens:
    it then gets one chunk per choice for them (3 token-carrying chunks at most in all, not one
    per token: 80), whose text (echo included) and token ids are the whole answer's. The metrics
    still see every engine output alone, as it came: one observation per token."""
    seen: list[int] = []
    observe = server.metrics.observe
    monkeypatch.setattr(
        server.metrics, "observe", lambda out, clock: (seen.append(len(out.token_ids)), observe(out, clock))
    )

    async def go() -> tuple[bytes, bytes]:
        whole = await Call(server.app, PATHS[kind], request(kind, stream=False)).response()
        seen.clear()
        call = SlowCall(server.app, PATHS[kind], request(kind, stream=True))
        await until(lambda: len(seen) == 2 * TOKENS and server.in_flight == 0, "the engine delivered every token")
        call.resume()
        streamed = await call.response()
        assert whole[0] == streamed[0] == 200
        return whole[2], streamed[2]

    whole, streamed = asyncio.run(go())
    events = events_of(streamed)
    assert len([e for e in events if e.get("token_ids")]) <= 3
    assert seen == [1] * 2 * TOKENS
    for answer in choices_of(whole):
        mine = [e for e in events if e["index"] == answer["index"]]
        assert "".join(map(text_of, mine)) == text_of(answer)
        assert [t for e in mine for t in e.get("token_ids", ())] == answer["token_ids"]
        assert [e["finish_reason"] for e in mine] == [None] * (len(mine) - 1) + [answer["finish_reason"]]
        assert len(answer["token_ids"]) == TOKENS and answer["finish_reason"] == "length"


def test_a_whole_answer_read_after_the_engine_ran_ahead_is_unchanged(server, monkeypatch):
    """Every step's outputs reach the server's loop only once the engine has produced them all
    (the loop lagging behind it): the request reads them merged, and answers exactly what it
    answers when each output is read as it comes."""
    merged, held, deliver = [], [], job_runner.call_sinks
    add = RequestOutput.add

    def counted(self: RequestOutput, later: RequestOutput) -> None:
        merged.append(1)
        add(self, later)

    def ends_held() -> int:
        return sum(out.finish_reason is not None for batch in held for _, out in batch)

    async def answer(lagging: bool) -> tuple[int, list[dict], dict]:
        call = Call(server.app, PATHS["completion"], request("completion", stream=False))
        if lagging:
            await until(lambda: ends_held() == 2, "the engine delivered both choices' last outputs")
            for batch in held:
                deliver(batch)
        status, _, body = await call.response()
        return status, choices_of(body), json.loads(body)["usage"]

    prompt = asyncio.run(answer(lagging=False))
    monkeypatch.setattr(job_runner, "call_sinks", held.append)
    monkeypatch.setattr(RequestOutput, "add", counted)
    lagging = asyncio.run(answer(lagging=True))
    assert merged and lagging == prompt and prompt[0] == 200
