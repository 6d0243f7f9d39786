"""vLLM's `allowed_token_ids` and `bad_words` as a hostile client sends them and as a worker samples
them. Parsing: vLLM 0.32's types, limits and messages (vllm/sampling_params.py), each refusal a
400 naming the field, alike in parse_request, check_request (what needs no tokenizer) and a sim
worker's HTTP answers for completions and chat. Sampling, through a real worker on a tiny random
Llama: only allowed tokens (greedy and sampled, whole and streamed, logprobs still raw), never a
banned sequence where the unbanned run makes it, and overlapped steps as one step at a time. With
vLLM's venv: its own tokenization and checks of the same fields give what kvgate's do."""

import dataclasses
import functools
import json
import random
import subprocess

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.json_values import json_values
from starlette.testclient import TestClient

from tests.test_overlap import OverlappingRunner, run
from tests.vllm_env import need_vllm
from workers.config import EngineConfig
from workers.engine import Engine
from workers.executors.sim import SimExecutor
from workers.executors.torch_runner import TorchRunner
from workers.kv.cost_model import CostModel
from workers.model_store import load_tokenizer
from workers.prompt_length import token_chars
from workers.protocol import check_request, parse_request
from workers.sampling_params import InvalidRequest, SamplingParams
from workers.server import WorkerServer
from workers.strict_json import loads

CUDA = torch.cuda.is_available()
CTX = 64
VOCAB = 1000  # the sim worker's: SmolLM2's tokenizer makes ids past it
PROMPT = [1, 17, 400, 3021, 77, 9, 400, 17]


@functools.cache
def tok():
    return load_tokenizer("smollm2-135m")


def parse(body: dict, kind: str = "completion", vocab: int | None = VOCAB):
    body = {"prompt": [5, 6, 7], "messages": [{"role": "user", "content": "hi"}], **body}
    del body["messages" if kind == "completion" else "prompt"]
    return parse_request(loads(json.dumps(body).encode()), kind, tok(), CTX, vocab)


def refused(body: dict, kind: str = "completion", vocab: int | None = VOCAB) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as e:
        parse(body, kind, vocab)
    return e.value


# -- parsing and validation ---------------------------------------------------------------------


def test_allowed_token_ids_are_taken_as_sent():
    """Repeats kept (vLLM counts them against its limit), null asks for nothing, 1,024 ids pass."""
    assert parse({"allowed_token_ids": [9, 5, 9]}).params.allowed_token_ids == (9, 5, 9)
    p = parse({"allowed_token_ids": None}).params
    assert p.allowed_token_ids is None and not p.processes_logits(0)
    assert len(parse({"allowed_token_ids": [7] * 1024}).params.allowed_token_ids) == 1024
    assert parse({"allowed_token_ids": [5]}).params.processes_logits(0)


def test_bad_words_tokenize_as_vllm_tokenizes_them():
    """vLLM 0.32's `update_from_tokenizer` on SmolLM2's tokenizer gave these (distinct words, in
    order; each stripped of leading whitespace, then with one leading space where that makes as
    many tokens with another first one: '  spaced' as ' spaced' is one token, so not)."""
    words = ["hello world", "  spaced", "the", "the", "x y z w"]
    got = parse({"bad_words": words}, vocab=None).params
    assert got.bad_words == ("hello world", "  spaced", "the", "x y z w")
    assert got.bad_words_token_ids == (
        (28120, 905),
        (33662, 905),
        (2401, 2568),
        (1195,),
        (260,),
        (104, 329, 1892, 267),
        (1792, 329, 1892, 267),
    )
    assert parse({"bad_words": None}).params.bad_words_token_ids == ()
    assert parse({"bad_words": []}, "chat").params.bad_words_token_ids == ()


def test_a_multi_token_bad_word_processes_no_logits_until_the_output_could_end_with_its_prefix():
    p = parse({"bad_words": ["x y z w"]}, vocab=None).params
    assert [p.processes_logits(n) for n in range(5)] == [False, False, False, True, True]
    assert p.reads_history and not parse({"bad_words": ["a"]}).params.reads_history


