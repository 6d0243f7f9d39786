"""The OpenAI answer shapes: ids, usage, streaming chunks, whole responses and logprobs, as
vLLM's OpenAI server writes them (requests: workers/protocol.py)."""

import time
import uuid

from workers.outputs import TokenLogprobs

LOGPROB_FLOOR = -9999.0  # what a -inf log-probability is reported as (JSON has no -Infinity; vLLM's value)


def new_id(kind: str) -> str:
    return id_prefix(kind) + uuid.uuid4().hex[:24]


def id_prefix(kind: str) -> str:
    """What an answer's id starts with, by its kind: vLLM puts it before a client's `request_id` too."""
    return "chatcmpl-" if kind == "chat" else "cmpl-"


def usage(prompt: int, completion: int, cached: int) -> dict:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def chunk(
    kind: str,
    rid: str,
    model: str,
    text: str,
    finish: str | None,
    first: bool = False,
    token_ids: list[int] | None = None,
    index: int = 0,
    logprobs: dict | None = None,
) -> dict:
    """One streaming chunk (`text_completion` or `chat.completion.chunk`) of choice `index`."""
    if kind == "chat":
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        obj = "text_completion"
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}


def choice(
    kind: str,
    index: int,
    text: str,
    finish: str | None,
    logprobs: dict | None = None,
    token_ids: list[int] | None = None,
) -> dict:
    """One choice of a whole answer."""
    if kind == "chat":
        out = {
            "index": index,
            "message": {"role": "assistant", "content": text},
            "logprobs": logprobs,
            "finish_reason": finish,
        }
    else:
        out = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
    if token_ids is not None:
        out["token_ids"] = token_ids
    return out


def full_response(kind: str, rid: str, model: str, choices: list[dict], use: dict) -> dict:
    obj = "chat.completion" if kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": choices, "usage": use}


def _logprob(x: float) -> float:
    return max(x, LOGPROB_FLOOR)


def chat_logprobs(entries: list[TokenLogprobs], decode) -> dict:
    """OpenAI's chat `logprobs` object for these output tokens; `decode(id)` is a token's text."""

    def item(token_id: int, lp: float) -> dict:
        text = decode(token_id)
        return {"token": text, "logprob": _logprob(lp), "bytes": list(text.encode())}

    return {
        "content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]
    }


def completion_logprobs(entries: list[TokenLogprobs], decode, offset: int) -> dict:
    """OpenAI's completions `logprobs` object for these output tokens, whose text starts at
    character `offset` of the choice's text. Each `top_logprobs` entry also holds the sampled
    token, as vLLM's do."""
    tokens = [decode(e.token_id) for e in entries]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    top = [{decode(t): _logprob(lp) for t, lp in [*e.top, (e.token_id, e.logprob)]} for e in entries]
    return {
        "text_offset": offsets,
        "token_logprobs": [_logprob(e.logprob) for e in entries],
        "tokens": tokens,
        "top_logprobs": top,
    }
