"""Logprobs from the worker's engine equal HF's log-softmax of the raw logits at every position:
the sampled token's and the top-k, on SmolLM2-135M's real weights and on a tiny random Llama,
greedy and sampled (raw: temperature does not reshape them), with prefill cut into chunks."""

import functools

import pytest
import torch
from transformers import AutoModelForCausalLM

from workers.config import EngineConfig
from workers.engine import Engine
from workers.executors.torch_runner import TorchRunner
from workers.model_store import load_tokenizer, resolve
from workers.sampling_params import SamplingParams

NEW = 6


def engine_outputs(path: str, prompt: list[int], params: SamplingParams, chunk: int = 64) -> list:
    """The engine's outputs for one request, stepped by hand."""
    tok = load_tokenizer(path)
    engine = Engine(TorchRunner(path, 64, 4), tok, EngineConfig("m", 4, 64, chunk, 8))
    outs = []
    engine.submit("r", prompt, params, outs.append, detokenize=False)
    while engine.has_work():
        engine.step()
    return outs


@functools.cache
def hf_model(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_logprobs(path: str, ids: list[int]) -> torch.Tensor:
    """log-softmax of HF's logits at every position of `ids` (float32)."""
    with torch.inference_mode():
        return hf_model(path)(torch.tensor([ids])).logits[0].float().log_softmax(-1)


@pytest.fixture(scope="module", params=["smollm2", "tiny-llama"])
def model_path(request, tiny_llama) -> str:
    return str(resolve("smollm2-135m")) if request.param == "smollm2" else str(tiny_llama)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=5),
        SamplingParams(max_tokens=NEW, temperature=1.7, top_k=8, seed=3, ignore_eos=True, logprobs=3),
    ],
    ids=["greedy", "sampled"],
)
def test_logprobs_are_hf_log_softmax_of_the_raw_logits(model_path, params):
    tok = load_tokenizer(model_path)
    prompt = tok.encode("The capital of France is Paris, and the capital of Italy is")
    outs = engine_outputs(model_path, prompt, params, chunk=5)
    tokens = [t for o in outs for t in o.token_ids]
    entries = [e for o in outs for e in (o.logprobs or ())]
    assert len(tokens) == NEW and [e.token_id for e in entries] == tokens
    ref = hf_logprobs(model_path, prompt + tokens)
    for step, e in enumerate(entries):
        row = ref[len(prompt) - 1 + step]
        assert e.logprob == pytest.approx(row[e.token_id].item(), abs=2e-3)
        top = row.topk(params.logprobs)
        assert [t for t, _ in e.top] == top.indices.tolist()
        assert [lp for _, lp in e.top] == pytest.approx(top.values.tolist(), abs=2e-3)
        if params.temperature == 0.0:
            assert e.token_id == e.top[0][0]


def test_no_logprobs_unless_asked(tiny_llama):
    outs = engine_outputs(str(tiny_llama), [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
    assert all(o.logprobs is None for o in outs)


def test_zero_top_logprobs_still_reports_the_sampled_token(tiny_llama):
    outs = engine_outputs(
        str(tiny_llama), [5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0, logprobs=0)
    )
    entries = [e for o in outs for e in o.logprobs]
    assert len(entries) == 2 and all(e.top == [] and e.logprob <= 0 for e in entries)
