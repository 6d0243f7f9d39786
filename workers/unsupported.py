"""The OpenAI and vLLM request fields kvgate's workers do not implement, and their one check.

Such a field is refused (a 400 naming it), never silently ignored, unless it holds a value that
asks for nothing: a client that sends `best_of: 1` asks what a worker does anyway. The
gateway forwards these fields untouched to a model served only by vLLM workers, which implement
them (gateway/passthrough.py).
"""

from workers.fields import json_equal
from workers.sampling_params import InvalidRequest

# The fields, with the values that ask for nothing (none: any value but null asks for something).
NOOP_VALUES: dict[str, tuple] = {
    "best_of": (1,),
    "echo": (False,),
    "suffix": ("",),
    "logprobs": (False,),
    "top_logprobs": (0,),
    "prompt_logprobs": (0,),
    "tools": ([],),
    "functions": ([],),
    "tool_choice": ("none", "auto"),
    "function_call": ("none", "auto"),
    "response_format": ({"type": "text"},),
    "use_beam_search": (False,),
    "truncate_prompt_tokens": (),
    "structured_outputs": (),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "priority": (0,),
    "prompt_embeds": (),
    "length_penalty": (1,),
    "truncation_side": (),
    "logprob_token_ids": (),
    # vLLM 0.32's other request fields: the prompt's template and multimodal inputs,
    "chat_template": (),
    "mm_processor_kwargs": ({},),
    "media_io_kwargs": ({},),
    # reasoning and tools,
    "thinking_token_budget": (-1,),
    "include_reasoning": (True,),
    "parallel_tool_calls": (True, False),  # without tools (refused above) it asks for nothing
    # sampling and what the answer carries,
    "watermarking": (False,),
    "repetition_detection": (),
    "return_tokens_as_token_ids": (False,),
    "return_prompt_text": (False,),
    "routed_experts_prompt_start": (0,),
    "stream_interval": (1,),
    # vLLM's extensions.
    "vllm_xargs": ({},),
    "kv_transfer_params": (),
    "ec_transfer_params": (),
}
# The NOOP_VALUES fields that each kind does implement (with OpenAI's types, read by workers/protocol.py).
IMPLEMENTED = {"completion": {"echo", "logprobs"}, "chat": {"logprobs", "top_logprobs"}}
# Why a field is refused, where "not implemented" is not the whole reason.
WHY = {
    "chat_template": "a chat template sent with the request is not trusted (vLLM refuses one too unless "
    "started with --trust-request-chat-template): kvgate's workers render the model's own template only",
}


def refuse_unsupported(body: dict, kind: str) -> None:
    """Refuse the first NOOP_VALUES field of `body` that asks for something, unless `kind`
    (completion, chat) implements it. A value is a no-op only as JSON holds it (`json_equal`):
    `false` is no number, `0` no boolean."""
    for name, noop in NOOP_VALUES.items():
        v = body.get(name)
        if v is not None and name not in IMPLEMENTED[kind] and not any(json_equal(v, n) for n in noop):
            why = WHY.get(name, "not supported by kvgate's workers")
            raise InvalidRequest(
                f"'{name}': {why} (leave it out, or serve this model with vLLM workers, which the "
                "gateway forwards it to)",
                name,
                "unsupported_parameter",
            )
