"""`kvgate demo`: two SmolLM2 workers and a gateway on this machine, and a short multi-turn chat.

Each chat turn resends the whole conversation, so from the second turn on the prompt's prefix
is already cached on the worker that served the previous turn; the gateway should send it
there, predict the hit, and the worker should confirm it. Per request the demo prints the
chosen worker, predicted vs actual cached tokens and the time to first token.
"""
import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

from gateway.procs import Proc, Worker, start_gateway
from workers.cli_help import HelpFormatter

CONVERSATIONS = [
    ["You are helping me plan a trip to Paris. Which three museums should I visit?",
     "Which of those is best for a rainy afternoon?",
     "And where should I eat near it?",
     "Summarise the plan in one sentence."],
    ["Explain in two sentences what a KV cache is in a transformer.",
     "Why does reusing it for a shared prompt prefix save time?",
     "Give a one-line analogy for a child."],
]


def chat_turn(gateway: str, messages: list[dict], max_tokens: int) -> dict:
    """Stream one turn through the gateway; returns reply, routing headers, usage and TTFT."""
    body = {"model": "smollm2-135m", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0, ttft, parts = time.monotonic(), None, []
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
                text = choice["delta"].get("content")
                if text:
                    ttft = ttft if ttft is not None else time.monotonic() - t0
                    parts.append(text)
        headers = r.headers
    return {"reply": "".join(parts).strip(), "worker": headers["x-kvgate-worker"],
            "predicted": int(headers["x-kvgate-predicted-cached-tokens"]),
            "cached": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
            "prompt": usage.get("prompt_tokens", 0), "ttft_ms": (ttft or 0.0) * 1000}


ROW = "{:>7} {:>4} {:>8} {:>6} {:>9} {:>6} {:>8}  {}"


def run_chat(gateway: str, max_tokens: int) -> None:
    history: list[list[dict]] = [[] for _ in CONVERSATIONS]
    served: dict[str, int] = {}
    predicted = cached = prompt = 0
    print(ROW.format("session", "turn", "worker", "prompt", "predicted", "cached", "TTFT ms", "reply"))
    for turn in range(max(len(c) for c in CONVERSATIONS)):
        for s, convo in enumerate(CONVERSATIONS):
            if turn >= len(convo):
                continue
            history[s].append({"role": "user", "content": convo[turn]})
            r = chat_turn(gateway, history[s], max_tokens)
            history[s].append({"role": "assistant", "content": r["reply"]})
            served[r["worker"]] = served.get(r["worker"], 0) + 1
            predicted, cached, prompt = predicted + r["predicted"], cached + r["cached"], prompt + r["prompt"]
            reply = r["reply"].replace("\n", " ")
            reply = reply[:60] + ("..." if len(reply) > 60 else "")
            print(ROW.format(s, turn + 1, r["worker"], r["prompt"], r["predicted"], r["cached"],
                             f"{r['ttft_ms']:.0f}", reply), flush=True)
        time.sleep(0.2)  # let the workers' KV events reach the gateway between turns
    print(f"\nrequests per worker: {served}; cached {cached} of {prompt} prompt tokens "
          f"({cached / max(prompt, 1):.0%}), predicted {predicted}")


def start_fleet(executor: str, policy: str, log_dir: Path) -> list[Proc]:
    """Two workers and a gateway in front of them; the gateway last."""
    workers = [Worker(executor, f"cpu{i}", log_dir=str(log_dir)) for i in range(2)]
    return [*workers, start_gateway([w.url for w in workers], policy, name="gateway", log_dir=str(log_dir))]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvgate demo", description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--executor", choices=["torch", "sim"], default="torch",
                   help="the workers' executor (sim: no model, instant)")
    p.add_argument("--policy", default="prefix_affinity", help="the gateway's routing policy")
    p.add_argument("--max-tokens", type=int, default=40, help="tokens per answer")
    p.add_argument("--keep-logs", action="store_true", help="print where the processes logged")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    log_dir = Path(tempfile.mkdtemp(prefix="kvgate-demo-"))
    children: list[Proc] = []
    try:
        print(f"starting 2 {args.executor} workers and a {args.policy} gateway ...", flush=True)
        children = start_fleet(args.executor, args.policy, log_dir)
        for c in children:
            c.wait_ready("/health", 300)
        print(f"gateway on {children[-1].url}; workers {children[0].url}, {children[1].url}\n", flush=True)
        run_chat(children[-1].url, args.max_tokens)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
    except (RuntimeError, TimeoutError, httpx.HTTPError) as e:
        print(f"demo failed: {e} (logs in {log_dir})", file=sys.stderr)
        sys.exit(1)
    finally:
        print("stopping ...", flush=True)
        for c in reversed(children):
            c.stop()
        if args.keep_logs:
            print(f"logs: {log_dir}")
