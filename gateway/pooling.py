"""The pooling endpoints the gateway forwards to vLLM workers (gateway/forward.py): their kinds,
and the check of their main inputs' shapes before a body is forwarded, with the tokens they are
charged to a key's tokens-per-minute budget.

OpenAI's `/v1/embeddings`, vLLM's `/v2/embed` (Cohere's), `/pooling`, `/classify`, `/score`,
`/v1/score`, `/rerank`, `/v1/rerank` and `/v2/rerank` (Jina's and Cohere's): the fields are
vLLM 0.32's (its entrypoints/pooling protocol classes). What each input may hold beyond its shape
(its length against the model's, a message's content parts) is vLLM's to check.
"""

import asyncio

from gateway.intake import ApiError
from gateway.tokenize import INLINE_CHARS, ModelTokenizer
from workers.kv.hashing import MAX_TOKEN_ID
from workers.protocol import checked_cache_salt
from workers.sampling_params import InvalidRequest

EMBEDDINGS = "embeddings"
# vLLM's other pooling endpoints: a kind per path, forwarded to the path it came in on
EMBED, POOLING, CLASSIFY = "embed", "pooling", "classify"
SCORE, SCORE_V1, RERANK, RERANK_V1, RERANK_V2 = "score", "score_v1", "rerank", "rerank_v1", "rerank_v2"
# the pooling kinds: engine work only a vLLM server of a pooling model does (one code path)
POOLING_KINDS = frozenset({EMBEDDINGS, EMBED, POOLING, CLASSIFY, SCORE, SCORE_V1, RERANK, RERANK_V1, RERANK_V2})

SERVES = {EMBEDDINGS: "embeddings", EMBED: "embeddings", POOLING: "pooling", CLASSIFY: "classifications"}

MAX_INPUTS = 2048  # OpenAI's bound on an embeddings request's inputs
INLINE_INPUTS = 64  # inputs counted on the event loop at most (with INLINE_CHARS of text)
ENCODING_FORMATS = ("float", "base64", "bytes", "bytes_only")  # OpenAI's two, vLLM's two more
SCORE_PAIRS = (("text_1", "text_2"), ("queries", "documents"), ("queries", "items"), ("data_1", "data_2"))


class InvalidPooling(ApiError):
    def __init__(self, message: str, param: str):
        super().__init__(400, message, param=param)


Inputs = tuple[list[str], int, bool]  # (texts, token ids, whether to estimate the rest by bytes)


def pooling_inputs(kind: str, body: dict) -> Inputs:
    """Check a pooling body's shape before it is forwarded: (the texts whose tokens it is
    charged, how many token ids it holds, whether it holds inputs charged by a byte estimate:
    conversations, multimodal objects, a plugin's `data`). Common to all: `user` is a string and
    `cache_salt` a salt as for completions (`checked_cache_salt`: a bad one would reach vLLM as the
    client sent it, in place of the tenant's). Then the main inputs' shapes, after vLLM's protocol
    classes (vllm/entrypoints/pooling/*/protocol.py), each list at most MAX_INPUTS long:

    - /v1/embeddings, /classify, /pooling: `input` or `messages` (`embedding_inputs`); /pooling
      also a plugin's `data` (IOProcessorRequest), unchecked;
    - /v2/embed (Cohere's): `texts` (strings), `images` (strings) and/or `inputs` (objects with a
      `content` list);
    - /score, /v1/score: one pair of `text_1`/`text_2`, `queries`/`documents`, `queries`/`items`
      or `data_1`/`data_2`, each side an input (a string, or an object with a `content` list) or
      a non-empty list of them;
    - the reranks: `query` an input, `documents` an input or a non-empty list of them, `top_n` a
      non-negative integer (vLLM's 0: all of them).

    A score or rerank is charged for every pair the engine reads (a query paired with N
    documents is its text N times). What each input may hold beyond that (its length against
    the model's, a message's or a part's content) is the server's to check. Raises InvalidPooling."""
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise InvalidPooling("'user' must be a string", "user")
    try:
        checked_cache_salt(body)
    except InvalidRequest as e:
        raise InvalidPooling(str(e), "cache_salt") from None
    if kind in (SCORE, SCORE_V1):
        return score_inputs(body)
    if kind in (RERANK, RERANK_V1, RERANK_V2):
        return rerank_inputs(body)
    if kind == EMBED:
        return cohere_inputs(body)
    if kind == POOLING and body.get("data") is not None and body.get("input") is None and body.get("messages") is None:
        return [], 0, True  # a plugin's request (IOProcessorRequest): its data is the plugin's to read
    return embedding_inputs(body)


