"""A gateway in front of a sim worker whose model folder has a generation_config.json: the
worker serves a chat that asks for no budget with the model's `max_new_tokens`, and the gateway,
reading that default from the worker's state, charges the key's tokens-per-minute for that
budget (not for the whole context, which the key's budget could not hold)."""

import json
import shutil

import httpx
import pytest

from gateway.procs import Worker, start_gateway, stop_all
from workers.model_store import resolve

TPM = 200  # under the ~500 tokens a chat's whole context would charge, over prompt + 12


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    d = tmp_path_factory.mktemp("gen-defaults")
    model = d / "gen-model"
    shutil.copytree(resolve("smollm2-135m", tokenizer_only=True), model)
    (model / "config.json").write_text(json.dumps({"vocab_size": 49152, "eos_token_id": 2}))
    (model / "generation_config.json").write_text(json.dumps({"max_new_tokens": 12, "temperature": 0.5}))
    (d / "keys.json").write_text(json.dumps([{"key": "sk-t", "name": "t", "tpm": TPM}]))
    procs = []
    try:
        worker = Worker(model=str(model), log_dir=str(d), extra=["--max-model-len", "512", "--num-blocks", "64"])
        procs.append(worker)
        extra = ["--api-key-file", str(d / "keys.json"), "--model", str(model)]
        gateway = start_gateway([worker.url], "round_robin", name="gw", log_dir=str(d), extra=extra)
        procs.append(gateway)
        worker.ready()
        gateway.wait_ready("/health")
        yield gateway.url, model.name
    finally:
        stop_all(procs)


def chat(url: str, model: str, **fields) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True, **fields}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers={"authorization": "Bearer sk-t"}, timeout=60)


def test_a_chat_without_a_budget_gets_and_is_charged_the_models_default(fleet):
    url, model = fleet
    over = chat(url, model, max_tokens=TPM)
    assert over.status_code == 429, over.text  # the key's budget is in force
    r = chat(url, model)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 12


def test_a_response_shows_what_it_was_sampled_with(fleet):
    """vLLM's Response shows the temperature, top_p and budget it generated with: the model's
    defaults (and the budget they give) where the create set none, the create's own otherwise."""
    url, model = fleet
    headers = {"authorization": "Bearer sk-t"}
    r = httpx.post(f"{url}/v1/responses", json={"model": model, "input": "hi"}, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    shown = r.json()
    assert (shown["temperature"], shown["top_p"], shown["max_output_tokens"]) == (0.5, 1.0, 12)
    own = {"model": model, "input": "hi", "temperature": 0.9, "top_p": 0.8, "max_output_tokens": 5}
    r = httpx.post(f"{url}/v1/responses", json=own, headers=headers, timeout=60)
    assert (r.json()["temperature"], r.json()["top_p"], r.json()["max_output_tokens"]) == (0.9, 0.8, 5), r.text
