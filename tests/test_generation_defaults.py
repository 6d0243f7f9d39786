"""A model's sampling defaults (workers/generation_defaults.py) as vLLM applies them: read from
the model's generation_config.json (or another folder's, or none), overridden by the operator,
refused at start when a request could not have sent them, and taken by exactly the fields a
request leaves out; a chat's budget from `max_new_tokens`, a cap only where vLLM caps. Then a
sim worker built from its command line serves them."""

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from workers.cli import build_server, parser
from workers.kv.worker_state import WorkerState
from workers.generation_defaults import (
    NEUTRAL,
    GenerationDefaults,
    eos_token_ids,
    load_generation_defaults,
    read_generation_config,
)
from workers.model_store import load_tokenizer, resolve
from workers.protocol import parse_request, sampling_params
from workers.sampling_params import InvalidRequest

LLAMA3 = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "eos_token_id": [128001, 128009], "bos_token_id": 1}
OPENAI = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}


def folder(tmp_path: Path, config: dict | None, name: str = "model") -> Path:
    path = tmp_path / name
    path.mkdir()
    if config is not None:
        (path / "generation_config.json").write_text(json.dumps(config))
    return path


def test_auto_reads_the_model_folder_and_keeps_only_sampling_fields(tmp_path):
    d = load_generation_defaults(folder(tmp_path, LLAMA3 | {"max_new_tokens": 64, "top_k": 50}))
    assert d == GenerationDefaults(temperature=0.6, top_p=0.9, top_k=50, max_tokens=64)
    assert d.max_tokens_cap is None  # auto: a chat's default budget, never a cap


def test_no_file_or_vllm_means_openai_defaults(tmp_path):
    assert load_generation_defaults(folder(tmp_path, None)) == NEUTRAL
    assert load_generation_defaults(folder(tmp_path, LLAMA3, "m2"), "vllm") == NEUTRAL


def test_the_override_applies_over_any_source(tmp_path):
    model = folder(tmp_path, LLAMA3)
    assert load_generation_defaults(model, "vllm", '{"temperature": 0.2}') == GenerationDefaults(temperature=0.2)
    d = load_generation_defaults(model, "auto", '{"top_p": 0.5, "repetition_penalty": 1.1}')
    assert (d.temperature, d.top_p, d.repetition_penalty) == (0.6, 0.5, 1.1)


def test_caps_come_from_a_named_folder_or_the_override_only(tmp_path):
    model = folder(tmp_path, {"max_new_tokens": 100})
    other = folder(tmp_path, {"max_new_tokens": 40, "temperature": 0.0}, "other")
    assert load_generation_defaults(model).max_tokens_cap is None
    assert load_generation_defaults(model, str(other)) == GenerationDefaults(
        temperature=0.0, max_tokens=40, max_tokens_cap=40
    )
    assert load_generation_defaults(model, "auto", '{"max_new_tokens": 8}').max_tokens_cap == 8
    with pytest.raises(ValueError, match="holds no generation_config.json"):
        load_generation_defaults(model, str(tmp_path / "missing"))


@pytest.mark.parametrize(
    "config, why",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": "50"}, "top_k must be an integer"),
        ({"top_k": 1.5}, "top_k must be an integer"),
        ({"temperature": True}, "temperature must be a number"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"min_p": 2}, "min_p"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ([1, 2], "not a JSON object"),
    ],
)
def test_a_value_no_request_could_send_stops_the_worker_at_start(tmp_path, config, why):
    with pytest.raises(ValueError, match=why):
        load_generation_defaults(folder(tmp_path, config))