def embedding_inputs(body: dict) -> Inputs:
    """`input` is a string, a list of strings, a list of token ids or a list of such lists
    (OpenAI), or a conversation or list of them (vLLM's chat embeddings, also as `messages`), at
    most MAX_INPUTS of them and none empty; `encoding_format` and `dimensions` have their types."""
    fmt = body.get("encoding_format")
    if fmt is not None and fmt not in ENCODING_FORMATS:
        raise InvalidPooling(f"'encoding_format' must be one of {', '.join(ENCODING_FORMATS)}", "encoding_format")
    dims = body.get("dimensions")
    if dims is not None and (type(dims) is not int or dims < 1):
        raise InvalidPooling("'dimensions' must be a positive integer", "dimensions")
    given = body.get("input")
    if body.get("messages") is not None:
        if given is not None:
            raise InvalidPooling("send the inputs as 'input' or as 'messages', not both", "messages")
        _conversations(body["messages"], "messages")
        return [], 0, True
    if given is None:
        raise InvalidPooling("'input' is required: a string, a list of strings or of token ids", "input")
    if isinstance(given, str):
        return [given], 0, False
    if not isinstance(given, list) or not given:
        raise InvalidPooling("'input' must be a string, or a non-empty list of strings or token ids", "input")
    if len(given) > MAX_INPUTS:
        raise InvalidPooling(f"'input' holds {len(given)} inputs, more than {MAX_INPUTS}", "input")
    first = given[0]
    if isinstance(first, str):
        if not all(isinstance(s, str) for s in given):
            raise InvalidPooling("a list 'input' holds strings only, or token ids only", "input")
        return given, 0, False
    if _is_id(first):
        if not all(_is_id(t) for t in given):
            raise InvalidPooling(f"token ids in 'input' are integers in [0, {MAX_TOKEN_ID}]", "input")
        return [], len(given), False
    if isinstance(first, list) and (not first or not isinstance(first[0], dict)):
        for ids in given:
            if not (isinstance(ids, list) and ids and all(_is_id(t) for t in ids)):
                raise InvalidPooling(
                    f"each list of token ids in 'input' is non-empty, of integers in [0, {MAX_TOKEN_ID}]", "input"
                )
        return [], sum(map(len, given)), False
    _conversations(given, "input")
    return [], 0, True


def cohere_inputs(body: dict) -> Inputs:
    """/v2/embed: `texts`, `images` (strings) and `inputs` (objects with a `content` list), at
    least one of them given, each a non-empty list of at most MAX_INPUTS."""
    given = {f: body.get(f) for f in ("texts", "images", "inputs") if body.get(f) is not None}
    if not given:
        raise InvalidPooling("one of 'texts', 'images' or 'inputs' is required", "texts")
    for field, value in given.items():
        if not isinstance(value, list) or not value:
            raise InvalidPooling(f"'{field}' must be a non-empty list", field)
        if len(value) > MAX_INPUTS:
            raise InvalidPooling(f"'{field}' holds {len(value)} inputs, more than {MAX_INPUTS}", field)
        if field != "inputs" and not all(isinstance(v, str) for v in value):
            raise InvalidPooling(f"'{field}' holds strings only", field)
        if field == "inputs" and not all(isinstance(v, dict) and isinstance(v.get("content"), list) for v in value):
            raise InvalidPooling("'inputs' holds objects with a 'content' list", field)
    return given.get("texts") or [], 0, "images" in given or "inputs" in given


