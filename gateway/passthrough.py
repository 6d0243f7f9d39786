"""The OpenAI surface a vLLM fleet takes whole.

kvgate's own workers refuse what they do not implement (`tools`, `response_format`, prompt
logprobs, ...). When every worker serving a model is a vLLM server, such a request is forwarded
unchanged and vLLM validates those fields itself, and the sampling controls kvgate's workers
read more strictly than vLLM (`VLLM_READS`) too; the gateway still parses, checks and tokenizes
every prompt exactly as for its own workers (so the context limit and every other field it
knows are checked here), routes by the first prompt's blocks, and counts all prompts and
completions against the client's token budget.

Fields that steer the workers' internals are refused from clients whatever the fleet:
kvgate's `kv_transfer` (P/D legs) and `kv_prompt_ids` (the gateway's own tokenization of the
prompts, workers/given_ids.py), vLLM's `kv_transfer_params` (its disaggregation: which host
a worker pulls KV from or pushes it to), `ec_transfer_params` (the same for its encoder cache:
which host a multimodal input's encoder outputs are pulled from or pushed to) and
`vllm_xargs.kv_cache_report_mode` (re-announces cached blocks as stored, which would inflate
the gateway's reference counts).
"""

from workers.given_ids import FIELD as GIVEN_IDS
from workers.protocol import ParsedRequest, parse_request
from workers.unsupported import IMPLEMENTED, NOOP_VALUES

# Sampling controls kvgate's workers implement with a stricter reader than vLLM's pydantic one,
# which takes what its lax mode coerces ("0.5", true, "false" for a boolean, ["5"] for ids) and
# more than 1024 logit_bias keys or allowed_token_ids, or bad_words of more than 1024 tokens in
# all (vLLM's V1 runner takes them; its V2 runner's limits are kvgate's): they only steer the
# answer, so a vLLM fleet's requests take them as vLLM reads them (bad_words then cost the
# gateway no tokenizing).
VLLM_READS = frozenset(
    (
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_p",
        "min_tokens",
        "logit_bias",
        "include_stop_str_in_output",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "allowed_token_ids",
        "bad_words",
    )
)


def internal_field(body: dict) -> str | None:
    """The internal field a client's body sets, if any."""
    for name in ("kv_transfer", "kv_transfer_params", "ec_transfer_params", GIVEN_IDS):
        if name in body:
            return name
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, dict) and "kv_cache_report_mode" in xargs:
        return "vllm_xargs"
    return None


def parse_whole(body: object, kind: str, tokenizer, max_model_len: int) -> ParsedRequest:
    """The parse of a request to forward unchanged: kvgate's own parse of every field it knows
    (prompts, n, sampling, context limits), the fields only vLLM implements and `VLLM_READS` left
    to vLLM."""
    if not isinstance(body, dict):
        return parse_request(body, kind, tokenizer, max_model_len)
    own = {k: v for k, v in body.items() if (k not in NOOP_VALUES or k in IMPLEMENTED[kind]) and k not in VLLM_READS}
    if own.get("echo") is True and own.get("logprobs") is not None:
        del own["echo"]  # prompt logprobs: vLLM computes them
    return parse_request(own, kind, tokenizer, max_model_len)
