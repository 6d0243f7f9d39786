"""The OpenAI surface a vLLM fleet takes whole.

kvgate's own workers refuse what they do not implement (`n > 1`, a list of prompts,
`logprobs`, penalties, `tools`, ...). When every worker serving a model is a vLLM server, such
a request is forwarded unchanged and vLLM validates those fields itself; the gateway still
parses, checks and tokenizes every prompt exactly as for its own workers (so the context limit
and every field it knows are checked here), routes by the first prompt's blocks, and counts
all prompts and completions against the client's token budget.

Fields that steer the workers' internals are refused from clients whatever the fleet:
kvgate's `kv_transfer` (P/D legs), vLLM's `kv_transfer_params` (its disaggregation: which host
a worker pulls KV from or pushes it to) and `vllm_xargs.kv_cache_report_mode` (re-announces
cached blocks as stored, which would inflate the gateway's reference counts).
"""
from workers.protocol import NOOP_VALUES, ParsedRequest, parse_request
from workers.sampling_params import InvalidRequest

MAX_N = 128
MAX_PROMPTS = 1024


def internal_field(body: dict) -> str | None:
    """The internal field a client's body sets, if any."""
    for name in ("kv_transfer", "kv_transfer_params"):
        if name in body:
            return name
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, dict) and "kv_cache_report_mode" in xargs:
        return "vllm_xargs"
    return None


def parse_whole(body: object, kind: str, tokenizer, max_model_len: int) -> tuple[ParsedRequest, int, int]:
    """(the first prompt's parse, prompt tokens of all prompts, completions asked for) of a
    request to forward unchanged: the fields vLLM implements and kvgate's parse refuses are
    left to vLLM."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    n = body.get("n", 1)
    if n is None:
        n = 1
    if type(n) is not int or not 1 <= n <= MAX_N:
        raise InvalidRequest(f"'n' must be an integer in [1, {MAX_N}]", "n")
    own = {k: v for k, v in body.items() if k not in NOOP_VALUES and k != "n"}
    prompts = [None]
    if kind == "completion":
        prompts = _prompts(body.get("prompt"))
    parsed = [parse_request({**own, "prompt": p} if p is not None else own, kind, tokenizer, max_model_len)
              for p in prompts]
    return parsed[0], sum(len(p.prompt_ids) for p in parsed), n * len(prompts)


def _prompts(prompt: object) -> list:
    """A completion's prompts: a batch (a list of strings or of token-id lists) or one prompt."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise InvalidRequest(f"at most {MAX_PROMPTS} prompts in one request", "prompt")
        return prompt
    return [prompt]
