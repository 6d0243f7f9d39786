"""Seeded hostile and unusual-but-valid OpenAI request bodies, as raw bytes.

Each body starts as a valid completions or chat request (content as strings or lists of parts,
assistant tool calls without content, tool/function/developer roles, streams), then takes a
few mutations: a field set to a value of the wrong type or out of range, a field dropped, a
message broken; and sometimes a byte-level one: NaN/Infinity/1e999 or a 5,000-digit integer
in place of a number, a lone surrogate in a string, deep nesting, invalid UTF-8, truncation.
Bodies stay cheap to serve: a valid one asks for at most a few tokens.
"""

import json
import random
import re
from collections.abc import Iterator

MODEL = "smollm2-135m"
WORDS = "the cache holds blocks of tokens routed by prefix to a worker queue ünï ✓ 日本".split()
FIELDS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "stream",
    "stream_options",
    "n",
    "user",
    "ignore_eos",
    "return_token_ids",
    "logprobs",
    "top_logprobs",
    "echo",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "tools",
    "tool_choice",
    "response_format",
    "best_of",
    "suffix",
    "min_tokens",
    "kv_transfer",
    "add_special_tokens",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template_kwargs",
    "priority",
    "unknown_field",
]
ROLES = ["system", "developer", "user", "assistant", "tool", "function"]
_NUMBER = re.compile(rb"(?<=[:\[,] )-?\d+(\.\d+)?")
_STRING_END = re.compile(rb'[^\\]"')


def bodies(seed: int, n: int) -> Iterator[tuple[str, bytes]]:
    """`n` (path, raw body) pairs, the same for the same seed."""
    rng = random.Random(seed)
    for _ in range(n):
        yield body(rng)


def body(rng: random.Random) -> tuple[str, bytes]:
    chat = rng.random() < 0.5
    obj = _chat(rng) if chat else _completion(rng)
    for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):
        _mutate(rng, obj)
    if chat and obj.get("max_tokens") is None and obj.get("max_completion_tokens") is None:
        obj["max_tokens"] = 2  # a chat's default budget is the whole context: too slow to serve
    raw = json.dumps(obj).encode()
    if rng.random() < 0.25:
        raw = _corrupt(rng, raw)
    return ("/v1/chat/completions" if chat else "/v1/completions"), raw


def _text(rng: random.Random, n: int = 8) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, n)))


def _sampling(rng: random.Random) -> dict:
    out = {"max_tokens": rng.randint(1, 4)}
    if rng.random() < 0.5:
        out["temperature"] = rng.choice([0, 0.7, 1.0, 2.0])
    if rng.random() < 0.3:
        out.update(top_p=rng.choice([0.1, 0.9, 1]), top_k=rng.choice([-1, 0, 1, 50]), seed=rng.randint(-9, 2**40))
    if rng.random() < 0.3:
        out["stream"] = True
        out["stream_options"] = {"include_usage": rng.random() < 0.5}
    if rng.random() < 0.2:
        out["stop"] = rng.choice(["\n", ["cache", "zz"]])
    return out


def _completion(rng: random.Random) -> dict:
    prompt = rng.choice(
        [
            _text(rng, 30),
            [_text(rng)],
            [rng.randrange(49152) for _ in range(rng.randint(1, 40))],
            [[rng.randrange(49152) for _ in range(rng.randint(1, 10))]],
        ]
    )
    return {"model": MODEL, "prompt": prompt, **_sampling(rng)}


def _chat(rng: random.Random) -> dict:
    return {"model": MODEL, "messages": [_message(rng) for _ in range(rng.randint(1, 5))], **_sampling(rng)}


def _message(rng: random.Random) -> dict:
    role = rng.choice(ROLES)
    content = rng.choice(
        [
            _text(rng),
            [{"type": "text", "text": _text(rng)}, _text(rng)],
            [{"type": "input_text", "text": _text(rng)}, {"type": "text", "text": None}],
        ]
    )
    m = {"role": role, "content": content}
    if role == "assistant" and rng.random() < 0.5:
        m["content"] = None
        m["tool_calls"] = [
            {
                "id": f"call_{rng.randrange(99)}",
                "type": "function",
                "function": {"name": "lookup", "arguments": json.dumps({"q": _text(rng, 3)})},
            }
        ]
    if role == "tool":
        m["tool_call_id"] = f"call_{rng.randrange(99)}"
    if role == "function" or rng.random() < 0.1:
        m["name"] = "lookup"
    return m


