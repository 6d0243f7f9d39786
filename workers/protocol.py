"""The OpenAI request/response shapes: parsing, tokenization, errors.

Pure (no torch): the gateway imports it too, so the gateway and the workers turn the same
request into the same token ids by running the same code.
"""
import time
import uuid
from dataclasses import dataclass

from workers.sampling_params import InvalidRequest, SamplingParams


@dataclass
class ParsedRequest:
    kind: str
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    return_token_ids: bool
    kv_transfer: dict
    cache_salt: str | None = None


def _kv_transfer(body: dict) -> dict:
    """The internal P/D extension: {"export_to": decode worker URL} or {"wait_ms": N}."""
    kv = body.get("kv_transfer") or {}
    if not isinstance(kv, dict) or not set(kv) <= {"export_to", "wait_ms"}:
        raise InvalidRequest("'kv_transfer' takes only 'export_to' and 'wait_ms'", "kv_transfer")
    if "export_to" in kv and not (isinstance(kv["export_to"], str) and kv["export_to"].startswith("http")):
        raise InvalidRequest("'kv_transfer.export_to' must be an http(s) URL", "kv_transfer")
    if not 0 <= _number(kv, "wait_ms", 0.0) <= 60000:
        raise InvalidRequest("'kv_transfer.wait_ms' must be in [0, 60000]", "kv_transfer")
    return kv


MAX_CACHE_SALT = 256


def _cache_salt(body: dict) -> str | None:
    """vLLM's `cache_salt`: requests share cached blocks only with requests of the same salt."""
    salt = body.get("cache_salt")
    if salt is not None and not (isinstance(salt, str) and len(salt) <= MAX_CACHE_SALT):
        raise InvalidRequest(f"'cache_salt' must be a string of at most {MAX_CACHE_SALT} characters",
                             "cache_salt")
    return salt or None


def error_body(message: str, type_: str = "invalid_request_error", code: str | None = None,
               param: str | None = None) -> dict:
    """The OpenAI error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _as_list(v, name: str, item_type: type) -> tuple:
    if v is None:
        return ()
    if isinstance(v, item_type):
        return (v,)
    if isinstance(v, list) and all(isinstance(x, item_type) for x in v):
        return tuple(v)
    raise InvalidRequest(f"'{name}' must be a {item_type.__name__} or a list of them", name)


def _number(body: dict, name: str, default, kind: type = float):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and v != int(v)):
        raise InvalidRequest(f"'{name}' must be a {kind.__name__}", name)
    return kind(v)


def prompt_ids(body: dict, kind: str, tokenizer) -> list[int]:
    """Token ids of the prompt: the chat template for chat, else text or ids as given."""
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and "role" in m for m in messages):
            raise InvalidRequest("'messages' must be a non-empty list of {role, content}", "messages")
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
    else:
        raise InvalidRequest("'prompt' must be a string or a list of token ids (batches are not supported)", "prompt")
    if not ids:
        raise InvalidRequest("the prompt is empty", "prompt")
    return ids


def parse_request(body: object, kind: str, tokenizer, max_model_len: int,
                  vocab_size: int | None = None) -> ParsedRequest:
    """Validate an OpenAI completions/chat body into token ids and sampling parameters."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    if _number(body, "n", 1, int) != 1:
        raise InvalidRequest("only n=1 is supported", "n")
    ids = prompt_ids(body, kind, tokenizer)
    if vocab_size is not None and any(t < 0 or t >= vocab_size for t in ids):
        raise InvalidRequest(f"prompt token ids must be in [0, {vocab_size})", "prompt")
    max_key = "max_completion_tokens" if kind == "chat" and "max_completion_tokens" in body else "max_tokens"
    default_max = max_model_len - len(ids) if kind == "chat" else 16
    max_tokens = _number(body, max_key, default_max, int)
    if len(ids) + max(max_tokens, 1) > max_model_len:
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} in the completion).",
            "max_tokens" if len(ids) < max_model_len else "prompt", "context_length_exceeded")
    params = SamplingParams(
        max_tokens=max_tokens, temperature=_number(body, "temperature", 1.0),
        top_p=_number(body, "top_p", 1.0), top_k=_number(body, "top_k", 0, int),
        seed=_number(body, "seed", None, int) if body.get("seed") is not None else None,
        stop=_as_list(body.get("stop"), "stop", str),
        stop_token_ids=_as_list(body.get("stop_token_ids"), "stop_token_ids", int),
        ignore_eos=bool(body.get("ignore_eos", False))).validate()
    opts = body.get("stream_options") or {}
    return ParsedRequest(kind, str(body.get("model", "")), ids, params, bool(body.get("stream", False)),
                         bool(isinstance(opts, dict) and opts.get("include_usage")),
                         bool(body.get("return_token_ids", False)), _kv_transfer(body), _cache_salt(body))


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt: int, completion: int, cached: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion, "prompt_tokens_details": {"cached_tokens": cached}}


def chunk(kind: str, rid: str, model: str, text: str, finish: str | None, first: bool = False,
          token_ids: list[int] | None = None) -> dict:
    """One streaming chunk (`text_completion` or `chat.completion.chunk`)."""
    if kind == "chat":
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}


def full_response(kind: str, rid: str, model: str, text: str, finish: str | None,
                  use: dict, token_ids: list[int] | None = None) -> dict:
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": None, "finish_reason": finish}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model,
            "choices": [choice], "usage": use}