MANY_WORDS = [f"w{i}" for i in range(130)]
LONG_WORD = " ".join(["x"] * 600)  # 600 tokens, and 600 more with a leading space
REFUSALS = [
    ("allowed_token_ids", [], "allowed_token_ids is not None and empty! (parameter=allowed_token_ids, value=[])"),
    (
        "allowed_token_ids",
        [5, -1, VOCAB, 2**70],
        "allowed_token_ids contains out-of-vocab token id! (parameter=allowed_token_ids, "
        f"value=[-1, {VOCAB}, {2**70}])",
    ),
    ("allowed_token_ids", [7] * 1025, "Too many allowed token IDs: 1025. The max size is 1024."),
    ("allowed_token_ids", ["5"], "'allowed_token_ids' must be a list of token ids"),
    ("allowed_token_ids", [5.0], "'allowed_token_ids' must be a list of token ids"),
    ("allowed_token_ids", [True], "'allowed_token_ids' must be a list of token ids"),
    ("allowed_token_ids", 5, "'allowed_token_ids' must be a list of token ids"),
    ("allowed_token_ids", {"5": 1}, "'allowed_token_ids' must be a list of token ids"),
    ("bad_words", [""], "bad_words cannot contain an empty string. Got bad_words=['']"),
    ("bad_words", ["a", "", "a"], "bad_words cannot contain an empty string. Got bad_words=['a', '']"),
    (
        "bad_words",
        ["a", "\n"],
        "bad_words entries must tokenize to at least one token. (parameter=bad_words, value=['a', '\\n'])",
    ),
    ("bad_words", ["   "], "bad_words entries must tokenize to at least one token."),
    ("bad_words", MANY_WORDS, "Too many bad words after tokenization: 129. The max number is 128."),
    (
        "bad_words",
        ["a", "the"],
        f"The model vocabulary size is {VOCAB}, but the following tokens were specified as bad: [1195]. "
        f"All token id values should be integers satisfying: 0 <= token_id <= {VOCAB - 1}. "
        "(parameter=bad_words, value=['a', 'the'])",
    ),
    ("bad_words", [LONG_WORD], "Too many total bad word tokens: 1200. The max is 1024."),
    ("bad_words", "a", "'bad_words' must be a list of strings"),
    ("bad_words", [5], "'bad_words' must be a list of strings"),
    ("bad_words", [None], "'bad_words' must be a list of strings"),
    ("bad_words", {"a": 1}, "'bad_words' must be a list of strings"),
]


@pytest.mark.parametrize("field, value, message", REFUSALS)
@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_bad_value_is_a_400_naming_its_field_with_vllms_message(field, value, message, kind):
    e = refused({field: value}, kind, None if value == [LONG_WORD] else VOCAB)
    assert e.param == field and str(e).startswith(message), str(e)


def test_an_error_shows_a_long_list_cut_short():
    """vLLM shows the whole list; a client's megabyte of words is shown cut to ~20 kB."""
    words = [f"{i}" * 500 for i in range(2, 2000)]
    e = refused({"bad_words": [*words, ""]}, vocab=None)
    assert str(e).startswith("bad_words cannot contain an empty string. Got bad_words=['2222")
    assert e.param == "bad_words" and len(str(e)) < 25_000 and str(e).endswith("...]")
    e = refused({"allowed_token_ids": [-1] * 10**5})
    assert str(e).startswith("allowed_token_ids contains out-of-vocab token id! (parameter=allowed_token_ids")
    assert e.param == "allowed_token_ids" and len(str(e)) < 2_000


class Counting:
    """A tokenizer that records the longest text it was asked to encode, and all it encoded."""

    def __init__(self, tokenizer):
        self.tokenizer, self.longest, self.total = tokenizer, 0, 0

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.longest = max(self.longest, len(text))
        self.total += len(text)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)


def test_a_megabyte_bad_word_is_refused_without_tokenizing_it():
    counting = Counting(tok())
    body = {"model": "m", "prompt": [5], "bad_words": ["a", "ab " * 300_000]}
    with pytest.raises(InvalidRequest) as e:
        parse_request(body, "completion", counting, CTX)
    assert e.value.param == "bad_words" and "more than 1024" in str(e.value)
    assert counting.longest < 10_000


