"""P/D block-batch export: a prefill that takes several steps hands its blocks to the exporter
in batches of at least `export_batch_blocks` as they are computed, as one unbroken chain."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.sim_engine import drain, sim_engine
from workers.kv.hashing import block_hashes
from workers.kv.transfer_time import num_batches
from workers.sampling_params import SamplingParams


def exported(batch_blocks: int, prompt_len: int = 100) -> tuple[list[tuple[int, int | None]], list[int], object]:
    """Prefill `prompt_len` tokens in 32-token steps (4-token blocks); returns each export call's
    (blocks, parent), the hashes exported in order, and the engine."""
    eng = sim_engine(num_blocks=64, block_size=4, max_batched_tokens=32, export_batch_blocks=batch_blocks)
    calls, hashes = [], []

    def export(hs, tokens, ids, parent):
        assert all(len(t) == 4 for t in tokens) and len(ids) == len(hs)
        assert all(eng.pool.blocks[i].ref_count > 0 for i in ids), "blocks are held while exported"
        calls.append((len(hs), parent))
        hashes.extend(hs)

    eng.submit(
        "r",
        list(range(10, 10 + prompt_len)),
        SamplingParams(max_tokens=1, temperature=0),
        lambda out: None,
        detokenize=False,
        export=export,
    )
    drain(eng)
    return calls, hashes, eng


@pytest.mark.parametrize("batch, sizes", [(0, [25]), (4, [8, 8, 8, 1]), (8, [8, 8, 8, 1]), (9, [16, 9]), (100, [25])])
def test_batches_follow_prefill_steps_and_form_one_chain(batch, sizes):
    calls, hashes, eng = exported(batch)
    assert [n for n, _ in calls] == sizes
    assert hashes == block_hashes(list(range(10, 110)), 4, eng.kv.seed)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    assert [p for _, p in calls] == [None] + [hashes[s - 1] for s in starts[1:]], "each batch continues the last"
    assert eng.pool.num_free == eng.pool.num_blocks, "every exported block was let go"


@settings(max_examples=60, deadline=None)
@given(st.integers(4, 250), st.integers(0, 40))
def test_the_timing_model_counts_the_batches_the_engine_makes(prompt_len, batch):
    """workers/kv/transfer_time.num_batches, which the predictor prices a transfer by, agrees
    with the engine's own export calls (32-token steps, 4-token blocks; prompts the pool holds)."""
    calls, _, _ = exported(batch, prompt_len)
    assert len(calls) == num_batches(prompt_len // 4, 32, 4, batch)
