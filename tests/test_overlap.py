"""An overlapping executor (the next step planned before this one's tokens are read) changes no
output: the same requests give the same tokens and finish reasons as one step at a time, the
pool gets every block back, and aborts, stop tokens, max_tokens, context limits and preemption
behave as without overlap (workers/inflight.py)."""

import dataclasses
import random

import pytest

from tests.sim_engine import sim_engine
from workers.config import EngineConfig
from workers.engine import Engine
from workers.executors.batch import SeqChunk
from workers.executors.torch_runner import TorchRunner
from workers.inflight import PLACEHOLDER
from workers.model_store import load_tokenizer
from workers.sampling_params import SamplingParams


class HostOverlap:
    """A sync executor made to overlap: `launch` computes at once, but the engine only sees the
    tokens at `collect`, one step later; placeholders are filled from the previous launch."""

    overlaps = True

    def __init__(self, executor):
        self.executor = executor
        self.last: list[int] = []
        self.launches = 0
        self.rows = 0

    def __getattr__(self, name):
        return getattr(self.executor, name)

    def launch(self, chunks: list[SeqChunk]):
        for i, c in enumerate(chunks):
            if c.prev_sample >= 0:
                assert c.token_ids == [PLACEHOLDER]
                chunks[i] = dataclasses.replace(c, token_ids=[self.last[c.prev_sample]])
            else:
                assert PLACEHOLDER not in c.token_ids
        tokens = self.executor.execute(chunks)
        self.last = [t for t in tokens if t is not None]
        self.launches += 1
        self.rows += sum(len(c.token_ids) for c in chunks)
        return tokens

    @staticmethod
    def collect(tokens):
        return tokens, 0.0


class OverlappingRunner(TorchRunner):
    """The torch runner's own launch/collect (device-side placeholder fill) on CPU, overlapped."""

    overlaps = True