def test_broken_files_and_overrides_are_refused(tmp_path):
    model = folder(tmp_path, None)
    (model / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not readable JSON"):
        load_generation_defaults(model)
    for bad in ("{", "[1]", '"x"'):
        with pytest.raises(ValueError, match="override-generation-config"):
            load_generation_defaults(model, "vllm", bad)
    with pytest.raises(ValueError, match="temperature must be finite"):
        load_generation_defaults(model, "vllm", '{"temperature": NaN}')


def test_top_k_minus_one_reads_as_disabled(tmp_path):
    assert load_generation_defaults(folder(tmp_path, {"top_k": -1})).top_k == 0


def test_json_round_trip():
    d = GenerationDefaults(temperature=0.7, top_k=20, max_tokens=32, max_tokens_cap=32)
    assert GenerationDefaults.from_json(json.loads(json.dumps(d.to_json()))) == d
    assert NEUTRAL.to_json() == {}
    with pytest.raises(ValueError):
        GenerationDefaults.from_json({"top_p": 7})


FIELD_VALUES = {
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(1, 100),
    "min_p": st.floats(0, 1),
    "repetition_penalty": st.floats(0.5, 2),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
}


@st.composite
def some_fields(draw) -> dict:
    names = draw(st.sets(st.sampled_from(sorted(FIELD_VALUES))))
    return {n: draw(FIELD_VALUES[n]) for n in names}


@settings(max_examples=200, deadline=None)
@given(some_fields(), some_fields(), st.sets(st.sampled_from(sorted(FIELD_VALUES))))
def test_each_field_is_the_requests_else_the_models_else_openais(sent, model, nulls):
    """vLLM's order (its to_sampling_params): user -> server default -> OpenAI default; a null
    is a field left out."""
    body = sent | {n: None for n in nulls - set(sent)}
    params = sampling_params(body, 16, defaults=GenerationDefaults(**model))
    for name, openai in OPENAI.items():
        want = sent[name] if name in sent else model.get(name, openai)
        assert getattr(params, name) == pytest.approx(want), name


def chat(**fields) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hello there"}], **fields}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("smollm2-135m")


def test_a_chat_without_a_budget_takes_the_models_within_its_context(tok):
    parse = parse_request(chat(), "chat", tok, 512)
    left = 512 - len(parse.prompt_ids)
    assert parse.params.max_tokens == left
    assert parse_request(chat(), "chat", tok, 512, defaults=GenerationDefaults(max_tokens=32)).params.max_tokens == 32
    assert (
        parse_request(chat(), "chat", tok, 512, defaults=GenerationDefaults(max_tokens=10**6)).params.max_tokens == left
    )
    asked = parse_request(chat(max_tokens=50), "chat", tok, 512, defaults=GenerationDefaults(max_tokens=32))
    assert asked.params.max_tokens == 50  # a default, not a cap


def test_a_completion_keeps_openais_16_and_a_cap_bounds_every_budget(tok):
    body = {"model": "m", "prompt": [5, 6, 7]}
    assert (
        parse_request(body, "completion", tok, 512, defaults=GenerationDefaults(max_tokens=64)).params.max_tokens == 16
    )
    cap = GenerationDefaults(max_tokens=8, max_tokens_cap=8)
    assert parse_request(body | {"max_tokens": 300}, "completion", tok, 512, defaults=cap).params.max_tokens == 8
    assert parse_request(chat(max_tokens=300), "chat", tok, 512, defaults=cap).params.max_tokens == 8
    with pytest.raises(InvalidRequest, match="min_tokens"):
        parse_request(body | {"max_tokens": 300, "min_tokens": 20}, "completion", tok, 512, defaults=cap)


def sim_model(tmp_path: Path, generation: dict | None) -> Path:
    """A folder with the SmolLM2 tokenizer, a config.json the sim executor reads, and `generation`."""
    path = tmp_path / "sim-model"
    shutil.copytree(resolve("smollm2-135m", tokenizer_only=True), path)
    (path / "config.json").write_text(json.dumps({"vocab_size": 49152, "eos_token_id": 2}))
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))
    return path


def serve(path: Path, *flags: str):
    args = ["--executor", "sim", "--model", str(path), "--num-blocks", "64", "--max-model-len", "512", *flags]
    return build_server(parser().parse_args(args))


def test_a_sim_worker_serves_its_models_defaults(tmp_path):
    path = sim_model(tmp_path, {"max_new_tokens": 12, "eos_token_id": [2, 7], "temperature": 0.5})
    server = serve(path)
    try:
        assert server.generation_defaults == GenerationDefaults(temperature=0.5, max_tokens=12)
        assert server.engine.executor.eos_token_ids == (2, 7)  # the generation config's EOS ids too
        with TestClient(server.app) as client:
            r = client.post("/v1/chat/completions", json=chat(model=path.name, ignore_eos=True))
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 12
    finally:
        server.engine.stop()
    neutral = serve(path, "--generation-config", "vllm")
    try:
        assert neutral.generation_defaults == NEUTRAL
        assert neutral.engine.executor.eos_token_ids == (2, 7)  # vllm: no defaults, the model's EOS ids still
    finally:
        neutral.engine.stop()
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"eos_token_id": [9], "top_p": 0.5}))
    named = serve(path, "--generation-config", str(other))
    try:
        assert named.generation_defaults == GenerationDefaults(top_p=0.5)
        assert named.engine.executor.eos_token_ids == (2, 9)  # the tokenizer's, then the named config's
    finally:
        named.engine.stop()


def test_a_worker_with_a_bad_generation_config_does_not_start(tmp_path):
    path = sim_model(tmp_path, {"temperature": -0.5})
    with pytest.raises(SystemExit, match="temperature must be a finite number >= 0"):
        serve(path)
    for text, why in (
        ("{not json", "not readable JSON"),
        ("[1, 2]", "not a JSON object"),
        ('{"eos_token_id": [[1]]}', "eos"),
    ):
        (path / "generation_config.json").write_text(text)
        with pytest.raises(SystemExit, match=why):
            serve(path)
    with pytest.raises(SystemExit, match="override-generation-config"):
        serve(path, "--generation-config", "vllm", "--override-generation-config", "[]")


