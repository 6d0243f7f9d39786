"""`kvgate demo`: two SmolLM2 workers and a gateway here, three chats and a Responses API one.

The Responses API conversation is gateway/demo_responses.py.

Each chat turn resends the whole conversation, so from its second turn on a chat's prompt
starts with blocks already cached on the worker that served its previous turn. Per request the
demo prints what the gateway saw when it chose (each candidate's cached prefix and load), the
worker it chose and the policy's reason, and the prompt tokens it predicted cached against the
ones the worker reported. At the end it replays the same requests over the workers in turn to
estimate what round robin would have cached.
"""

import argparse
import json
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from gateway.demo_responses import run_responses
from gateway.procs import Proc, Worker, start_gateway
from workers.cli_help import HelpFormatter

MODEL = "smollm2-135m"
BLOCK = 16  # the workers' and the gateway's default --block-size
PROGRESS_S = 5.0
CONVERSATIONS = [
    [
        "You are helping me plan a trip to Paris. Which three museums should I visit?",
        "Which of those is best for a rainy afternoon?",
        "And where should I eat near it?",
        "Summarise the plan in one sentence.",
    ],
    [
        "Explain in two sentences what a KV cache is in a transformer.",
        "Why does reusing it for a shared prompt prefix save time?",
        "Give a one-line analogy for a child.",
    ],
    ["Suggest a name for a grey cat.", "Why that name?"],
]


@dataclass
class Turn:
    """One chat request as the gateway routed it and the worker answered it."""

    chat: str
    turn: int
    worker: str
    reason: str
    candidates: str
    predicted: int
    cached: int
    prompt_ids: list[int]
    output_ids: list[int]
    ttft_ms: float
    reply: str


def log(message: str, t0: float) -> None:
    print(f"[{time.monotonic() - t0:4.0f} s] {message}", flush=True)


def prepare_model(executor: str, t0: float) -> None:
    """Convert SmolLM2 once, here, where its progress can be told (the workers would race to)."""
    from workers.model_store import cache_dir, resolve

    log(f"preparing {MODEL} in {cache_dir()} (the first run converts its GGUF weights, about a minute)", t0)
    path = resolve(MODEL, tokenizer_only=executor == "sim")
    log(f"model ready: {path}", t0)


def wait_healthy(procs: list[Proc], t0: float, timeout: float = 600.0) -> None:
    """Poll every process's /health, saying every few seconds who is still starting."""
    deadline, next_note = time.monotonic() + timeout, time.monotonic() + PROGRESS_S
    pending = list(procs)
    while pending:
        for p in list(pending):
            if not p.alive:
                raise RuntimeError(f"{p.name} exited with {p.popen.returncode}:\n{p.log_tail()}")
            try:
                if httpx.get(p.url + "/health", timeout=1.0).status_code == 200:
                    pending.remove(p)
                    log(f"{p.name} is up on {p.url}", t0)
            except httpx.HTTPError:
                pass
        if pending and time.monotonic() >= next_note:
            what = {"gateway": "waiting for healthy workers"}
            log(
                "still starting: " + ", ".join(f"{p.name} ({what.get(p.name, 'loading the model')})" for p in pending),
                t0,
            )
            next_note += PROGRESS_S
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"not up after {timeout:.0f} s: {', '.join(p.name for p in pending)}")
        time.sleep(0.25)


def prompt_ids(worker: str, messages: list[dict]) -> list[int]:
    """The chat's prompt as the workers tokenize it (their /tokenize, vLLM's endpoint)."""
    r = httpx.post(worker + "/tokenize", json={"model": MODEL, "messages": messages}, timeout=60)
    r.raise_for_status()
    return r.json()["tokens"]


def chat_turn(gateway: str, messages: list[dict], max_tokens: int) -> dict:
    """Stream one turn through the gateway: its reply, output token ids, routing headers, usage
    and time to first token."""
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    t0, ttft, parts = time.monotonic(), None, []
    ids: list[int] = []
    usage: dict = {}
    with httpx.stream("POST", gateway + "/v1/chat/completions", json=body, timeout=300) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"gateway answered {r.status_code}: {r.text}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            usage = event.get("usage") or usage
            for choice in event["choices"]:
                ids += choice.get("token_ids") or []
                if choice["delta"].get("content"):
                    ttft = ttft if ttft is not None else time.monotonic() - t0
                    parts.append(choice["delta"]["content"])
        h = r.headers
    return {
        "reply": "".join(parts).strip(),
        "output_ids": ids,
        "worker": h["x-kvgate-worker"],
        "reason": h.get("x-kvgate-route-reason", ""),
        "candidates": h.get("x-kvgate-candidates", ""),
        "predicted": int(h["x-kvgate-predicted-cached-tokens"]),
        "cached": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
        "ttft_ms": (ttft or 0.0) * 1000,
    }


def compact(candidates: str, workers: list[str]) -> str:
    """'cpu0 cached=96 load=0, cpu1 cached=0 load=1' -> 'cpu0 96/0  cpu1 0/1'; a worker that was
    no candidate (out of service, or its queue full) shows as 'out'."""
    seen = re.findall(r"(\S+) cached=(\d+) load=(\d+)", candidates)
    out = [w for w in workers if w not in {s[0] for s in seen}]
    return "  ".join([f"{w} {c}/{n}" for w, c, n in seen] + [f"{w} out" for w in out])


ROW = "{:>2}  {:<4} {:>4} {:>6}  {:<22} {:<6} {:>9} {:>6} {:>7}"