def _value(rng: random.Random, depth: int = 0) -> object:
    """A JSON value of any type: edge numbers, odd strings, containers, deep nesting."""
    pick = rng.randrange(12 if depth < 3 else 8)
    if pick == 0:
        return None
    if pick == 1:
        return rng.random() < 0.5
    if pick == 2:
        return rng.choice([-1, 0, 1, 2, 3, 2**31, 2**63, -(2**63) - 1, 10**309, -(10**309)])
    if pick == 3:
        return rng.choice([-0.5, 0.0, 0.5, 1.5, 1e-300, 1.7e308, -1e308, 5e-324])
    if pick == 4:
        return rng.choice(["", "x", "auto", "none", "text", "user", "\u0000", "‮", "☃" * 1000, "a" * 20000])
    if pick == 5:
        return {"type": rng.choice(["text", "image_url", "json_object", "function"])}
    if pick == 6:
        return [rng.randrange(-5, 50000) for _ in range(rng.randint(0, 5))]
    if pick == 7:
        return [rng.choice(["a", "", "stop"]) for _ in range(rng.randint(0, 40))]
    if pick == 8:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if pick == 9:
        return {rng.choice(FIELDS + ["type", "text", "role"]): _value(rng, depth + 1) for _ in range(rng.randint(0, 3))}
    if pick == 10:
        nested: object = 1
        for _ in range(rng.randint(5, 60)):
            nested = [nested] if rng.random() < 0.5 else {"a": nested}
        return nested
    return _message(rng)


def _mutate(rng: random.Random, obj: dict) -> None:
    choice = rng.randrange(5)
    if choice <= 1:
        obj[rng.choice(FIELDS)] = _value(rng)
    elif choice == 2 and obj:
        obj.pop(rng.choice(sorted(obj)))
    elif choice == 3 and isinstance(obj.get("messages"), list) and obj["messages"]:
        m = rng.choice(obj["messages"])
        if isinstance(m, dict):
            m[rng.choice(["role", "content", "tool_calls", "name", "tool_call_id"])] = _value(rng)
    elif choice == 4 and isinstance(obj.get("messages"), list):
        obj["messages"].append(
            rng.choice(
                [
                    _value(rng),
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:1/x.png"}}],
                    },
                ]
            )
        )


def _corrupt(rng: random.Random, raw: bytes) -> bytes:
    """A byte-level change that `json.dumps` would never make."""
    pick = rng.randrange(8)
    numbers = list(_NUMBER.finditer(raw))
    if pick <= 1 and numbers:
        m = rng.choice(numbers)
        new = rng.choice([b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e999", b"9" * 5000, b"1" + b"0" * 400])
        return raw[: m.start()] + new + raw[m.end() :]
    strings = list(_STRING_END.finditer(raw))
    if pick == 2 and strings:
        at = rng.choice(strings).start() + 1
        odd = rng.choice([b"\\ud800", b"\\udfff", b"\\udc00x", b"\xed\xa0\x80", b"\\ud83d\\ude00"])
        return raw[:at] + odd + raw[at:]
    if pick == 3:
        depth = rng.choice([40, 1000, 100_000])
        return raw[:-1] + b', "deep": ' + b"[" * depth + b"]" * depth + b"}"
    if pick == 4:
        return raw[: rng.randrange(len(raw))]
    if pick == 5:
        at = rng.randrange(len(raw))
        return raw[:at] + rng.choice([b"\xff", b"\xc3", b"\x00", b"\\"]) + raw[at:]
    if pick == 6:
        return rng.choice([b"", b"null", b"[]", b"42", b'"x"', b"{}", raw + b"garbage", raw + raw])
    return raw.replace(b'"', b"'", 1)