def workload(seed: int, vocab: int) -> list[tuple[list[int], SamplingParams]]:
    """Shared prefixes, lengths across block edges, greedy and seeded sampling, short and long."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 20))]
    out = []
    for i in range(12):
        prompt = (shared if i % 2 else []) + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 30))]
        greedy = rng.random() < 0.6
        params = SamplingParams(
            max_tokens=rng.choice([1, 2, 3, 7, 16, 33]),
            temperature=0.0 if greedy else 0.8,
            top_k=0 if greedy else 20,
            seed=None if greedy else rng.randrange(1000),
            ignore_eos=rng.random() < 0.5,
        )
        out.append((prompt, params))
    return out


def run(engine: Engine, requests, abort_after: dict[int, int] | None = None) -> dict[str, tuple]:
    """Submit all, step to the end (aborting request i after `abort_after[i]` steps); per
    request: (token ids, finish reason, reported output count)."""
    got: dict[str, list] = {f"r{i}": [[], None, 0] for i in range(len(requests))}

    def sink(rid):
        def put(out):
            got[rid][0] += out.token_ids
            got[rid][1] = out.finish_reason or got[rid][1]
            got[rid][2] = out.num_output

        return put

    for i, (prompt, params) in enumerate(requests):
        engine.submit(f"r{i}", prompt, params, sink(f"r{i}"), detokenize=False)
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
        for i, at in (abort_after or {}).items():
            if steps == at:
                engine.abort(f"r{i}")
        assert steps < 10000
    assert engine.pool.num_free == engine.pool.num_blocks, "blocks leaked"
    return {rid: tuple(map(lambda x: tuple(x) if isinstance(x, list) else x, v)) for rid, v in got.items()}


def with_stops(requests, reference) -> list:
    """Give some requests a stop token they will meet: one of their own reference outputs."""
    out = []
    for i, (prompt, params) in enumerate(requests):
        toks = reference[f"r{i}"][0]
        if i % 3 == 0 and len(toks) > 2:
            params = dataclasses.replace(params, stop_token_ids=(toks[len(toks) // 2],))
        out.append((prompt, params))
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("num_blocks", [64, 14])
def test_overlapped_sim_engine_matches_one_step_at_a_time(seed, num_blocks):
    """14 blocks of 4 tokens force preemption (and recompute) under the same load."""
    requests = workload(seed, 1000)
    sync = run(sim_engine(num_blocks=num_blocks), requests)
    requests = with_stops(requests, sync)
    sync = run(sim_engine(num_blocks=num_blocks), requests)
    engine = sim_engine(num_blocks=num_blocks)
    engine._launcher = HostOverlap(engine.executor)
    engine._overlap = True
    assert run(engine, requests) == sync
    assert engine._launcher.launches > 0


def test_known_last_tokens_cost_no_extra_step():
    """A request whose next token is its last (max_tokens) is finishing from launch: without stop
    tokens or EOS, overlap computes exactly the tokens one step at a time computes."""
    requests = [(p, dataclasses.replace(params, ignore_eos=True)) for p, params in workload(3, 1000)]
    counted = []
    for overlap in (False, True):
        engine = sim_engine(num_blocks=64)
        engine._launcher, engine._overlap = HostOverlap(engine.executor), overlap
        run(engine, requests)
        counted.append(engine._launcher.rows)
    assert counted[0] == counted[1]


def test_overlapped_aborts_release_everything():
    requests = workload(7, 1000)
    engine = sim_engine(num_blocks=64)
    engine._launcher, engine._overlap = HostOverlap(engine.executor), True
    got = run(engine, requests, abort_after={0: 1, 1: 2, 2: 3, 5: 4})
    for i in (0, 1, 2, 5):
        assert got[f"r{i}"][1] in ("abort", "length", "stop")


def test_context_limit_stops_an_overlapped_request_at_the_limit():
    """A request reaching the context limit ends there, with one step in flight behind it."""
    engine = sim_engine(num_blocks=8, block_size=4)  # a 32-token context
    engine._launcher, engine._overlap = HostOverlap(engine.executor), True
    got = run(engine, [([5] * 20, SamplingParams(max_tokens=100, ignore_eos=True, temperature=0.0))])
    tokens, reason, count = got["r0"]
    assert (len(tokens), reason, count) == (12, "length", 12)


@pytest.mark.parametrize("seed", [0, 1])
def test_torch_runner_fills_placeholders_on_the_device(tiny_llama, seed):
    """The real runner's launch/collect with its own placeholder fill (CPU tensors): the same
    tokens as the runner one step at a time, with and without a pool small enough to preempt."""
    tok = load_tokenizer(str(tiny_llama))

    def engine(cls, blocks):
        runner = cls(str(tiny_llama), blocks, 4)
        return Engine(runner, tok, EngineConfig("m", 4, blocks, 64, 8))

    requests = workload(seed, 400)
    for blocks in (256, 24):
        sync = run(engine(TorchRunner, blocks), requests)
        assert run(engine(OverlappingRunner, blocks), requests) == sync


class HistoryCheck(HostOverlap):
    """At each launch, every request the scheduler holds keeps as its history exactly its
    resolved tokens (its token ids less the trailing placeholders)."""

    def __init__(self, executor, scheduler):
        super().__init__(executor)
        self.scheduler = scheduler

    def launch(self, chunks: list[SeqChunk]):
        for req in [*self.scheduler.running, *self.scheduler.waiting]:
            assert list(req.history) == req.token_ids[: len(req.token_ids) - req.unresolved]
        for c in chunks:
            if c.sample:
                assert len(c.history) + (c.prev_sample >= 0) == c.start_pos + len(c.token_ids)
        return super().launch(chunks)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_penalised_requests_history_is_its_resolved_tokens(overlap):
    """The penalties read a request's history, grown as its tokens resolve: through overlapped
    steps and preemption by recompute (14 blocks of 4 tokens) it neither doubles nor loses a
    token, and two choices of one prompt (n=2) each keep their own."""
    requests = [
        (prompt, dataclasses.replace(params, presence_penalty=0.5, repetition_penalty=1.2))
        for prompt, params in workload(4, 1000)
    ]
    requests.append(requests[-1])
    engine = sim_engine(num_blocks=14)
    engine._launcher, engine._overlap = HistoryCheck(engine.executor, engine.scheduler), overlap
    held = []
    add = engine.scheduler.add
    engine.scheduler.add = lambda req: (held.append(req), add(req))[1]
    got = run(engine, requests)
    assert engine.stats.preemptions > 0, "no preemption: the test would prove less"
    for req in held:
        assert list(req.history) == req.prompt_ids + list(got[req.request_id][0])
    assert held[-1].history is not held[-2].history
