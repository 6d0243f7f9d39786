"""The sampling controls through a real worker on a tiny random Llama: a logit bias against the
greedy token changes it, min_tokens holds back an EOS the model would emit at once, a huge
repetition penalty leaves no token repeated; and with steps overlapped (placeholders filled from
the previous step's samples on the device) a penalised workload gives the tokens it gives one
step at a time (CPU: the runner's own launch/collect made to overlap; CUDA: as served)."""

import dataclasses
import json
import random
import shutil

import pytest
import torch
from starlette.testclient import TestClient

from tests.test_overlap import OverlappingRunner, run
from workers.config import EngineConfig
from workers.engine import Engine
from workers.executors.torch_runner import TorchRunner
from workers.generation_defaults import load_generation_defaults
from workers.model_store import load_tokenizer
from workers.sampling_params import SamplingParams
from workers.server import WorkerServer

CUDA = torch.cuda.is_available()
PROMPT = [1, 17, 400, 3021, 77, 9, 400, 17]


@pytest.fixture(scope="module")
def worker(tiny_llama):
    runner = TorchRunner(str(tiny_llama), 128, 4)
    engine = Engine(runner, load_tokenizer(str(tiny_llama)), EngineConfig("m", 4, 128, 64, 8))
    engine.start()
    with TestClient(WorkerServer(engine, "m", runner.vocab_size).app, raise_server_exceptions=False) as client:
        yield client, runner


def complete(client, **fields) -> dict:
    body = {"model": "m", "prompt": PROMPT, "temperature": 0, "return_token_ids": True, **fields}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_a_strong_negative_bias_on_the_greedy_token_changes_it(worker):
    client, _ = worker
    first = complete(client, max_tokens=1)["token_ids"][0]
    other = complete(client, max_tokens=1, logit_bias={str(first): -100})["token_ids"][0]
    assert other != first
    assert complete(client, max_tokens=1, logit_bias={str(other): 100})["token_ids"][0] == other


def test_min_tokens_delays_eos(worker):
    """EOS biased to win every step: it ends the answer at once, or right after min_tokens."""
    client, runner = worker
    eos = runner.eos_token_ids[0]
    at_once = complete(client, max_tokens=10, logit_bias={str(eos): 100})
    assert at_once["token_ids"] == [eos] and at_once["finish_reason"] == "stop"
    held = complete(client, max_tokens=10, min_tokens=5, logit_bias={str(eos): 100})
    assert held["finish_reason"] == "stop" and held["token_ids"][-1] == eos and len(held["token_ids"]) == 6
    assert eos not in held["token_ids"][:5]


def test_a_huge_repetition_penalty_repeats_nothing(worker):
    client, _ = worker
    tokens = complete(client, max_tokens=12, ignore_eos=True, repetition_penalty=1e6)["token_ids"]
    assert len(set(tokens)) == 12 and not set(tokens) & set(PROMPT)


def test_chat_takes_the_controls_too(worker):
    client, _ = worker
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    body |= {"presence_penalty": 1.0, "frequency_penalty": 0.5, "min_p": 0.1, "min_tokens": 4}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def penalised_workload(seed: int, vocab: int) -> list[tuple[list[int], SamplingParams]]:
    """Short prompts of few distinct tokens (so penalties bite), greedy and seeded, every control."""
    rng = random.Random(seed)
    out = []
    for i in range(10):
        prompt = [rng.randrange(3, 40) for _ in range(rng.randint(1, 14))]
        params = SamplingParams(
            max_tokens=rng.choice([2, 5, 9, 17]),
            temperature=0.0 if i % 2 else 0.9,
            seed=None if i % 2 else rng.randrange(1000),
            min_p=rng.choice([0.0, 0.05]),
            presence_penalty=rng.choice([0.0, 1.5]),
            frequency_penalty=rng.choice([0.0, -0.5, 1.0]),
            repetition_penalty=rng.choice([1.0, 1.3, 0.8]),
            min_tokens=rng.choice([0, 1, 3]),
            logit_bias=((rng.randrange(vocab), rng.choice([-5.0, 5.0])),),
        )
        out.append((prompt, params))
    return out


@pytest.mark.parametrize("device", ["cuda", "cpu"] if CUDA else ["cpu"])
@pytest.mark.parametrize("blocks", [256, 24])
def test_overlapped_steps_penalise_what_one_step_at_a_time_does(tiny_llama, device, blocks):
    """24 blocks of 4 tokens preempt and recompute (the history then is all prompt + output)."""
    tok = load_tokenizer(str(tiny_llama))

    def engine(overlap: bool) -> Engine:
        cls = OverlappingRunner if overlap and device == "cpu" else TorchRunner
        runner = cls(str(tiny_llama), blocks, 4, device, torch.float32, max_num_seqs=8)
        eng = Engine(runner, tok, EngineConfig("m", 4, blocks, 64, 8))
        eng._overlap = overlap
        return eng

    requests = penalised_workload(blocks, 400)
    sync = run(engine(False), requests)
    assert run(engine(True), requests) == sync
    unpenalised = [(p, dataclasses.replace(sp, repetition_penalty=1.0, presence_penalty=0.0)) for p, sp in requests]
    assert run(engine(False), unpenalised) != sync, "the penalties changed nothing: the test would prove nothing"


def test_the_models_generation_config_samples_what_a_request_leaves_out(tiny_llama, tmp_path):
    """A generation_config.json with temperature 0: requests that send none are greedy whatever
    their seed, and one that sends its own temperature samples."""
    model = tmp_path / "greedy-model"
    shutil.copytree(tiny_llama, model)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps(config | {"temperature": 0.0}))
    defaults = load_generation_defaults(model)
    runner = TorchRunner(str(model), 128, 4)
    config = EngineConfig("m", 4, 128, 64, 8, generation_defaults=defaults)
    engine = Engine(runner, load_tokenizer(str(model)), config)
    engine.start()
    server = WorkerServer(engine, "m", runner.vocab_size)
    with TestClient(server.app, raise_server_exceptions=False) as client:

        def tokens(**fields) -> list[int]:
            body = {"model": "m", "prompt": PROMPT, "max_tokens": 8, "ignore_eos": True, "return_token_ids": True}
            r = client.post("/v1/completions", json=body | fields)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]

        greedy = tokens(temperature=0)
        assert tokens(seed=1) == tokens(seed=2) == greedy
        assert tokens(seed=1, temperature=1.0) != tokens(seed=2, temperature=1.0)
