"""The penalties, logit_bias, min_tokens, allowed_token_ids, bad_words and min_p against references
written plainly here, row by row in Python: the batch equals each row processed alone, placeholders
are filled from the last step's samples on the device, rows that ask nothing are untouched, and a
step where no row asks gets its logits back as they were. On CUDA (when present) the same, and no
host sync in the step."""

import math
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from workers import logits_processors, sampling
from workers.executors.batch import SeqChunk
from workers.inflight import PLACEHOLDER, chunks_of
from workers.logits_processors import process_logits
from workers.sampling import sample, sample_tensor
from workers.request import Request
from workers.sampling_params import SamplingParams
from workers.scheduler import StepPlan, resolve

CUDA = torch.cuda.is_available()
DEVICES = ["cpu", "cuda"] if CUDA else ["cpu"]
EOS = (0,)


def chunk(prompt: list[int], output: list[int], params: SamplingParams, prev_sample: int = -1) -> SeqChunk:
    """The sampling chunk of a request with this prompt and output so far (its last token a
    placeholder when `prev_sample` >= 0), as the engine builds it: each token appended as a
    placeholder and resolved (workers/inflight.py, Scheduler.update_from_output)."""
    req = Request("r", list(prompt), params, sample_row=prev_sample)
    for i, t in enumerate(output):
        req.token_ids.append(PLACEHOLDER)
        req.unresolved += 1
        if prev_sample < 0 or i < len(output) - 1:
            resolve(req, t)
    req.num_computed = len(req.token_ids) - 1 if output else 0
    return chunks_of(StepPlan([(req, req.num_remaining)]))[0]


def reference(row: list[float], prompt: list[int], output: list[int], p: SamplingParams) -> list[float]:
    """vLLM's processing of one row, plainly: allowed_token_ids, min_tokens, logit_bias, the
    penalties, then bad_words (vllm/v1/sample/ops/bad_words.py: a sequence's last token is banned
    where the output, never the prompt, ends with the tokens before it)."""
    x = list(row)
    if p.allowed_token_ids is not None:
        x = [v if t in p.allowed_token_ids else -math.inf for t, v in enumerate(x)]
    if len(output) < p.min_tokens:
        for t in set(EOS) | set(p.stop_token_ids):
            x[t] = -math.inf
    for t, b in p.logit_bias:
        x[t] += b
    seen, counts = set(prompt) | set(output), Counter(output)
    for t in range(len(x)):
        if t in seen:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        x[t] -= p.frequency_penalty * counts[t] + p.presence_penalty * (counts[t] > 0)
    for seq in p.bad_words_token_ids:
        prefix = list(seq[:-1])
        if len(prefix) <= len(output) and output[len(output) - len(prefix) :] == prefix:
            x[seq[-1]] = -math.inf
    return x


@st.composite
def rows(draw, vocab: int):
    """(prompt, output, params, placeholder?) of one request."""
    token = st.integers(0, vocab - 1)
    prompt = draw(st.lists(token, min_size=1, max_size=12))
    output = draw(st.lists(token, max_size=12))
    penalty = st.floats(-2, 2, width=32)
    # bad words: some the output's own tail (with the prompt's end, which must not count) and a
    # token, so they match; others drawn at random
    ends = st.integers(0, 4).map(lambda k: (prompt + output)[len(prompt + output) - k :])
    seq = st.tuples(ends, token).map(lambda e: (*e[0], e[1])) | st.lists(token, min_size=1, max_size=4).map(tuple)
    params = SamplingParams(
        presence_penalty=draw(st.sampled_from([0.0]) | penalty),
        frequency_penalty=draw(st.sampled_from([0.0]) | penalty),
        repetition_penalty=draw(st.sampled_from([1.0]) | st.floats(0.0625, 16, width=32)),
        min_tokens=draw(st.integers(0, 14)),
        stop_token_ids=tuple(draw(st.lists(token, max_size=3))),
        logit_bias=tuple(sorted(draw(st.dictionaries(token, st.floats(-100, 100, width=32), max_size=4)).items())),
        allowed_token_ids=draw(st.none() | st.lists(token, min_size=1, max_size=6).map(tuple)),
        bad_words_token_ids=tuple(draw(st.lists(seq, max_size=5))),
    )
    return prompt, output, params, bool(output) and draw(st.booleans())


def run_rows(logits: torch.Tensor, batch: list, device: str = "cpu") -> torch.Tensor:
    """process_logits over the batch; a placeholder's token comes from a 'previous step' tensor."""
    prev = torch.tensor([r[1][-1] for r in batch if r[3]] or [0], device=device)
    chunks, k = [], 0
    for prompt, output, params, hole in batch:
        chunks.append(chunk(prompt, output, params, k if hole else -1))
        k += hole
    return process_logits(logits.to(device), chunks, EOS, prev).cpu()


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_the_batch_equals_the_reference_and_each_row_alone(data):
    vocab = data.draw(st.integers(2, 40))
    batch = data.draw(st.lists(rows(vocab), min_size=1, max_size=5))
    logits = torch.randn(len(batch), vocab, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 99)))) * 4
    got = run_rows(logits, batch)
    want = torch.tensor([reference(logits[i].tolist(), r[0], r[1], r[2]) for i, r in enumerate(batch)])
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-4)
    for i, r in enumerate(batch):
        assert torch.equal(run_rows(logits[i : i + 1], [r]), got[i : i + 1])