def test_words_that_together_surely_pass_the_token_bound_are_refused_without_tokenizing_them():
    """128 words of 30,000 letters (no space to cut a prefix at) each pass the one-word bound:
    together they cannot tokenize to 1,024 tokens or fewer, refused before any is tokenized.
    Words under that bound are tokenized whole (vLLM's count in its message): at most twice the
    characters 1,024 of the longest tokens hold."""
    rng = random.Random(7)
    letters = "abcdefghijklmnopqrstuvwxyz"
    for words, why, most in (
        (["".join(rng.choice(letters) for _ in range(30_000)) for _ in range(128)], "more than 1024", 0),
        (["".join(rng.choice(letters) for _ in range(700)) for _ in range(40)], "The max is 1024", None),
    ):
        counting = Counting(tok())
        with pytest.raises(InvalidRequest) as e:
            parse_request({"model": "m", "prompt": [5], "bad_words": words}, "completion", counting, CTX)
        assert e.value.param == "bad_words" and why in str(e.value)
        assert counting.total <= (2 * 1024 * (token_chars(tok()) or 0) if most is None else most)


def test_check_request_refuses_what_needs_no_tokenizer_or_vocabulary():
    """The gateway without a tokenizer: types, empty lists and strings, ids outside any
    vocabulary, too many ids; a word that tokenizes to nothing, too many sequences and an id past
    this model's vocabulary are the worker's to refuse."""
    check_request({"prompt": [1], "bad_words": ["\n", *MANY_WORDS], "allowed_token_ids": [10**6]}, "completion")
    for field, value, _ in REFUSALS:
        if field == "allowed_token_ids" or "" in value or not isinstance(value, list) or value == [5] or None in value:
            with pytest.raises(InvalidRequest) as e:
                check_request({"prompt": [1], field: value}, "completion")
            assert e.value.param == field


@settings(max_examples=200, deadline=None)
@given(
    field=st.sampled_from(["allowed_token_ids", "bad_words"]),
    value=json_values(8, 4),
)
def test_any_value_parses_or_is_a_400_naming_its_field(field, value):
    try:
        p = parse({field: value}).params
    except InvalidRequest as e:
        assert e.param == field
        return
    assert all(0 <= t < VOCAB for t in p.allowed_token_ids or ())
    assert all(0 <= t < VOCAB for seq in p.bad_words_token_ids for t in seq)


@pytest.fixture(scope="module")
def sim_client():
    sim = SimExecutor(CostModel(), VOCAB, (2,), 4096, lambda s: None, first_token_id=3)
    eng = Engine(sim, tok(), EngineConfig("m", block_size=4, num_blocks=64, max_batched_tokens=64, max_num_seqs=8))
    eng.start()
    with TestClient(WorkerServer(eng, "m", vocab_size=VOCAB).app, raise_server_exceptions=False) as c:
        yield c


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_sim_worker_serves_the_fields_and_refuses_bad_ones_by_name(sim_client, path, stream):
    """The sim has no logits: it takes and checks the fields, as it does logit_bias."""
    base = {"model": "m", "max_tokens": 4, "prompt": [5, 6, 7], "messages": [{"role": "user", "content": "hi"}]}
    base["stream"] = stream
    r = sim_client.post(path, json={**base, "allowed_token_ids": [5, 6], "bad_words": ["a", "b c"]})
    assert r.status_code == 200, r.text
    for field, value in (("allowed_token_ids", []), ("allowed_token_ids", [VOCAB]), ("bad_words", ["the"])):
        r = sim_client.post(path, json={**base, field: value})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == field and error["type"] == "invalid_request_error"


# -- sampling through a real worker -------------------------------------------------------------


@pytest.fixture(scope="module")
def worker(tiny_llama):
    runner = TorchRunner(str(tiny_llama), 128, 4)
    engine = Engine(runner, load_tokenizer(str(tiny_llama)), EngineConfig("m", 4, 128, 64, 8))
    engine.start()
    with TestClient(WorkerServer(engine, "m", runner.vocab_size).app, raise_server_exceptions=False) as client:
        yield client


