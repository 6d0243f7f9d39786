"""The gateway's prompt-encode CPU per fresh prompt (issue 16 point 6), against the tokenizer's
own `encode`: `workers.prefix_tokens.PrefixTokenizer` over SmolLM2's tokenizer, each text seen
once after a warm-up on as many others (process_time). Prompts as `bench.prompt_text` writes
them (256 vocabulary words, as the benchmarks send), the same inside the chat template, 256
random ids decoded (`added_ttft.py`'s prompts: word fragments, a few non-ASCII characters), and
a 4k-token shared prefix with 64 fresh words after it. Run it from each checkout to compare:

    PYTHONPATH=. python experiments/encode_cost.py [--n 400]
"""

import argparse
import random
import time
from collections.abc import Callable

from bench.prompt_text import as_text
from workers.model_store import load_tokenizer
from workers.prefix_tokens import PrefixTokenizer


def per_text_us(encode: Callable[[str], list[int]], texts: list[str]) -> float:
    """Microseconds of CPU per text over the second half of `texts`, the first half a warm-up."""
    half = len(texts) // 2
    for text in texts[:half]:
        encode(text)
    t0 = time.process_time()
    for text in texts[half:]:
        encode(text)
    return 1e6 * (time.process_time() - t0) / (len(texts) - half)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=400, help="texts measured per kind (as many again warm up)")
    a = p.parse_args()
    tok = load_tokenizer("smollm2-135m")
    gateway, render, rng = PrefixTokenizer(tok), as_text(tok), random.Random(1)

    def words(n: int) -> str:
        return render([rng.randrange(1 << 20) for _ in range(n)])

    def chat(text: str) -> str:
        messages = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": text}]
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    texts = [words(256) for _ in range(2 * a.n)]
    doc = words(4096)
    kinds = {
        "256-word text": (texts, True),
        "256-word text in the chat template": ([chat(t) for t in texts], False),
        "256 random ids decoded": ([tok.decode([rng.randrange(100, 40000) for _ in range(256)]) for _ in texts], True),
        "4k-token shared prefix + 64 fresh words": ([doc + words(64) for _ in range(a.n // 4)], True),
    }
    for name, (batch, special) in kinds.items():
        assert all(gateway.encode(t, special) == tok.encode(t, add_special_tokens=special) for t in batch[:8])
        base = per_text_us(lambda t: tok.encode(t, add_special_tokens=special), batch)
        ours = per_text_us(lambda t: gateway.encode(t, special), batch)
        print(f"{name}: tokenizer.encode {base:.0f} us, gateway {ours:.0f} us", flush=True)


if __name__ == "__main__":
    main()