@pytest.mark.parametrize("device", DEVICES)
def test_device_results_equal_the_cpus(device):
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(5, 50, generator=g)
    p = SamplingParams(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=-0.2, min_tokens=4)
    batch = [
        ([1, 2, 3], [4, 4, 9], p, True),
        ([7], [], SamplingParams(), False),
        ([5, 5], [6], SamplingParams(logit_bias=((3, -100.0), (6, 2.5))), False),
        ([8, 9], [9, 1, 1], p, False),
        ([2], [5, 6, 7], SamplingParams(allowed_token_ids=(7, 3, 7), bad_words_token_ids=((6, 7, 3), (9,))), True),
    ]
    torch.testing.assert_close(run_rows(logits, batch, device), run_rows(logits, batch))


def test_rows_that_ask_nothing_keep_their_logits_and_the_rest_return_float32():
    logits = torch.randn(3, 20).to(torch.bfloat16)
    batch = [([1], [2], SamplingParams(), False), ([1], [2], SamplingParams(presence_penalty=1.0), False)] * 2
    got = run_rows(logits.repeat(2, 1)[:4], batch)
    assert got.dtype == torch.float32
    assert torch.equal(got[0], logits[0].float()) and torch.equal(got[2], logits[2].float())
    assert got[1, 2] == logits[1, 2].float() - 1.0


def test_a_step_without_controls_gets_its_logits_back_untouched(monkeypatch):
    """No row asks (the controls at their no-op values): the same tensor, nothing gathered or
    uploaded, and min_p's pass not run."""
    for name in ("_gather", "_upload"):
        monkeypatch.setattr(logits_processors, name, lambda *a: pytest.fail("a step without controls gathered"))
    monkeypatch.setattr(sampling, "_min_p", lambda *a: pytest.fail("min_p ran with no row asking"))
    logits = torch.randn(4, 30)
    noop = SamplingParams(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, min_tokens=0)
    chunks = [chunk([1, 2], [3], noop), chunk([4], [], SamplingParams(temperature=0.7, seed=2, min_tokens=0))]
    chunks.append(chunk([1], [5, 6], SamplingParams(min_tokens=2)))  # min_tokens already met
    chunks.append(chunk([1, 2], [], SamplingParams(bad_words_token_ids=((2, 3),))))  # only the output counts
    step = logits[:4]
    assert process_logits(step, chunks, EOS, None) is step
    sample(logits, [noop, SamplingParams(temperature=0.8, seed=1), noop, noop], [0, 1, 2, 3])


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.zeros(1, 10)
    p = SamplingParams(min_tokens=2, stop_token_ids=(7,), ignore_eos=True)  # EOS masked even when ignored
    masked = run_rows(logits, [([1], [3], p, False)])
    assert masked[0, 0] == masked[0, 7] == -math.inf and (masked[0, 1:7] == 0).all()
    assert torch.equal(run_rows(logits, [([1], [3, 4], p, False)]), logits)


class Unread(tuple):
    """A params tuple a step must not walk entry by entry."""

    def __iter__(self):
        raise AssertionError("a step walked the params' tuple")


def test_a_step_extends_from_arrays_built_with_the_params():
    """logit_bias, stop_token_ids, allowed_token_ids and the bad words' sequences become arrays
    once, with the params (ids distinct where that matters, those out of range left to validate's
    400; sequences by prefix length); a step reads those, never the tuples, so 1024 biases, stop
    ids or allowed ids cost a row a copy each, not a loop."""
    p = SamplingParams(
        min_tokens=3,
        stop_token_ids=(7, 7, 4, -1),
        logit_bias=((2, 1.5), (5, -100.0), (2**40, 1.0)),
        allowed_token_ids=(0, 2, 4, 5, 6, 7, 8, 9, -1),
        bad_words_token_ids=((3, 9, 8), (6,), (3, 9)),
    )
    assert (list(p.stop_id_array), list(p.logit_bias_ids), list(p.logit_bias_values)) == ([7, 4], [2, 5], [1.5, -100])
    assert list(p.allowed_id_array) == [0, 2, 4, 5, 6, 7, 8, 9]
    b = p.banned
    assert [list(a) for a in (b.lengths, b.ends, b.prefix, b.back, b.last)] == [
        [0, 1, 2],
        [0, 0, 1, 3],
        [3, 3, 9],
        [1, 2, 1],
        [6, 9, 8],
    ]
    assert [b.usable(n) for n in range(4)] == [1, 2, 3, 3]
    want = run_rows(torch.zeros(1, 10), [([1], [3, 9], p, False)])
    for name in ("stop_token_ids", "logit_bias", "allowed_token_ids", "bad_words_token_ids"):
        object.__setattr__(p, name, Unread(getattr(p, name)))
    assert torch.equal(run_rows(torch.zeros(1, 10), [([1], [3, 9], p, False)]), want)
    assert want[0, 0] == want[0, 4] == want[0, 7] == -math.inf and want[0, 2] == 1.5 and want[0, 5] == -100
    assert want[0, 1] == want[0, 3] == -math.inf  # not allowed
    assert want[0, 6] == want[0, 8] == -math.inf and want[0, 9] == 0  # banned: (6,) and (3, 9, 8)


