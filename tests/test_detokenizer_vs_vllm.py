"""kvgate's detokenizer against vLLM 0.32's own (`FastIncrementalDetokenizer`, run in vLLM's venv:
skipped without it, as tests/vllm_env.py says). Random token streams of SmolLM2's tokenizer and of
a WordPiece one (whose decoder spaces added tokens), with special tokens, random stop strings and
stop token ids, `min_tokens` and the three text fields, give vLLM's streamed deltas on both of
kvgate's decode paths. The stream ends as an engine ends it: at a stop token past `min_tokens`, at
a stop string, or at its last token."""

import json
import random
import subprocess

import pytest

from tests.test_stop_str_and_special_tokens import Windowed, wordpiece
from tests.vllm_env import need_vllm
from workers.detokenizer import Detokenizer
from workers.model_store import load_tokenizer, resolve
from workers.sampling_params import SamplingParams

CASES = 400  # per tokenizer
WORDS = "the cat sat on a mat . , cats héllo 日本 🎉 ab ba \n".split(" ")
VLLM = """
import json, sys
from types import SimpleNamespace
from transformers import PreTrainedTokenizerFast
from vllm.sampling_params import SamplingParams
from vllm.v1.engine.detokenizer import IncrementalDetokenizer
given = json.load(sys.stdin)
toks = {name: PreTrainedTokenizerFast.from_pretrained(path) for name, path in given["tokenizers"].items()}
out = []
for c in given["cases"]:
    p = SamplingParams(stop=c["stop"], min_tokens=c["min_tokens"], include_stop_str_in_output=c["include"],
                       skip_special_tokens=c["skip"], spaces_between_special_tokens=c["spaces"], max_tokens=1000)
    d = IncrementalDetokenizer.from_new_request(toks[c["tok"]], SimpleNamespace(
        sampling_params=p, prompt_token_ids=c["prompt"], request_id="r", prompt_embeds=None))
    assert type(d).__name__ == "FastIncrementalDetokenizer"
    deltas = []
    for i, t in enumerate(c["ids"]):
        stop_token = t in c["stop_ids"] and i + 1 > c["min_tokens"]
        end = d.update([t], stop_token) is not None or stop_token or i == len(c["ids"]) - 1
        deltas.append(d.get_next_output_text(end, True))
        if end:
            break
    out.append(deltas)
print(json.dumps(out))
"""


def cases(name: str, tok, specials: list[int], rng: random.Random) -> list[dict]:
    out = []
    for _ in range(CASES):
        ids = tok.encode(" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 24))), add_special_tokens=False)
        for _ in range(rng.randint(0, 4)):
            ids.insert(rng.randint(0, len(ids)), rng.choice(specials))
        full = tok.decode(ids, skip_special_tokens=rng.random() < 0.5)
        cuts = [rng.randrange(len(full) + 1) for _ in range(rng.randint(0, 3))]
        stop = [s for s in (full[at : at + rng.randint(1, 6)] for at in cuts) if s]
        prompt = tok.encode(rng.choice(WORDS) + " x", add_special_tokens=False) + rng.choice([[], specials[:1]])
        out.append(
            dict(
                tok=name,
                prompt=prompt,
                ids=ids,
                stop=stop,
                stop_ids=rng.sample(ids, min(len(ids), rng.randint(0, 2))) if rng.random() < 0.4 else [],
                min_tokens=rng.choice([0, 0, 1, 3]),
                include=rng.random() < 0.5,
                skip=rng.random() < 0.5,
                spaces=rng.random() < 0.5,
            )
        )
    return out


def kvgate_deltas(tok, c: dict) -> list[str]:
    params = SamplingParams(
        stop=tuple(c["stop"]),
        min_tokens=c["min_tokens"],
        include_stop_str_in_output=c["include"],
        skip_special_tokens=c["skip"],
        spaces_between_special_tokens=c["spaces"],
    )
    d = Detokenizer(tok, c["prompt"], params)
    deltas = []
    for i, t in enumerate(c["ids"]):
        stop_token = t in c["stop_ids"] and i + 1 > c["min_tokens"]
        end = d.add(t, stop_token) or stop_token or i == len(c["ids"]) - 1
        deltas.append(d.flush(end))
        if end:
            break
    return deltas


@pytest.mark.timeout(600)
def test_the_deltas_are_vllms(tmp_path):
    python = need_vllm()
    smol = load_tokenizer("smollm2-135m")
    wp, vocab = wordpiece()
    wp.save_pretrained(tmp_path)
    toks = {"smol": smol, "wp": wp}
    rng = random.Random(0)
    given = cases("smol", smol, [0, 1, 2], rng)
    given += cases("wp", wp, [vocab["[CLS]"], vocab["[SEP]"], wp.convert_tokens_to_ids("<x>")], rng)
    paths = {"smol": str(resolve("smollm2-135m", tokenizer_only=True)), "wp": str(tmp_path)}
    body = json.dumps({"tokenizers": paths, "cases": given})
    done = subprocess.run([python, "-c", VLLM], input=body, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-3000:]
    want = json.loads(done.stdout.splitlines()[-1])
    for wrap in (lambda t: t, Windowed):
        got = [kvgate_deltas(wrap(toks[c["tok"]]), c) for c in given]
        wrong = [(c, g, w) for c, g, w in zip(given, got, want) if g != w]
        assert not wrong, f"{len(wrong)} of {len(given)} differ; the first: {wrong[0]}"
