"""The OpenAI request shapes: parsing, validation, tokenization, errors (answers: workers/responses.py).

Pure (no torch): the gateway imports it too, so the gateway and the workers turn the same
request into the same token ids, and refuse the same bad input with the same 400, by running
the same code. Every field a client may send is checked for type and range before the prompt
is tokenized; a feature this server does not implement is refused, never silently ignored.
How a prompt becomes text (the prompt options, the chat template) is workers/prompt_options.py;
its output budget workers/budget.py, its bad words' tokens workers/bad_words.py, and the bound on
a prompt's length before it is tokenized workers/prompt_length.py.
"""

import re
from typing import cast
from dataclasses import dataclass, field, replace

from workers.chat_template import chat_messages
from workers.fields import as_list, flag, list_of, number
from workers.bad_words import bad_words_token_ids
from workers.budget import asked_budget, check_min_tokens, output_budget
from workers.generation_defaults import NEUTRAL, GenerationDefaults
from workers.prompt_length import surely_too_long
from workers.prompt_options import PromptOptions, prompt_options, prompt_text
from workers.sampling_params import LOGIT_BIAS_LIMIT, MAX_INT32, MAX_LOGIT_BIAS, InvalidRequest, SamplingParams
from workers.unsupported import refuse_unsupported

MAX_LOGPROBS = 20  # vLLM's default max_logprobs, OpenAI's top_logprobs limit
MAX_N = 128  # completions per prompt
MAX_PROMPTS = 1024  # prompts in one completions request
MAX_CHOICES = 1024  # prompts x n
# vLLM's `session_id`: the chat session a request belongs to, which the gateway's policies see
# (as they see `x-session-id`); it changes nothing of the answer, so the workers only check it.
MAX_SESSION_ID = 256
# A client's own id of its request (the `x-request-id` header, vLLM's body `request_id`): it is only
# shown (the answer's `id`, the x-request-id response header) and logged, never a key of engine or
# gateway state. Printable ASCII without spaces, as a header value and a log line may hold safely;
# 128 characters hold any UUID (vLLM's own are 32) behind a prefix.
MAX_CLIENT_ID = 128
CLIENT_ID = re.compile(rf"[!-~]{{1,{MAX_CLIENT_ID}}}")
# On a whole (non-streaming) answer: ms from the worker's receipt of the request to its first
# token, which the gateway adds to its own time before sending to get the client's TTFT.
TTFT_HEADER = "x-kvgate-ttft-ms"


@dataclass
class ParsedRequest:
    """A checked request. `prompts` are all its prompts (a completions request may send a list),
    `prompt_ids` the first; each prompt gets `n` completions, choice `i * n + j` being prompt i's
    j-th. `echo_texts` (completions' `echo`) are the prompts' texts that start their choices."""

    kind: str
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    return_token_ids: bool
    kv_transfer: dict
    cache_salt: str | None = None
    prompts: list[list[int]] = field(default_factory=list)
    n: int = 1
    echo_texts: list[str] | None = None
    client_request_id: str | None = None  # vLLM's body `request_id`: shown to its client, never a key
    # each choice's budget as asked (a chat's default where none), under the operator's cap, before
    # the context cut `params.max_tokens` holds: what a key's tokens per minute are charged for
    asked_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.prompts:
            self.prompts = [self.prompt_ids]

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))