def test_a_huge_repetition_penalty_stays_finite():
    """vLLM takes any finite penalty > 0; the device clamps it where float32 stays finite."""
    logits = torch.tensor([[0.0, 1.5, -2.0, 3.0]])
    for r, best in ((1e300, 3), (1e-300, 1)):  # the seen tokens pushed down, or up
        got = run_rows(logits, [([0, 1, 2], [], SamplingParams(repetition_penalty=r), False)])
        assert torch.isfinite(got).all() and got[0].argmax() == best


@settings(max_examples=60, deadline=None)
@given(min_p=st.floats(0.0, 1.0), temperature=st.floats(0.3, 3.0), seed=st.integers(0, 2**31))
def test_min_p_keeps_only_tokens_near_the_most_probable(min_p, temperature, seed):
    logits = torch.randn(1, 24, generator=torch.Generator().manual_seed(seed % 997)) * 3
    probs = (logits[0] / torch.tensor(temperature)).softmax(-1)
    allowed = set(torch.nonzero(probs >= probs.max() * min_p).flatten().tolist())
    params = [SamplingParams(temperature=temperature, min_p=min_p, seed=seed)] * 16
    assert set(sample(logits.expand(16, 24), params, list(range(16)))) <= allowed


def test_min_p_one_is_the_argmax_and_greedy_rows_ignore_it():
    logits = torch.randn(8, 40, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=1.5, min_p=1.0, seed=i) for i in range(4)]
    params += [SamplingParams(temperature=0.0, min_p=0.5)] * 4
    assert sample(logits, params, [0] * 8) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_rows_with_controls_ignore_the_batch(device):
    """A seeded, penalised request samples the same tokens alone or beside others."""
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(5, 64, generator=g).to(device)
    p = SamplingParams(temperature=0.9, seed=42, min_p=0.05, repetition_penalty=1.5, logit_bias=((7, 3.0),))
    target = chunk([1, 2, 3], [7, 7], p)
    others = [
        chunk([4, 5], [6], SamplingParams(temperature=0.7, presence_penalty=1.0)),
        chunk([9], [], SamplingParams(temperature=0.0, min_tokens=3)),
        chunk([8], [8], SamplingParams(temperature=1.2, min_p=0.2)),
        chunk([3], [], SamplingParams()),
    ]

    def tokens(chunks: list[SeqChunk], rows: torch.Tensor) -> list[int]:
        processed = process_logits(rows, chunks, EOS, None)
        return sample_tensor(processed, [c.params for c in chunks], [c.output_index for c in chunks]).tolist()

    alone = [tokens([target], logits[4:5])[0] for _ in range(3)]
    assert len(set(alone)) == 1
    assert tokens(others + [target], logits)[-1] == alone[0]
    assert tokens([others[1], target], logits[[1, 4]])[-1] == alone[0]


@pytest.mark.skipif(not CUDA, reason="host syncs exist only on CUDA")
def test_a_step_with_every_control_queues_without_a_host_sync():
    """process_logits and sample_tensor with all controls, a placeholder and seeded rows: under
    torch's sync debug mode any synchronising call raises."""
    logits = torch.randn(5, 128, device="cuda")
    prev = torch.tensor([6, 6], device="cuda")
    p = SamplingParams(temperature=0.8, seed=1, min_p=0.1, presence_penalty=0.5, repetition_penalty=1.2, min_tokens=9)
    chunks = [
        chunk([1, 2], [3, 4], p, prev_sample=1),
        chunk([1], [], SamplingParams(logit_bias=((2, 5.0),), frequency_penalty=1.0)),
        chunk([3], [3], SamplingParams(temperature=0.0)),
        chunk([7], [8, 9], SamplingParams(temperature=1.0, top_k=5, top_p=0.9)),
        chunk([7], [8, 6], SamplingParams(allowed_token_ids=(1, 2, 3), bad_words_token_ids=((8, 6, 2),)), 0),
    ]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        processed = process_logits(logits, chunks, EOS, prev)
        tokens = sample_tensor(processed, [c.params for c in chunks], [c.output_index for c in chunks])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert tokens.shape == (5,) and tokens[4] in (1, 3)