def tokens(client, kind: str = "completion", stream: bool = False, **fields) -> list[int]:
    """The token ids a completion (or chat) answer of PROMPT's text gives, whole or streamed."""
    body = {"model": "m", "max_tokens": 10, "ignore_eos": True, "return_token_ids": True, "stream": stream, **fields}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": tok().decode(PROMPT)}]
    else:
        body["prompt"] = PROMPT
    r = client.post("/v1/chat/completions" if kind == "chat" else "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()["choices"][0]["token_ids"]
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    return [t for e in events for c in e["choices"] for t in c.get("token_ids") or ()]


ALLOWED = [11, 250, 4000, 18, 30000]


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("stream", [False, True])
def test_only_allowed_tokens_are_sampled(worker, kind, stream):
    assert not set(tokens(worker, kind, temperature=0)) <= set(ALLOWED), "the test would prove nothing"
    for fields in [{"temperature": 0}] + [{"temperature": 1.0, "seed": s} for s in range(4)]:
        got = tokens(worker, kind, stream, allowed_token_ids=ALLOWED, **fields)
        assert len(got) == 10 and set(got) <= set(ALLOWED), (fields, got)


def test_allowed_token_ids_leave_the_logprobs_raw(worker):
    """vLLM reports logprobs of the raw logits (logprobs_mode raw_logprobs), taken before its
    masks: the allowed run's first token shows the model's own top tokens, and its own raw
    log-probability."""
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "logprobs": 3}
    free = worker.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    body["allowed_token_ids"] = ALLOWED
    held = worker.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert held["tokens"][0] in {tok().decode([t]) for t in ALLOWED} and held["tokens"] != free["tokens"]
    raw = free["top_logprobs"][0]
    assert {k: v for k, v in held["top_logprobs"][0].items() if k != held["tokens"][0]}.items() <= raw.items()
    assert held["token_logprobs"][0] < free["token_logprobs"][0]


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_masks_that_leave_no_token_are_served(worker, temperature):
    """allowed_token_ids of EOS alone under min_tokens, or of a banned token: every logit -inf.
    vLLM samples some token then (none is right); the worker must answer, not fail its step."""
    assert (28,) in parse({"bad_words": [","]}, vocab=None).params.bad_words_token_ids
    eos = tok().eos_token_id
    for fields in ({"allowed_token_ids": [eos], "min_tokens": 3}, {"allowed_token_ids": [28], "bad_words": [","]}):
        assert len(tokens(worker, temperature=temperature, max_tokens=4, seed=1, **fields)) == 4


def contains(seq: list[int], sub: tuple[int, ...]) -> bool:
    return any(tuple(seq[i : i + len(sub)]) == sub for i in range(len(seq) - len(sub) + 1))


def banned_word(output: list[int]) -> tuple[str, tuple[tuple[int, ...], ...], int]:
    """A word whose forms (as bad_words tokenizes it) hold two tokens the output makes in a row,
    and where the second of them is."""
    for i in range(len(output) - 1):
        word = tok().decode(output[i : i + 2])
        try:
            forms = parse({"bad_words": [word]}, vocab=None).params.bad_words_token_ids
        except InvalidRequest:
            continue
        if tuple(output[i : i + 2]) in forms:
            return word, forms, i + 1
    pytest.fail(f"no two tokens of {output} make a bad word")


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_bad_word_is_never_made_where_the_unbanned_run_makes_it(worker, kind, stream):
    """A seeded run draws the same noise per output position, so with a bad word of its own
    output it makes the same tokens up to the banned one, and then another."""
    for seed in range(3):
        fields = {"temperature": 1.0, "seed": seed, "max_tokens": 16}
        free = tokens(worker, kind, **fields)
        word, forms, at = banned_word(free)
        got = tokens(worker, kind, stream, bad_words=[word], **fields)
        assert got[:at] == free[:at] and got[at] != free[at], (word, forms, free, got)
        assert not any(contains(got, form) for form in forms), (word, forms, got)


def test_a_one_token_bad_word_is_never_sampled(worker):
    free = tokens(worker, temperature=0)
    word = tok().decode(free[:1])
    forms = parse({"bad_words": [word]}, vocab=None).params.bad_words_token_ids
    assert (free[0],) in forms
    got = tokens(worker, temperature=0, bad_words=[word])
    assert got[0] != free[0] and not {f[0] for f in forms} & set(got)


def banned_workload(seed: int, free: dict[str, tuple]) -> list[tuple[list[int], SamplingParams]]:
    """Requests whose bad words are their own unbanned outputs' bigrams and trigrams, with
    allowed ids around them: greedy and seeded."""
    rng = random.Random(seed)
    out = []
    for i, (prompt, params) in enumerate(allowed_workload(seed)):
        made = list(free[f"r{i}"][0])
        starts = [rng.randrange(len(made) - 2) for _ in range(2)] if len(made) > 3 else []
        bad = tuple(tuple(made[s : s + rng.choice([2, 3])]) for s in starts) + ((rng.randrange(400),),)
        out.append((prompt, dataclasses.replace(params, bad_words_token_ids=bad)))
    return out