def error_body(
    message: str, type_: str = "invalid_request_error", code: str | None = None, param: str | None = None
) -> dict:
    """The OpenAI error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def parse_request(
    body: object,
    kind: str,
    tokenizer,
    max_model_len: int,
    vocab_size: int | None = None,
    given: list[list[int]] | None = None,
    defaults: GenerationDefaults = NEUTRAL,
) -> ParsedRequest:
    """Validate an OpenAI completions/chat body into token ids and sampling parameters.

    Fields are checked before the prompt is tokenized, and a prompt that must be too long for
    `max_model_len` is refused before it is tokenized whole (`surely_too_long`). `given`: the
    prompts' ids as the gateway tokenized them with this very tokenizer (workers/given_ids.py),
    used instead of tokenizing again."""
    body = _object(body, kind)
    stream, include_usage, return_token_ids = _options(body)
    asked = asked_budget(body, kind)
    n, echo = _choices(body, kind)
    params = sampling_params(body, asked or 1, vocab_size, kind, defaults, tokenizer)
    kv, salt = _kv_transfer(body), checked_cache_salt(body)
    prompts, texts = [], []
    checked = _prompts(body, kind, vocab_size)
    options = prompt_options(body, kind, checked[0] if kind == "chat" else None)
    if given is not None and len(given) != len(checked):
        raise InvalidRequest(f"'kv_prompt_ids' holds {len(given)} prompts; the request {len(checked)}", "kv_prompt_ids")
    for i, prompt in enumerate(checked):
        own_ids = kind != "chat" and isinstance(prompt, list)  # a client's own token ids stay its own
        if given is not None and not own_ids:
            ids, text = given[i], prompt if isinstance(prompt, str) else None
        else:
            ids, text = prompt_ids(prompt, kind, tokenizer, max_model_len, options)
        prompts.append(ids)
        texts.append(text)
    asked, budget = output_budget(body, kind, asked, [len(ids) for ids in prompts], max_model_len, defaults, params)
    if kv and len(prompts) * n > 1:
        raise InvalidRequest("'kv_transfer' takes one prompt and n=1", "kv_transfer")
    echo_texts = [tokenizer.decode(ids) if t is None else t for ids, t in zip(prompts, texts)] if echo else None
    return ParsedRequest(
        kind,
        body.get("model") or "",
        prompts[0],
        replace(params, max_tokens=budget),
        stream,
        include_usage,
        return_token_ids,
        kv,
        salt,
        prompts,
        n,
        echo_texts,
        body.get("request_id"),
        asked,
    )


def check_request(body: object, kind: str) -> None:
    """Everything `parse_request` checks that needs no tokenizer (for a gateway without one)."""
    body = _object(body, kind)
    _options(body)
    _choices(body, kind)
    asked = asked_budget(body, kind)
    params = sampling_params(body, asked or 1, None, kind)
    if asked is not None or kind != "chat":
        check_min_tokens(params, asked or 16)
    _kv_transfer(body)
    checked_cache_salt(body)
    checked = _prompts(body, kind, None)
    prompt_options(body, kind, checked[0] if kind == "chat" else None)


def _object(body: object, kind: str) -> dict:
    """The body as a dict whose top-level fields outside the sampling parameters are sound."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    refuse_unsupported(body, kind)
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise InvalidRequest("'model' must be a string", "model")
    for name in ("user", "session_id"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise InvalidRequest(f"'{name}' must be a string", name)
    if len(body.get("session_id") or "") > MAX_SESSION_ID:
        raise InvalidRequest(f"'session_id' is longer than {MAX_SESSION_ID} characters", "session_id")
    rid = body.get("request_id")
    if rid is not None and not (isinstance(rid, str) and CLIENT_ID.fullmatch(rid)):
        raise InvalidRequest(
            f"'request_id' must be a string of 1 to {MAX_CLIENT_ID} printable ASCII characters without spaces",
            "request_id",
        )
    return body


def _choices(body: dict, kind: str) -> tuple[int, bool]:
    """(n, echo): completions per prompt, and whether each completion starts with its prompt."""
    n = number(body, "n", 1, int)
    if not 1 <= n <= MAX_N:
        raise InvalidRequest(f"'n' must be an integer in [1, {MAX_N}]", "n")
    echo = flag(body, "echo") if kind == "completion" else False
    if echo and body.get("logprobs") is not None:
        raise InvalidRequest(
            "'echo' with 'logprobs' needs the prompt's log-probabilities, which kvgate's workers do not compute",
            "echo",
            "unsupported_parameter",
        )
    return n, echo


def _logprobs(body: dict, kind: str) -> int | None:
    """How many top alternatives to report per output token (None: no logprobs). Completions
    take `logprobs: N`; chat takes `logprobs: true` and `top_logprobs: N`."""
    if kind == "completion":
        k = number(body, "logprobs", None, int)
    else:
        k = number(body, "top_logprobs", None, int)
        if not flag(body, "logprobs"):
            if k:
                raise InvalidRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
            return None
        k = k or 0
    name = "logprobs" if kind == "completion" else "top_logprobs"
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise InvalidRequest(f"'{name}' must be an integer in [0, {MAX_LOGPROBS}]", name)
    return k


def _options(body: dict) -> tuple[bool, bool, bool]:
    """(stream, stream_options.include_usage, return_token_ids). `stream_options` only with
    `stream`: vLLM refuses it otherwise, and a whole answer has no usage event to ask for."""
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise InvalidRequest("'stream_options' must be an object", "stream_options")
    stream, include_usage = flag(body, "stream"), flag(opts or {}, "include_usage", "stream_options")
    if opts and not stream:
        raise InvalidRequest("'stream_options' can only be given with 'stream': true", "stream_options")
    return stream, include_usage, flag(body, "return_token_ids")


def sampling_params(
    body: dict,
    max_tokens: int,
    vocab_size: int | None = None,
    kind: str = "completion",
    defaults: GenerationDefaults = NEUTRAL,
    tokenizer=None,
) -> SamplingParams:
    """The body's sampling fields, each type- and range-checked; an absent or null one takes
    the model's default, else OpenAI's. `bad_words` are tokenized with `tokenizer` (without
    one, only checked)."""
    top_k = number(body, "top_k", defaults.value("top_k", 0), int)
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=number(body, "temperature", defaults.value("temperature", 1.0)),
        top_p=number(body, "top_p", defaults.value("top_p", 1.0)),
        top_k=0 if top_k == -1 else top_k,
        seed=number(body, "seed", None, int),
        stop=as_list(body.get("stop"), "stop", str),
        stop_token_ids=as_list(body.get("stop_token_ids"), "stop_token_ids", int),
        ignore_eos=flag(body, "ignore_eos"),
        logprobs=_logprobs(body, kind),
        presence_penalty=number(body, "presence_penalty", defaults.value("presence_penalty", 0.0)),
        frequency_penalty=number(body, "frequency_penalty", defaults.value("frequency_penalty", 0.0)),
        repetition_penalty=number(body, "repetition_penalty", defaults.value("repetition_penalty", 1.0)),
        min_p=number(body, "min_p", defaults.value("min_p", 0.0)),
        min_tokens=number(body, "min_tokens", 0, int),
        logit_bias=_logit_bias(body.get("logit_bias")),
        include_stop_str_in_output=flag(body, "include_stop_str_in_output"),
        skip_special_tokens=flag(body, "skip_special_tokens", default=True),
        spaces_between_special_tokens=flag(body, "spaces_between_special_tokens", default=True),
        allowed_token_ids=list_of(body.get("allowed_token_ids"), "allowed_token_ids", int, "token ids"),
        bad_words=tuple(dict.fromkeys(list_of(body.get("bad_words"), "bad_words", str, "strings") or ())),
    ).validate(vocab_size)
    if vocab_size is not None and any(t >= vocab_size for t in params.stop_token_ids):
        raise InvalidRequest(f"stop_token_ids must be in [0, {vocab_size})", "stop_token_ids")
    if vocab_size is not None and any(t >= vocab_size for t, _ in params.logit_bias):
        raise InvalidRequest(f"logit_bias token ids must be in [0, {vocab_size})", "logit_bias")
    if tokenizer is not None and params.bad_words:
        return replace(params, bad_words_token_ids=bad_words_token_ids(params.bad_words, tokenizer, vocab_size))
    return params


