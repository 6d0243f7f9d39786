"""min_tokens, vLLM's rule: no stop (EOS, a stop token id, a stop string) among the first
`min_tokens` output tokens; a stop string counts only where it ends after their text (it may
start inside it); max_tokens and the context still end a request. The sampler masks the stop
tokens (tests/test_logits_processors.py); here the detokenizer and the scheduler, which also hold
for an executor without logits (the sim, whose synthetic tokens may hit a stop token early)."""

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.sim_engine import CharTokenizer, drain, sim_engine
from workers.detokenizer import Detokenizer
from workers.sampling_params import SamplingParams


class Letters:
    """Token i decodes to one letter."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


def first_stop(ids: list[int], stop: tuple[str, ...], min_tokens: int) -> int | None:
    """The index of the token that hits a stop string, by the detokenizer."""
    d = Detokenizer(Letters(), [], SamplingParams(stop=stop, min_tokens=min_tokens))
    return next((i for i, t in enumerate(ids) if d.add(t)), None)


def reference(ids: list[int], stop: tuple[str, ...], min_tokens: int) -> int | None:
    """vLLM's rule, plainly: the first token past `min_tokens` whose text completes a stop
    string that ends after the first `min_tokens` tokens' text."""
    texts = ["".join(chr(97 + t % 26) for t in ids[:k]) for k in range(len(ids) + 1)]
    floor = len(texts[min(min_tokens, len(ids))])
    for k in range(min_tokens + 1, len(ids) + 1):
        text, before = texts[k], len(texts[k - 1])
        for s in stop:
            if any(text.startswith(s, at) for at in range(len(text) - len(s) + 1) if at + len(s) > max(before, floor)):
                return k - 1
    return None


def test_a_stop_string_counts_only_where_it_ends_past_min_tokens():
    ids = [0, 1, 2, 3]  # "abcd"
    assert first_stop(ids, ("bc",), 0) == 2
    assert first_stop(ids, ("bc",), 2) == 2  # starts inside the first two tokens' text, ends after
    assert first_stop(ids, ("bc",), 3) is None  # ends within the first three's
    assert first_stop(ids, ("ab", "d"), 1) == 1


@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(st.integers(0, 3), max_size=14),
    stop=st.lists(st.text("abcd", min_size=1, max_size=3), min_size=1, max_size=3),
    min_tokens=st.integers(0, 10),
)
def test_the_detokenizer_stops_where_vllm_does(ids, stop, min_tokens):
    assert first_stop(ids, tuple(stop), min_tokens) == reference(ids, tuple(stop), min_tokens)


def outputs(params: SamplingParams) -> tuple[list[int], str | None]:
    engine = sim_engine()
    got: list = [[], None]

    def sink(out):
        got[0] += out.token_ids
        got[1] = out.finish_reason or got[1]

    engine.submit("r", [5, 6, 7, 8], params, sink, detokenize=True)
    drain(engine)
    return got[0], got[1]


def test_an_early_stop_token_of_a_sim_does_not_end_the_request_before_min_tokens():
    free = SamplingParams(max_tokens=8, temperature=0.0)
    tokens, reason = outputs(free)
    assert reason == "length" and len(set(tokens)) == 8
    stop = dataclasses.replace(free, stop_token_ids=(tokens[1],))
    assert outputs(stop) == (tokens[:2], "stop")
    assert outputs(dataclasses.replace(stop, min_tokens=1)) == (tokens[:2], "stop")  # the 2nd may stop
    assert outputs(dataclasses.replace(stop, min_tokens=2)) == (tokens, "length")  # emitted as a token


def test_min_tokens_holds_back_stop_strings_not_max_tokens():
    free = SamplingParams(max_tokens=6, temperature=0.0)
    tokens, _ = outputs(free)
    text = CharTokenizer().decode(tokens)
    stop = dataclasses.replace(free, stop=(text[1:3],))
    assert outputs(stop)[0] == tokens[:3]
    assert outputs(dataclasses.replace(stop, min_tokens=2))[0] == tokens[:3]
    assert outputs(dataclasses.replace(stop, min_tokens=3)) == (tokens, "length")
    assert outputs(dataclasses.replace(free, min_tokens=6)) == (tokens, "length")