def allowed_workload(seed: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    out = []
    for i in range(10):
        prompt = [rng.randrange(3, 400) for _ in range(rng.randint(1, 14))]
        params = SamplingParams(
            max_tokens=rng.choice([2, 5, 9, 17]),
            temperature=0.0 if i % 2 else 0.9,
            seed=None if i % 2 else rng.randrange(1000),
            ignore_eos=True,
            allowed_token_ids=tuple(rng.sample(range(400), 40)) if i % 3 == 0 else None,
        )
        out.append((prompt, params))
    return out


@pytest.mark.parametrize("device", ["cuda", "cpu"] if CUDA else ["cpu"])
@pytest.mark.parametrize("blocks", [256, 24])
def test_overlapped_steps_ban_what_one_step_at_a_time_does(tiny_llama, device, blocks):
    """Placeholders (the previous launch's samples, on the device) in the tails bad words are
    matched against; 24 blocks of 4 tokens preempt and recompute."""
    tokenizer = load_tokenizer(str(tiny_llama))

    def engine(overlap: bool) -> Engine:
        cls = OverlappingRunner if overlap and device == "cpu" else TorchRunner
        runner = cls(str(tiny_llama), blocks, 4, device, torch.float32, max_num_seqs=8)
        eng = Engine(runner, tokenizer, EngineConfig("m", 4, blocks, 64, 8))
        eng._overlap = overlap
        return eng

    free = run(engine(False), allowed_workload(blocks))
    requests = banned_workload(blocks, free)
    sync = run(engine(False), requests)
    assert run(engine(True), requests) == sync
    assert sync != free, "the bad words changed nothing: the test would prove nothing"
    for i, (_, params) in enumerate(requests):
        made = list(sync[f"r{i}"][0])
        assert not any(contains(made, seq) for seq in params.bad_words_token_ids)
        assert params.allowed_token_ids is None or set(made) <= set(params.allowed_token_ids)


# -- against vLLM's own code --------------------------------------------------------------------

VLLM_CHECK = """
import json, sys
from vllm.sampling_params import SamplingParams
from vllm.tokenizers.registry import get_tokenizer

class Model:
    def __init__(self, vocab):
        self.vocab = vocab
    def get_vocab_size(self):
        return self.vocab

path, vocab, cases = json.loads(sys.stdin.read())
tok = get_tokenizer(path)
out = []
for field, value in cases:
    try:
        p = SamplingParams(**{field: value})
        p._validate_allowed_token_ids(Model(vocab))
        p.update_from_tokenizer(tok)
        out.append(["ok", p.allowed_token_ids, p.bad_words_token_ids, tok.max_token_id])
    except Exception as e:
        out.append(["error", str(e), getattr(e, "parameter", None)])
print(json.dumps(out))
"""


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_takes_and_refuses_what_kvgate_does():
    """vLLM 0.32's SamplingParams (`_verify_args`, `_validate_allowed_token_ids`,
    `update_from_tokenizer`) on the same values: the same token ids, or the same message. Only
    the limits its GPU runner holds (1,024 allowed ids, 1,024 bad-word tokens) are not here."""
    runner_limits = ("must be a list", "Too many allowed", "Too many total")  # types: pydantic's
    cases = [(f, v) for f, v, m in REFUSALS if not m.startswith(runner_limits) and "must be a list" not in m]
    cases += [
        ("bad_words", ["hello world", "  spaced", "the", "the", "don't", "New York City", "1234567", "你好", "🙂"]),
        ("bad_words", ["a", "a", " a", "é"]),
        ("allowed_token_ids", [5, 9, 5]),
    ]
    path = tok().name_or_path
    python = need_vllm()
    done = subprocess.run(
        [python, "-c", VLLM_CHECK], input=json.dumps([path, VOCAB, cases]), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    for (field, value), want in zip(cases, json.loads(done.stdout.splitlines()[-1])):
        vocab = want[3] + 1 if want[0] == "ok" else VOCAB
        try:
            p = parse({field: value}, vocab=vocab).params
        except InvalidRequest as e:
            assert want[0] == "error" and str(e) == want[1] and e.param == field, (field, value, want)
            continue
        assert want[0] == "ok", (field, value, want)
        assert p.allowed_token_ids == (tuple(want[1]) if want[1] is not None else None)
        assert p.bad_words_token_ids == tuple(map(tuple, want[2] or ()))