def _logit_bias(v: object) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias` as vLLM reads it: an object of token id (a string `int()` takes)
    -> bias (a number, clamped to [-100, 100]), the last of equal ids kept; sorted pairs."""
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise InvalidRequest("'logit_bias' must be an object of token ids to numbers", "logit_bias")
    if len(v) > MAX_LOGIT_BIAS:
        raise InvalidRequest(f"'logit_bias' takes at most {MAX_LOGIT_BIAS} token ids", "logit_bias")
    bias: dict[int, float] = {}
    for key in v:
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise InvalidRequest(f"'logit_bias' key {str(key)[:32]!r} is not a token id", "logit_bias") from None
        b = number(v, key, None, param="logit_bias")
        if b is None:
            raise InvalidRequest(f"'logit_bias' of token {token} must be a number", "logit_bias")
        bias[token] = min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, b))
    if any(t < 0 for t in bias):
        raise InvalidRequest(f"'logit_bias' token ids must be in [0, {MAX_INT32}]", "logit_bias")
    return tuple(sorted(bias.items()))


def _kv_transfer(body: dict) -> dict:
    """The internal P/D extension: {"export_to": decode worker URL} or {"wait_ms": N}."""
    kv = body.get("kv_transfer")
    if kv is None:
        return {}
    if not isinstance(kv, dict) or not set(kv) <= {"export_to", "wait_ms"}:
        raise InvalidRequest("'kv_transfer' takes only 'export_to' and 'wait_ms'", "kv_transfer")
    if "export_to" in kv and not (isinstance(kv["export_to"], str) and kv["export_to"].startswith("http")):
        raise InvalidRequest("'kv_transfer.export_to' must be an http(s) URL", "kv_transfer")
    if not 0 <= number(kv, "wait_ms", 0.0, param="kv_transfer") <= 60000:
        raise InvalidRequest("'kv_transfer.wait_ms' must be in [0, 60000]", "kv_transfer")
    return kv


MAX_CACHE_SALT = 256


def checked_cache_salt(body: dict) -> str | None:
    """vLLM's `cache_salt`: requests share cached blocks only with requests of the same salt.
    The one rule for a client's salt (completions, chat, and embeddings at the gateway);
    raises InvalidRequest."""
    salt = body.get("cache_salt")
    if salt is not None and not (isinstance(salt, str) and len(salt) <= MAX_CACHE_SALT):
        raise InvalidRequest(f"'cache_salt' must be a string of at most {MAX_CACHE_SALT} characters", "cache_salt")
    return salt or None


def prompt_ids(
    prompt: str | list[int] | list[dict], kind: str, tokenizer, max_model_len: int, options: PromptOptions
) -> tuple[list[int], str | None]:
    """(token ids, text) of one checked prompt: chat messages (checked by `chat_messages`) or
    text as `prompt_text` makes it, tokenized as `options` ask; token ids as given (their text
    is None)."""
    if kind != "chat" and isinstance(prompt, list):
        return cast(list[int], prompt), None
    param = "messages" if kind == "chat" else "prompt"
    text = prompt_text(cast(str | list[dict], prompt), tokenizer, options)
    if surely_too_long(text, tokenizer, max_model_len):
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens; this prompt "
            f"of {len(text)} characters is longer.",
            param,
            "context_length_exceeded",
        )
    ids = tokenizer.encode(text, add_special_tokens=options.add_special_tokens)
    if not ids:
        raise InvalidRequest("the prompt is empty", param)
    return ids, text


def _prompts(body: dict, kind: str, vocab_size: int | None) -> list:
    """The request's prompts, each checked: chat's messages (one prompt), or a completion's
    prompt: a string, a list of token ids, or a list of either (a batch)."""
    if kind == "chat":
        return [chat_messages(body.get("messages"))]
    prompt = body.get("prompt")
    batch = isinstance(prompt, list) and bool(prompt) and all(isinstance(p, (str, list)) for p in prompt)
    if not batch or not isinstance(prompt, list):
        return [_prompt(prompt, vocab_size)]
    if len(prompt) > MAX_PROMPTS:
        raise InvalidRequest(f"at most {MAX_PROMPTS} prompts in one request", "prompt")
    if len(prompt) * number(body, "n", 1, int) > MAX_CHOICES:
        raise InvalidRequest(f"at most {MAX_CHOICES} completions (prompts x n) in one request", "n")
    return [_prompt(p, vocab_size) for p in prompt]


def _prompt(prompt: object, vocab_size: int | None) -> str | list[int]:
    """One completion prompt: a non-empty string or list of token ids."""
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        limit = vocab_size or MAX_INT32 + 1
        if not all(0 <= t < limit for t in prompt):
            raise InvalidRequest(f"prompt token ids must be in [0, {limit})", "prompt")
        return prompt
    if prompt == "" or prompt == []:
        raise InvalidRequest("the prompt is empty", "prompt")
    raise InvalidRequest("'prompt' must be a string, a list of token ids, or a list of either", "prompt")


def tokenize_body(body: dict, tokenizer, max_model_len: int) -> tuple[list[int], bool]:
    """(token ids, whether their strings are asked for) of a vLLM /tokenize body: `messages`
    through the chat template, else `prompt` text, with the options the completion and chat
    endpoints take (`prompt_options`), so /tokenize counts a prompt as they do; the fields they
    refuse (`_object`: workers/unsupported.py) it refuses too, so no option is silently dropped."""
    kind = "chat" if body.get("messages") is not None else "completion"
    body = _object(body, kind)
    strs = flag(body, "return_token_strs")
    prompt: str | list[dict]
    if kind == "chat":
        prompt = chat_messages(body["messages"])
    elif isinstance(body.get("prompt"), str):
        prompt = body["prompt"]
    else:
        raise InvalidRequest("'prompt' must be a string (or send 'messages')", "prompt")
    options = prompt_options(body, kind, prompt if isinstance(prompt, list) else None)
    text = prompt_text(prompt, tokenizer, options)
    if surely_too_long(text, tokenizer, 8 * max_model_len):
        raise InvalidRequest(
            f"this prompt is far longer than the model's {max_model_len} tokens", "prompt", "context_length_exceeded"
        )
    return tokenizer.encode(text, add_special_tokens=options.add_special_tokens), strs
