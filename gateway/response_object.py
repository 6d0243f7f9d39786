"""The Responses API's answer for a model of kvgate's workers, as vLLM 0.32 and OpenAI write it:
the Response object (`object: "response"`), its one output message, its usage, and the
request's parameters echoed. Built from what a chat completion told (gateway/response_chat.py)."""

import time
import uuid
from dataclasses import dataclass

from gateway.response_request import CreateRequest

COMPLETED, INCOMPLETE, FAILED, IN_PROGRESS = "completed", "incomplete", "failed", "in_progress"
DEFAULT_TEMPERATURE = DEFAULT_TOP_P = 1.0  # OpenAI's, which a worker samples with where its model sets none


def new_response_id() -> str:
    """A response's id: `resp_` and 32 hex digits, as vLLM names its own."""
    return "resp_" + uuid.uuid4().hex


def new_message_id() -> str:
    return "msg_" + uuid.uuid4().hex


def status_of(finish_reason: str | None) -> str:
    """A response's status by its chat's finish reason: `length` ran out of max_output_tokens
    (incomplete), `stop` completed it, anything else (an error, an abort) failed it."""
    if finish_reason == "length":
        return INCOMPLETE
    return COMPLETED if finish_reason == "stop" else FAILED


@dataclass(frozen=True)
class Usage:
    """A response's token counts, from its chat's usage. `cache_write_tokens` (vLLM's and
    OpenAI's, which the OpenAI SDK's types require) is 0: a chat's usage reports no cache writes."""

    input_tokens: int
    cached_tokens: int
    output_tokens: int

    @staticmethod
    def from_chat(usage: object) -> "Usage | None":
        """A chat answer's `usage` (prompt, completion and cached tokens), or None where it has
        none or one not well formed."""
        if not isinstance(usage, dict):
            return None
        details = usage.get("prompt_tokens_details")
        prompt, completion = _count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens"))
        cached = _count(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0
        if prompt is None or completion is None or cached is None:
            return None
        return Usage(prompt, cached, completion)

    def to_json(self) -> dict:
        return {
            "input_tokens": self.input_tokens,
            "input_tokens_details": {"cached_tokens": self.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": self.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.input_tokens + self.output_tokens,
        }


def _count(v: object) -> int | None:
    return v if type(v) is int and v >= 0 else None


def output_message(message_id: str, text: str, status: str) -> dict:
    """The one output item: the assistant's message (its status `completed` only when the
    response is)."""
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [output_text(text)],
    }


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def response_json(
    req: CreateRequest,
    response_id: str,
    created_at: int,
    status: str,
    output: list[dict],
    usage: Usage | None = None,
    error: str | None = None,
) -> dict:
    """The Response object of `req` in `status`, with its `output` items; `error` the message
    of a failed one."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "completed_at": int(time.time()) if status == COMPLETED else None,
        "error": {"code": "server_error", "message": error} if status == FAILED else None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == INCOMPLETE else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": None,
        "metadata": req.metadata,
        "model": req.model,
        "output": output,
        "parallel_tool_calls": req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "prompt": None,
        "reasoning": None,
        "service_tier": "auto",
        "store": req.store,
        "temperature": DEFAULT_TEMPERATURE if req.temperature is None else req.temperature,
        "text": {"format": {"type": "text"}},
        "tool_choice": req.tool_choice,
        "tools": [],
        "top_logprobs": 0,
        "top_p": DEFAULT_TOP_P if req.top_p is None else req.top_p,
        "truncation": "disabled",
        "usage": usage.to_json() if usage is not None else None,
        "user": req.user,
        "background": False,
    }