def score_inputs(body: dict) -> Inputs:
    """/score: one pair of sides (SCORE_PAIRS), each an input or a list of them; N to N sides
    pair up in order, 1 to N pairs the one with each (its text charged N times)."""
    for a, b in SCORE_PAIRS:
        if body.get(a) is not None and body.get(b) is not None:
            return _paired(_side(body[a], a), _side(body[b], b))
    given = [(a, b) for a, b in SCORE_PAIRS if body.get(a) is not None or body.get(b) is not None]
    missing = next((b if body.get(a) is not None else a for a, b in given), "text_1")
    names = ", ".join(f"{a}/{b}" for a, b in SCORE_PAIRS)
    raise InvalidPooling(f"a score needs one pair of inputs ({names}): '{missing}' is missing", missing)


def rerank_inputs(body: dict) -> Inputs:
    """A rerank: `query` an input, `documents` one or a list, `top_n` a non-negative integer."""
    top = body.get("top_n")
    if top is not None and (type(top) is not int or top < 0):
        raise InvalidPooling("'top_n' must be a non-negative integer (0: all the documents)", "top_n")
    query = body.get("query")
    if query is None:
        raise InvalidPooling("'query' is required: a string, or an object with a 'content' list", "query")
    if not _is_score_input(query):
        raise InvalidPooling("'query' must be a string, or an object with a 'content' list", "query")
    return _paired([query], _side(body.get("documents"), "documents"))


def _side(value: object, param: str) -> list:
    """A score's side as a list of inputs (strings, or objects with a `content` list)."""
    if value is None:
        raise InvalidPooling(f"'{param}' is required: an input or a non-empty list of them", param)
    items = value if isinstance(value, list) else [value]
    if not items:
        raise InvalidPooling(f"'{param}' must be an input or a non-empty list of them", param)
    if len(items) > MAX_INPUTS:
        raise InvalidPooling(f"'{param}' holds {len(items)} inputs, more than {MAX_INPUTS}", param)
    if not all(_is_score_input(v) for v in items):
        raise InvalidPooling(f"'{param}' holds strings, or objects with a 'content' list", param)
    return items


def _is_score_input(v: object) -> bool:
    return isinstance(v, str) or (isinstance(v, dict) and isinstance(v.get("content"), list))


def _paired(left: list, right: list) -> Inputs:
    """The texts of a score's pairs: 1 to N repeats the one; objects are estimated by bytes."""
    if len(left) == 1 and len(right) > 1:
        left = left * len(right)
    texts = [t for t in left + right if isinstance(t, str)]
    return texts, 0, len(texts) < len(left) + len(right)


def _is_id(t: object) -> bool:
    return type(t) is int and 0 <= t <= MAX_TOKEN_ID


def _conversations(value: object, param: str) -> None:
    """A conversation (a non-empty list of messages, objects with a string `role`), or a
    non-empty list of at most MAX_INPUTS conversations."""
    batch = isinstance(value, list) and bool(value) and isinstance(value[0], list)
    convs = value if batch else [value]
    assert isinstance(convs, list)
    if len(convs) > MAX_INPUTS:
        raise InvalidPooling(f"'{param}' holds {len(convs)} conversations, more than {MAX_INPUTS}", param)
    for conv in convs:
        if not (isinstance(conv, list) and conv and all(_is_message(m) for m in conv)):
            raise InvalidPooling(
                f"'{param}' must be inputs (strings or token ids) or conversations: lists of messages with a 'role'",
                param,
            )


def _is_message(m: object) -> bool:
    return isinstance(m, dict) and isinstance(m.get("role"), str)


def count_tokens(tok: ModelTokenizer | None, texts: list[str]) -> int:
    """Tokens of `texts` by the gateway's tokenizer for the model (one batched call), or a
    quarter of their UTF-8 bytes where it has none (the estimate of a model routed cache-blind)."""
    if tok is None:
        return sum(max(1, len(t.encode("utf-8", "surrogatepass")) // 4) for t in texts)
    return tok.count(texts)


async def input_tokens(tok: ModelTokenizer | None, texts: list[str]) -> int:
    """`count_tokens` on the event loop for a few short inputs, else in a thread: a count's
    cost grows with the inputs as well as their characters (2048 one-character inputs are
    ~7 ms of tokenizer calls, a few thousand characters of text about 1 ms)."""
    if len(texts) <= INLINE_INPUTS and sum(map(len, texts)) <= INLINE_CHARS:
        return count_tokens(tok, texts)
    return await asyncio.to_thread(count_tokens, tok, texts)
