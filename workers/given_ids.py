"""Prompts the gateway has already tokenized: the `kv_prompt_ids` internal field.

The gateway tokenizes every prompt to route it (its block hashes), and the worker tokenized
the same text again: a second tokenization per request on the serving path (1-4 ms for a
256-token prompt here), which made a request through the gateway slower than one sent
straight to the worker. So the gateway sends its ids along with the client's body, and a
worker whose tokenizer is the very same (equal `fingerprint`) uses them instead of its own;
any other worker ignores them and tokenizes. The ids are checked like a token-id prompt (in
the vocabulary, within the context); the field is internal (the fleet's token, like
`kv_transfer`), and the gateway refuses it from clients.
"""

import hashlib

from workers.sampling_params import InvalidRequest

FIELD = "kv_prompt_ids"


def fingerprint(tokenizer) -> str | None:
    """A digest of what decides a tokenizer's ids: its fast tokenizer's whole definition and its
    chat template; None for a tokenizer without a fast backend (nothing to compare)."""
    tok = getattr(tokenizer, "_tok", tokenizer)  # a PrefixTokenizer's wrapped tokenizer
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        return None
    h = hashlib.sha256(backend.to_str().encode())
    h.update(b"\0" + str(getattr(tok, "chat_template", None) or "").encode())
    return h.hexdigest()[:32]


def field_value(tokenizer_fingerprint: str, prompts: list[list[int]]) -> dict:
    """What the gateway sets `kv_prompt_ids` to."""
    return {"tokenizer": tokenizer_fingerprint, "prompts": prompts}


def given_prompts(value: object, own_fingerprint: str | None, vocab_size: int | None) -> list[list[int]] | None:
    """The prompts' ids to use from a `kv_prompt_ids` value: None when they were made by
    another tokenizer than this worker's (or it has no fingerprint); InvalidRequest for a
    value that is not one list of in-vocabulary token ids per prompt."""
    if not isinstance(value, dict) or not isinstance(value.get("prompts"), list):
        raise InvalidRequest(f"'{FIELD}' must be an object with a 'prompts' list", FIELD)
    if own_fingerprint is None or value.get("tokenizer") != own_fingerprint:
        return None
    limit = vocab_size or 2**31
    prompts = value["prompts"]
    for ids in prompts:
        if not isinstance(ids, list) or not ids or not all(type(t) is int and 0 <= t < limit for t in ids):
            raise InvalidRequest(f"'{FIELD}' prompts must be non-empty lists of token ids in [0, {limit})", FIELD)
    return prompts


def has_text(body: dict, kind: str) -> bool:
    """Whether a checked request holds a prompt to tokenize (chat messages, or text)."""
    prompt = body.get("prompt")
    return (
        kind == "chat"
        or isinstance(prompt, str)
        or (isinstance(prompt, list) and any(isinstance(p, str) for p in prompt))
    )