def run_chat(gateway: str, worker: str, names: list[str], max_tokens: int) -> list[Turn]:
    """The conversations, interleaved turn by turn, each request printed as it is answered."""
    print(
        "\nPer request: the prompt's length; each candidate worker's cached prefix of it and its load "
        "when the gateway chose\n(cached tokens / requests in flight; 'out': not a candidate); the chosen "
        "worker; the prompt tokens the gateway\npredicted cached and those the worker reported cached; time "
        "to first token. Counts are tokens unless said.\n"
    )
    print(
        ROW.format("#", "chat", "turn", "prompt", "candidates cached/load", "chose", "predicted", "cached", "TTFT ms")
    )
    history: list[list[dict]] = [[] for _ in CONVERSATIONS]
    turns: list[Turn] = []
    for turn in range(max(len(c) for c in CONVERSATIONS)):
        for s, convo in enumerate(CONVERSATIONS):
            if turn >= len(convo):
                continue
            history[s].append({"role": "user", "content": convo[turn]})
            ids = prompt_ids(worker, history[s])
            r = chat_turn(gateway, history[s], max_tokens)
            history[s].append({"role": "assistant", "content": r["reply"]})
            t = Turn(
                "ABC"[s],
                turn + 1,
                r["worker"],
                r["reason"],
                r["candidates"],
                r["predicted"],
                r["cached"],
                ids,
                r["output_ids"],
                r["ttft_ms"],
                r["reply"],
            )
            turns.append(t)
            print(
                ROW.format(
                    len(turns),
                    t.chat,
                    t.turn,
                    len(ids),
                    compact(t.candidates, names),
                    t.worker,
                    t.predicted,
                    t.cached,
                    f"{t.ttft_ms:.0f}",
                )
            )
            reply = t.reply.replace("\n", " ")
            print(f"    why: {t.reason}\n    reply: {reply[:90]}{'...' if len(reply) > 90 else ''}", flush=True)
        time.sleep(0.2)  # let the workers' KV events reach the gateway between turns
    return turns


def estimate_cached(turns: list[Turn], workers: list[str]) -> list[int]:
    """Prompt tokens each request would find cached if served by `workers[i]`: a worker holds
    every full block of each sequence (prompt and answer) it served before, and recomputes at
    least a prompt's last token (no eviction: the demo's pools are far larger)."""
    served: dict[str, list[list[int]]] = {}
    out = []
    for t, w in zip(turns, workers):
        held = served.setdefault(w, [])
        limit = (len(t.prompt_ids) - 1) // BLOCK * BLOCK
        best = max((_common(t.prompt_ids, seq) for seq in held), default=0)
        out.append(min(best // BLOCK * BLOCK, limit))
        held.append(t.prompt_ids + t.output_ids)
    return out


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def summary(turns: list[Turn], names: list[str]) -> None:
    """Requests per worker, tokens served from cache, and round robin's estimate over the
    workers `names` beside it."""
    prompt = sum(len(t.prompt_ids) for t in turns)
    cached, predicted = sum(t.cached for t in turns), sum(t.predicted for t in turns)
    per: dict[str, int] = {}
    for t in turns:
        per[t.worker] = per.get(t.worker, 0) + 1
    rr = estimate_cached(turns, [names[i % len(names)] for i in range(len(turns))])
    ours = estimate_cached(turns, [t.worker for t in turns])
    print(f"\nrequests per worker: {', '.join(f'{w} {n}' for w, n in sorted(per.items()))}")
    print(
        f"prompt tokens served from the prefix cache: {cached} of {prompt} ({cached / max(prompt, 1):.0%}); "
        f"the gateway predicted {predicted}"
    )
    print(
        f"round robin over {', '.join(names)} on the same requests: about {sum(rr)} ({sum(rr) / max(prompt, 1):.0%}), "
        f"estimated by replaying them\n  (a worker keeps every full {BLOCK}-token block it computed; the same "
        f"estimate for this run's routing gives {sum(ours)}, the workers reported {cached})"
    )


def start_fleet(executor: str, policy: str, log_dir: Path, t0: float) -> list[Proc]:
    """Two workers and a gateway in front of them; the gateway last."""
    workers = [Worker(executor, f"cpu{i}", log_dir=str(log_dir)) for i in range(2)]
    for w in workers:
        log(f"started worker {w.worker_id} ({executor} executor) on {w.url}", t0)
    # A first CPU step on a busy machine can take seconds: no reason to take a worker out of service.
    gateway = start_gateway(
        [w.url for w in workers], policy, name="gateway", log_dir=str(log_dir), extra=["--engine-stall-s", "30"]
    )
    log(f"started the {policy} gateway on {gateway.url}; logs in {log_dir}", t0)
    return [*workers, gateway]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvgate demo", description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    p.add_argument(
        "--executor", choices=["torch", "sim"], default="torch", help="the workers' executor (sim: no model, instant)"
    )
    p.add_argument("--policy", default="prefix_affinity", help="the gateway's routing policy")
    p.add_argument("--max-tokens", type=int, default=40, help="tokens per answer")
    p.add_argument("--keep-logs", action="store_true", help="print where the processes logged")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    log_dir = Path(tempfile.mkdtemp(prefix="kvgate-demo-"))
    children: list[Proc] = []
    t0 = time.monotonic()
    try:
        prepare_model(args.executor, t0)
        children = start_fleet(args.executor, args.policy, log_dir, t0)
        wait_healthy(children, t0)
        names = [c.name for c in children[:-1]]
        summary(run_chat(children[-1].url, children[0].url, names, args.max_tokens), names)
        run_responses(children[-1].url, MODEL, args.max_tokens)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
    except (RuntimeError, TimeoutError, OSError, httpx.HTTPError) as e:
        print(f"demo failed: {e} (logs in {log_dir})", file=sys.stderr)
        sys.exit(1)
    finally:
        print("stopping ...", flush=True)
        for c in reversed(children):
            c.stop()
        if args.keep_logs:
            print(f"logs: {log_dir}")
