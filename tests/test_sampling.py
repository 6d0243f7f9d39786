"""sample(): greedy is argmax, filters keep what they promise, seeds are batch-independent."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.sampling import sample
from workers.sampling_params import SamplingParams

V = 64


def _logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_and_top_k_1_are_argmax():
    logits = _logits(5)
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=1, temperature=2.0)] * 2
    params.append(SamplingParams(temperature=0.0, seed=3))
    assert sample(logits, params, [0] * 5) == logits.argmax(-1).tolist()


def test_tiny_top_p_picks_the_argmax():
    logits = _logits(8, seed=1)
    params = [SamplingParams(temperature=1.5, top_p=1e-6)] * 8
    assert sample(logits, params, list(range(8))) == logits.argmax(-1).tolist()


def test_seeded_rows_ignore_batch_composition():
    target = _logits(1, seed=2)[0]
    p = SamplingParams(temperature=1.0, seed=1234)
    alone = [sample(target[None], [p], [i])[0] for i in range(20)]
    for n_others in (1, 5):
        others = _logits(n_others, seed=3 + n_others)
        batch = torch.cat([others, target[None]])
        mixed = [SamplingParams(temperature=0.7), SamplingParams(temperature=0.0, seed=1)] * n_others
        params = mixed[:n_others] + [p]
        assert [sample(batch, params, [9] * n_others + [i])[-1] for i in range(20)] == alone
    assert len(set(alone)) > 1, "successive output indices must not reuse one random stream"


def test_different_seeds_differ():
    logits = torch.zeros(32, V)
    params = [SamplingParams(seed=s) for s in range(32)]
    assert len(set(sample(logits, params, [0] * 32))) > 8


@settings(max_examples=40, deadline=None)
@given(top_k=st.integers(1, V), top_p=st.floats(0.05, 1.0), seed=st.integers(0, 2**32))
def test_filters_keep_only_allowed_tokens(top_k, top_p, seed):
    logits = _logits(1, seed=seed % 1000)[0]
    params = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p, seed=seed)
    tokens = sample(logits.expand(16, V), [params] * 16, list(range(16)))
    ranked = logits.argsort(descending=True).tolist()
    probs = logits[ranked[:top_k]].softmax(-1)
    before = (probs.cumsum(-1) - probs).tolist()
    allowed = {t for t, mass in zip(ranked[:top_k], before) if mass < top_p + 1e-5 or top_p == 1.0}
    assert set(tokens) <= allowed


def test_temperature_follows_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    n = 20000
    params = [SamplingParams(temperature=0.5)] * n
    counts = torch.bincount(torch.tensor(sample(logits.expand(n, 4), params, [0] * n)), minlength=4)
    expected = (logits[0] / 0.5).softmax(-1) * n
    assert torch.allclose(counts.float(), expected, rtol=0.05, atol=30)


def test_high_temperature_flattens():
    logits = torch.tensor([[3.0, 0.0]])
    n = 4000
    hot = sample(logits.expand(n, 2), [SamplingParams(temperature=100.0)] * n, [0] * n)
    assert 0.4 < sum(hot) / n < 0.6
