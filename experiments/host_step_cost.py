"""Host time per engine step with a device that costs nothing: what the CPU spends around a
decode step of n sequences (scheduling, placeholders, inputs, resolving, outputs).

The executor overlaps like the torch runner on CUDA (launch returns at once, collect later) and
builds the decode step's host inputs (`decode_inputs`) as the graph path does, so the figure is
the host's share of a real decode step; on the H200 it must stay well under the GPU's ~2.6 ms.

    PYTHONPATH=. python experiments/host_step_cost.py --seqs 256 --steps 200 [--profile]
"""

import argparse
import cProfile
import gc
import pstats
import time

from workers.config import EngineConfig
from workers.engine import Engine
from workers.startup_heap import settle_gc
from workers.executors.kernel_inputs import decode_inputs, is_decode
from workers.executors.sim import SimExecutor
from workers.kv.cost_model import CostModel
from workers.sampling_params import SamplingParams


class FreeOverlapping(SimExecutor):
    """Sim tokens, no wait, launch/collect like an overlapping device."""

    overlaps = True

    def launch(self, chunks):
        t0 = time.perf_counter()
        if is_decode(chunks):
            decode_inputs(chunks, 16)
        return [self.token(c) if c.sample else None for c in chunks], (time.perf_counter() - t0) * 1000

    @staticmethod
    def collect(handle):
        return handle


class GcPauses:
    """Collections per generation, their total and longest pause, while attached."""

    def __init__(self):
        self.count, self.ms, self.longest, self._t0 = [0, 0, 0], [0.0, 0.0, 0.0], 0.0, 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        ms = (time.perf_counter() - self._t0) * 1000
        self.count[info["generation"]] += 1
        self.ms[info["generation"]] += ms
        self.longest = max(self.longest, ms)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seqs", type=int, default=256)
    p.add_argument("--prompt", type=int, default=600)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--gc-threshold", type=int, default=0, help="generation-0 threshold (0: Python's)")
    p.add_argument(
        "--freeze",
        action="store_true",
        help="workers.startup_heap.settle_gc() before the timed steps, as the worker does",
    )
    p.add_argument("--sort", default="tottime", help="cProfile order: tottime or cumulative")
    a = p.parse_args()
    ex = FreeOverlapping(CostModel(), 49152, wait=lambda s: None)
    blocks = a.seqs * ((a.prompt + a.steps + 40) // 16 + 1)
    eng = Engine(ex, None, EngineConfig("m", 16, blocks, 16384, a.seqs))
    for i in range(a.seqs):
        eng.submit(
            f"s{i}",
            [(i * 7919 + j) % 30000 for j in range(a.prompt)],
            SamplingParams(max_tokens=a.steps + 20, temperature=0.0, ignore_eos=True),
            lambda out: None,
            detokenize=False,
        )
    while eng.stats.generated_tokens < a.seqs:  # every prompt prefilled
        eng.step()
    if a.freeze:
        settle_gc()
    if a.gc_threshold:
        gc.set_threshold(a.gc_threshold, 10, 10)  # after --freeze: overrides its threshold
    prof = cProfile.Profile() if a.profile else None
    if prof:
        prof.enable()
    pauses = GcPauses()
    gc.callbacks.append(pauses)
    t0 = time.perf_counter()
    for _ in range(a.steps):
        eng.step()
    ms = (time.perf_counter() - t0) * 1000 / a.steps
    gc.callbacks.remove(pauses)
    if prof:
        prof.disable()
        pstats.Stats(prof).sort_stats(a.sort).print_stats(30)
    print(
        f"{a.seqs} decoding sequences: {ms:.3f} ms host per engine step; gc collections per generation "
        f"{pauses.count}, {[round(x, 1) for x in pauses.ms]} ms, longest {pauses.longest:.1f} ms"
    )


if __name__ == "__main__":
    main()