def test_a_workers_state_carries_its_defaults_and_a_bad_one_is_refused():
    """The gateway reads a request's budget as the worker will from the worker's state; a state
    whose defaults no request could send fails its poll like any malformed state."""
    base = {"worker_id": "w0", "model": "m"}
    good = GenerationDefaults(temperature=0.6, max_tokens=12)
    state = WorkerState.from_json(base | {"generation_defaults": good.to_json()})
    assert GenerationDefaults.from_json(state.generation_defaults) == good
    assert WorkerState.from_json(base).generation_defaults is None
    for bad in ({"temperature": -1}, {"top_k": "5"}, {"max_tokens": 0}, [1]):
        with pytest.raises(ValueError):
            WorkerState.from_json(base | {"generation_defaults": bad})


def test_without_a_generation_config_the_fields_vllm_keeps_of_config_json_count(tmp_path):
    """vLLM 0.32 (transformers 5.19) falls back to the folder's config.json, whose model config
    keeps max_new_tokens, min_p and eos_token_id of the generation fields, not temperature."""
    model = folder(tmp_path, None)
    legacy = {"temperature": 0.3, "top_p": 0.5, "max_new_tokens": 33, "min_p": 0.1, "eos_token_id": [2, 7]}
    (model / "config.json").write_text(json.dumps(legacy))
    assert load_generation_defaults(model) == GenerationDefaults(min_p=0.1, max_tokens=33)
    assert read_generation_config(model)["eos_token_id"] == [2, 7]
    named = load_generation_defaults(folder(tmp_path, None, "other-model"), str(model))
    assert named == GenerationDefaults(min_p=0.1, max_tokens=33, max_tokens_cap=33)
    with pytest.raises(ValueError, match="nor a config.json"):
        load_generation_defaults(model, str(folder(tmp_path, None, "empty")))


def test_the_eos_ids_are_the_tokenizers_then_the_generation_configs():
    assert eos_token_ids({"eos_token_id": [128001, 128009]}, 128009) == (128009, 128001)
    assert eos_token_ids({"eos_token_id": 5}, None) == (5,)
    assert eos_token_ids({}, 2) == (2,)


@pytest.mark.parametrize(
    "text, why",
    [
        ('{"temperature": 1' + "0" * 400 + "}", "finite and at most"),
        ('{"top_k": ' + "9" * 30 + "}", "finite and at most"),
        ("[" * 100_000 + "]" * 100_000, "not readable JSON"),
        ('{"eos_token_id": [[1, 2]]}', "eos_token_id must be a token id"),
        ('{"eos_token_id": -1}', "eos_token_id must be a token id"),
        ('{"eos_token_id": "2"}', "eos_token_id must be a token id"),
    ],
)
def test_files_past_any_range_or_depth_are_a_clean_refusal(tmp_path, text, why):
    model = folder(tmp_path, None)
    (model / "generation_config.json").write_text(text)
    with pytest.raises(ValueError, match=why):
        load_generation_defaults(model)
        read_generation_config(model)


def test_a_state_of_numbers_past_any_range_is_refused_not_an_overflow():
    for bad in ({"top_p": 10**400}, {"temperature": 10**30}, {"max_tokens": 2**70}):
        with pytest.raises(ValueError):
            WorkerState.from_json({"worker_id": "w0", "generation_defaults": bad})


def test_the_gateway_reads_a_models_defaults_only_where_all_its_workers_agree():
    """One worker capped by its operator must not make the gateway cap (or refuse) requests
    another worker of the model would serve: disagreeing workers, or a worker of another kind
    (whose defaults are unknown here), leave the gateway with none."""
    from gateway.fleet import Fleet
    from gateway.index import ResidencyIndex

    fleet = Fleet(ResidencyIndex())
    capped = GenerationDefaults(max_tokens=8, max_tokens_cap=8)

    def up(url: str, defaults: GenerationDefaults, model: str = "m"):
        w = fleet.add(url)
        fleet.up(w, {"worker_id": url, "model": model, "generation_defaults": defaults.to_json() or None})
        return w

    a = up("a", capped)
    assert fleet.generation_defaults("m") == capped and fleet.generation_defaults("other") == NEUTRAL
    b = up("b", capped)
    assert fleet.generation_defaults("m") == capped
    fleet.up(b, {"worker_id": "b", "model": "m"})  # restarted without the override
    assert b.generation_defaults == NEUTRAL and fleet.generation_defaults("m") == NEUTRAL
    fleet.up(b, {"worker_id": "b", "model": "m", "generation_defaults": capped.to_json()})
    b.kind = "vllm"
    assert fleet.generation_defaults("m") == NEUTRAL
    fleet.down(b, "gone")
    assert fleet.generation_defaults("m") == capped and a.healthy
