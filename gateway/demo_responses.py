"""`kvgate demo`'s last part: one conversation over the OpenAI Responses API.

Each turn names only its new question and the previous response's id (`previous_response_id`);
the gateway keeps the conversation, so the prompt it routes is the whole history, and the turn
goes to the worker that cached the previous one. Printed per turn: the response's id, the worker
the gateway chose, the prompt tokens it predicted cached and those the worker reported cached.
"""

import httpx

QUESTIONS = [
    "Name one planet of the solar system.",
    "How far is it from the Sun?",
    "Say that again in one short sentence.",
]
ROW = "{:>4}  {:<30} {:<6} {:>6} {:>9} {:>6}"


def respond(gateway: str, model: str, question: str, previous: str | None, max_tokens: int) -> httpx.Response:
    """One create: the question, continuing `previous` when given."""
    body = {"model": model, "input": question, "max_output_tokens": max_tokens, "temperature": 0}
    if previous is not None:
        body["previous_response_id"] = previous
    r = httpx.post(gateway + "/v1/responses", json=body, timeout=300)
    if r.status_code != 200:
        raise RuntimeError(f"gateway answered {r.status_code} to a Responses API create: {r.text}")
    return r


def run_responses(gateway: str, model: str, max_tokens: int) -> None:
    """The conversation, each turn printed as it is answered."""
    print(
        "\nThe Responses API: one conversation, each turn sending only its question and "
        "previous_response_id;\nthe gateway keeps the history and routes the whole of it.\n"
    )
    print(ROW.format("turn", "response id", "chose", "prompt", "predicted", "cached"))
    previous = None
    for n, question in enumerate(QUESTIONS, 1):
        r = respond(gateway, model, question, previous, max_tokens)
        answer = r.json()
        usage = answer["usage"]
        text = " ".join(p["text"] for item in answer["output"] for p in item.get("content", []))
        print(
            ROW.format(
                n,
                answer["id"][:30],
                r.headers.get("x-kvgate-worker", "?"),
                usage["input_tokens"],
                r.headers.get("x-kvgate-predicted-cached-tokens", "?"),
                usage["input_tokens_details"]["cached_tokens"],
            )
        )
        reply = text.replace("\n", " ").strip()
        print(f"    reply: {reply[:90]}{'...' if len(reply) > 90 else ''}", flush=True)
        previous = answer["id"]
