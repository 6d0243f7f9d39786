"""`cache_salt`: requests share cached blocks only with requests of the same salt, at the
worker (engine, KV transfer) and at the gateway (the hashes it routes by)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.tokenize import ModelTokenizer
from tests.sim_engine import drain, sim_engine
from workers.kv.hashing import block_hashes, salted_seed, seed_hash
from workers.protocol import parse_request
from workers.sampling_params import InvalidRequest, SamplingParams
from workers.transfer import KVSpec, decode, encode_header, import_payload

SEED = seed_hash("m", 4)


def test_no_salt_keeps_the_seed_and_salts_change_it():
    assert salted_seed(SEED, None) == salted_seed(SEED, "") == SEED
    seeds = {salted_seed(SEED, s) for s in ("a", "b", "tenant-1", "tenant-1\x00x", "\ud800")}
    assert len(seeds) == 5 and SEED not in seeds


@given(st.text(min_size=1), st.text(min_size=1))
def test_different_salts_never_give_the_same_chain(a, b):
    tokens = list(range(12))
    same = block_hashes(tokens, 4, salted_seed(SEED, a)) == block_hashes(tokens, 4, salted_seed(SEED, b))
    assert same == (a == b)


def run(eng, rid: str, prompt: list[int], salt: str | None) -> int:
    """Cached prompt tokens of one request run to the end."""
    outs = []
    eng.submit(rid, prompt, SamplingParams(max_tokens=2, ignore_eos=True), outs.append, cache_salt=salt)
    drain(eng)
    return outs[-1].num_cached


def test_the_engine_shares_blocks_only_within_a_salt():
    eng = sim_engine(num_blocks=64, block_size=4)
    prompt = list(range(3, 40))
    assert run(eng, "a1", prompt, "tenant-a") == 0
    assert run(eng, "b1", prompt, "tenant-b") == 0, "another tenant's prompt was a cache hit"
    assert run(eng, "n1", prompt, None) == 0, "an unsalted request hit a salted block"
    assert run(eng, "a2", prompt, "tenant-a") == 36
    assert run(eng, "n2", prompt, None) == 36


def test_salted_kv_transfer_verifies_only_under_its_salt():
    eng = sim_engine(num_blocks=16, block_size=4)
    prompt = list(range(3, 20))
    spec = KVSpec("m", 4, "none", 0, 0, 0)
    seed = salted_seed(eng.kv.seed, "tenant-a")
    hashes = block_hashes(prompt, 4, seed)
    blocks = [prompt[i : i + 4] for i in range(0, 16, 4)]
    with pytest.raises(InvalidRequest):
        decode(encode_header(spec, hashes, blocks, None), spec, eng.kv.seed)
    body = encode_header(spec, hashes, blocks, None, "tenant-a")
    assert import_payload(eng.pool, eng.executor, decode(body, spec, eng.kv.seed)) == (4, 0)
    assert run(eng, "b", prompt, "tenant-b") == 0
    assert run(eng, "a", prompt, "tenant-a") == 16


class Tok:
    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]


@pytest.mark.parametrize("salt", [1, ["a"], {"a": 1}, "x" * 257])
def test_a_bad_cache_salt_is_a_400(salt):
    with pytest.raises(InvalidRequest) as e:
        parse_request({"prompt": "hello", "cache_salt": salt}, "completion", Tok(), 100)
    assert e.value.param == "cache_salt"


def test_the_gateway_hashes_with_the_salt_as_the_worker_does():
    tok = ModelTokenizer("m", Tok(), 4)
    body = {"prompt": "abcdefghijklmnop"}
    plain = tok.prepare(dict(body), "completion", 100)
    salted = tok.prepare(dict(body, cache_salt="t"), "completion", 100)
    assert plain.hashes == block_hashes(plain.parsed.prompt_ids, 4, tok.seed)
    assert salted.hashes == block_hashes(salted.parsed.prompt_ids, 4, salted_seed(tok.seed, "t"))
    assert not set(plain.hashes) & set(salted.hashes)
