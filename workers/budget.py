"""A request's output budget, as vLLM 0.32 reads it: the budget asked (chat prefers
`max_completion_tokens`; none: the model's default for a chat, else 16), refused past the whole
context, under the operator's cap, then cut to what the context leaves. Pure: the gateway and the
workers read a budget by this one code (workers/protocol.py)."""

from workers.fields import number
from workers.generation_defaults import GenerationDefaults
from workers.sampling_params import InvalidRequest, SamplingParams


def budget_key(body: dict, kind: str) -> str:
    """The field that names the budget: a chat's `max_completion_tokens` where given, else `max_tokens`."""
    return "max_completion_tokens" if kind == "chat" and body.get("max_completion_tokens") is not None else "max_tokens"


def asked_budget(body: dict, kind: str) -> int | None:
    """The completion budget asked for, None if not given."""
    key = budget_key(body, kind)
    n = number(body, key, None, int)
    if n is not None and n < 1:
        raise InvalidRequest(f"'{key}' must be at least 1", key)
    return n


def output_budget(
    body: dict,
    kind: str,
    asked: int | None,
    lengths: list[int],
    max_model_len: int,
    defaults: GenerationDefaults,
    params: SamplingParams,
) -> tuple[int, int]:
    """(the budget asked, each choice's output budget), as vLLM 0.32 reads them: the budget
    asked (none: a chat's default, else 16 for a completion), refused past the context, under
    the operator's cap; then only what the shortest prompt's context leaves; a longer prompt's
    choice stops at the context (finish "length"), as vLLM's budget for it would. `min_tokens`
    must fit in the longest prompt's budget. Every prompt must leave room for one output token."""
    for n in lengths:
        check_context(n, max_model_len, "messages" if kind == "chat" else "prompt")
    if asked is None:
        asked = chat_budget(defaults, max_model_len - max(lengths)) if kind == "chat" else 16
    elif asked > max_model_len:
        key = budget_key(body, kind)
        raise InvalidRequest(
            f"{key}={asked} cannot be greater than max_model_len={max_model_len}. Please request fewer output tokens.",
            key,
            "context_length_exceeded",
        )
    asked = capped(defaults, asked)
    check_min_tokens(params, min(asked, max_model_len - max(lengths)))
    return asked, min(asked, max_model_len - min(lengths))


def chat_budget(defaults: GenerationDefaults, context_left: int) -> int:
    """A chat's budget when it asks for none: the model's default, at most what its context leaves."""
    return context_left if defaults.max_tokens is None else min(defaults.max_tokens, context_left)


def capped(defaults: GenerationDefaults, budget: int) -> int:
    """A request's budget under the cap the operator set, if any."""
    return budget if defaults.max_tokens_cap is None else min(budget, defaults.max_tokens_cap)


def check_context(n_prompt: int, max_model_len: int, param: str) -> None:
    """A prompt must leave room in the context for one output token."""
    if n_prompt >= max_model_len:
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
            f"contains {n_prompt} input tokens, which leaves no room for an output token.",
            param,
            "context_length_exceeded",
        )


def check_min_tokens(params: SamplingParams, max_tokens: int) -> None:
    """vLLM's rule: `min_tokens` at most the completion budget (when not given, what the
    context leaves a chat, 16 for a completion)."""
    if params.min_tokens > max_tokens:
        raise InvalidRequest(f"'min_tokens' must be at most max_tokens ({max_tokens})", "min_tokens")
