"""The engine and the fleet simulator share one step lifecycle: the same request stream through
the real engine (sim executor, the simulator's token rule) and through a simulated worker gives
the same steps (work and cost), the same tokens and finish reasons, and the same KV events.

The stream has shared prefixes, a prompt cached but for its last token (a one-token prefill,
which both price as prefill), a second wave arriving mid-run, and a pool small enough to
preempt."""

from collections import deque

from bench.sim_worker import SimConfig, SimWorker, sim_executor
from workers.config import EngineConfig
from workers.engine import Engine
from workers.kv.cost_model import CostModel
from workers.request import Request
from workers.sampling_params import SamplingParams

B, BLOCKS = 16, 40
COST = CostModel(
    base_ms=2.0, prefill_token_ms=0.05, prefill_attn_ms=0.01, decode_seq_ms=0.5, decode_kv_token_ms=0.001, mixed_ms=0.7
)
PREFIX = list(range(500, 532))  # two full blocks


def stream(wave: bool = True) -> list[tuple[int, str, list[int], int]]:
    """(the step it arrives before, id, prompt, max_tokens); without `wave` all at once."""
    first = [(0, f"a{i}", PREFIX + list(range(600 + 10 * i, 600 + 10 * i + 5 + 7 * i)), 20 + 9 * i) for i in range(6)]
    second = [
        (25 if wave else 0, "long", list(range(900, 1100)), 30),
        (25 if wave else 0, "b0", PREFIX + list(range(1200, 1240)), 40),
        (60 if wave else 0, "one-token-prefill", PREFIX + [777], 12),
    ]
    return first + second


def params(i: int, max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=i)


def run_engine(wave: bool = True) -> tuple[list, dict, list]:
    engine = Engine(
        sim_executor(COST, BLOCKS * B),
        None,
        EngineConfig("sim", block_size=B, num_blocks=BLOCKS, max_batched_tokens=64, max_num_seqs=8),
    )
    outputs: dict[str, tuple[list[int], str | None]] = {}

    def sink(out) -> None:
        tokens, _ = outputs.get(out.request_id, ([], None))
        outputs[out.request_id] = (tokens + out.token_ids, out.finish_reason)

    arrivals, steps = stream(wave), 0
    while arrivals or engine.has_work():
        for i, (at, rid, prompt, n) in enumerate(arrivals):
            if at <= steps:
                engine.submit(rid, prompt, params(i, n), sink, detokenize=False)
        arrivals = [a for a in arrivals if a[0] > steps]
        engine.step()
        steps += 1
    events = [(e.kind, e.hashes, e.parent) for e in engine.events.after(0, limit=1 << 20).events]
    return [(s.work, COST.work_ms(s.work)) for s in engine.stats.recent], outputs, events


def run_sim(fast_forward: bool, wave: bool = True) -> tuple[list, dict, list]:
    outputs: dict[str, tuple[list[int], str | None]] = {}

    def finished(req: Request, now: float) -> None:
        outputs[req.request_id] = (req.output_ids, req.finish_reason)

    cfg = SimConfig(
        model_id="sim",
        block_size=B,
        num_blocks=BLOCKS,
        max_batched_tokens=64,
        max_num_seqs=8,
        max_model_len=BLOCKS * B,
        fast_forward=fast_forward,
    )
    w = SimWorker("w0", cfg, COST, finished)
    w.recent = deque()  # the whole step log, not the last few /state averages
    arrivals, t, steps = stream(wave), 0.0, 0
    nxt: float | None = 0.0
    while arrivals or nxt is not None:
        for i, (at, rid, prompt, n) in enumerate(arrivals):
            if at <= steps:
                w.submit(Request(rid, prompt, params(i, n), arrival=t), t)
        arrivals = [a for a in arrivals if a[0] > steps]
        nxt = w.advance(t)
        steps = len(w.recent) + (1 if w.plan is not None else 0)
        t = nxt if nxt is not None else t
    events = [(e.kind, e.hashes, e.parent) for e in w.events.after(0, limit=1 << 20).events]
    return [(s.work, s.ms) for s in w.recent], outputs, events


def test_engine_and_simulator_make_the_same_steps_tokens_and_events():
    steps, outputs, events = run_engine()
    sim_steps, sim_outputs, sim_events = run_sim(fast_forward=False)
    assert sim_steps == steps
    assert sim_outputs == outputs
    assert sim_events == events
    assert len(outputs) == len(stream()) and all(reason == "length" for _, reason in outputs.values())
    one_token = [w for w, _ in steps if w.prefill_tokens == 1]
    assert one_token, "the stream has a one-token prefill"


def test_fast_forward_keeps_the_engines_steps():
    """Decode segments (many decode steps as one event) log the steps the engine makes."""
    steps, outputs, _ = run_engine(wave=False)
    ff_steps, ff_outputs, _ = run_sim(fast_forward=True, wave=False)
    assert ff_outputs == outputs
    assert ff_steps == steps
