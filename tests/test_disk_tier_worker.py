"""The disk tier end to end: an engine on real models whose blocks go device -> host -> disk and
come back bit-identical with transformers' greedy output; worker processes started with
--disk-kv-dir/--disk-kv-gb (sim executor with Redis, tiny torch model) that publish the tier, hit
from it with the output of no tier at all, and leave no file behind."""

import random
from pathlib import Path

import httpx
import redis
import torch

from gateway.procs import Worker, start_redis, stop_all, wait_for, wait_redis
from workers.config import EngineConfig
from workers.engine import Engine
from workers.executors.torch_runner import TorchRunner
from workers.kv import redis_schema as rs
from workers.kv.events import DISK
from workers.kv.hashing import block_hashes
from workers.model_store import load_tokenizer
from tests.test_host_tier import hf_greedy, model_path, run  # noqa: F401 (model_path: a fixture)

MODEL = "smollm2-135m"
WORDS = "cache block token worker gateway prefix decode prefill route fleet queue page hash".split()


def settle(engine: Engine) -> None:
    """Let the disk jobs handed over so far finish and apply them (the engine does as it steps)."""
    assert engine.disk_io is not None
    while done := engine.disk_io.take_done(wait=True):
        for job in done:
            engine.pool.disk_done(job)


def test_round_trip_through_disk_matches_transformers(model_path, tmp_path):  # noqa: F811
    """A's blocks are evicted by B to host and written to disk, pushed out of host by C's, and
    read back from disk for A again: the K/V is bit-identical and the output transformers'."""
    tok = load_tokenizer(model_path)
    texts = [
        "The quick brown fox jumps over the lazy dog while the cache keeps every block it can. ",
        "Paged attention splits the key value cache into blocks that a scheduler hands out. ",
        "A gateway routes each request to the worker that holds the longest prefix of it. ",
    ]
    a, b, c = (tok.encode(t * 3)[:30] for t in texts)
    block, blocks = 4, 10
    runner = TorchRunner(model_path, blocks, block)
    config = EngineConfig("m", block, blocks, 64, 8, host_blocks=9, disk_blocks=64, disk_dir=str(tmp_path))
    engine = Engine(runner, tok, config)
    first, cached = run(engine, "a1", a)
    assert cached == 0
    hashes = block_hashes(a, block, engine.kv.seed)[: (len(a) - 1) // block]
    chunks = [tuple(a[i * block : (i + 1) * block]) for i in range(len(hashes))]
    before = {h: runner.read_blocks([engine.pool.lookup(h, t).block_id]).clone() for h, t in zip(hashes, chunks)}
    for rid, prompt in (("b", b), ("c", c)):
        run(engine, rid, prompt)
        settle(engine)
    on_disk = [h for h in hashes if h in engine.pool.disk_hashes() and h not in engine.pool.host_hashes()]
    assert on_disk and not any(engine.pool.lookup(h, t) for h, t in zip(on_disk, chunks)), "A's blocks: disk only"
    again, cached = run(engine, "a2", a)
    assert cached == len(hashes) * block, "the whole prefix is a hit, from every tier"
    assert engine.stats.disk_loaded_blocks >= len(on_disk)
    for h, t in zip(hashes, chunks):
        assert torch.equal(runner.read_blocks([engine.pool.lookup(h, t).block_id]), before[h])
    assert first == again == hf_greedy(model_path, tuple(a))
    assert engine.disk_io is not None and any(engine.disk_io.dir.iterdir())
    engine.disk_io.close()
    assert not any(Path(tmp_path).iterdir()), "the run's files are removed at shutdown"


def complete(url: str, prompt: str, model: str = MODEL, max_tokens: int = 2) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(url + "/v1/completions", timeout=120, json=body)
    r.raise_for_status()
    return r.json()


def test_a_sim_worker_spills_to_disk_publishes_the_tier_and_hits_from_it(tmp_path):
    """Host holds 16 blocks, each of 6 prompts about 10: the first prompt's blocks end up on disk only,
    in /kv/snapshot and Redis' disk set, and come back as a hit. A stale run directory of the same
    worker id is removed at start; the worker's own at shutdown."""
    logs, disk = str(tmp_path), tmp_path / "kv"
    stale = disk / "kvgate-d0-1-0123abcd"
    stale.mkdir(parents=True)
    (stale / "0000000000000001-1.kv").write_bytes(b"a block of an earlier run")
    server = wait_redis(start_redis(log_dir=logs))
    url = f"redis://127.0.0.1:{server.port}/0"
    extra = ["--num-blocks", "24", "--host-kv-gb", "0.0088", "--disk-kv-gb", "1", "--disk-kv-dir", str(disk)]
    w = Worker(worker_id="d0", redis=url, log_dir=logs, extra=extra)
    try:
        w.ready()
        assert not stale.exists(), "an earlier run's files are never served: removed at start"
        rng = random.Random(1)
        prompts = [" ".join(rng.choice(WORDS) for _ in range(150)) for _ in range(6)]
        for p in prompts:
            complete(w.url, p)
        state = w.state()
        assert state["host_blocks"] == 16 and state["disk_blocks"] == 2**30 // (16 * 36864)
        snap = w.internal("/kv/snapshot").json()
        disk_only = set(snap["tiers"][DISK]) - set(snap["tiers"]["host"]) - set(snap["hashes"])
        assert disk_only, "the first prompts' blocks were pushed out of host onto disk"
        r = redis.Redis(port=server.port)
        wait_for(lambda: int(r.get(rs.seq_key(MODEL, "d0")) or 0) == snap["seq"], timeout=30, what="events in redis")
        assert {int(h) for h in r.smembers(rs.resident_key(MODEL, "d0", DISK))} == set(snap["tiers"][DISK])
        again = complete(w.url, prompts[0])
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 * 8
        assert w.metric("kvgate_worker_disk_kv_loaded_blocks_total") > 0, "blocks came back from disk"
        run_dirs = list(disk.iterdir())
        assert len(run_dirs) == 1 and any(run_dirs[0].iterdir())
    finally:
        stop_all([w, server])
    assert not any(disk.iterdir()), "the run's files are removed at shutdown"


def test_a_torch_worker_gives_the_same_greedy_output_after_a_disk_round_trip(tiny_llama, tmp_path):
    """Tiny Llama on CPU (512 bytes of K/V per token, 16 host blocks): the first prompt's output
    with no tier in play equals its output once its prefix came back from disk."""
    gb = str(16 * 16 * 512 / 2**30 * 1.001)
    extra = ["--num-blocks", "24", "--host-kv-gb", gb, "--disk-kv-gb", "0.01", "--disk-kv-dir", str(tmp_path / "kv")]
    w = Worker("torch", worker_id="d1", model=str(tiny_llama), log_dir=str(tmp_path), extra=extra)
    try:
        w.ready()
        name = w.state()["model"]
        rng = random.Random(2)
        prompts = [" ".join(rng.choice(WORDS) for _ in range(150)) for _ in range(6)]
        first = [complete(w.url, p, name, 8) for p in prompts]
        assert all(f["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 for f in first[:1])
        again = complete(w.url, prompts[0], name, 8)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 * 8
        assert w.metric("kvgate_worker_disk_kv_loaded_blocks_total") > 0, "blocks came back from disk"
        assert again["choices"][0]["text"] == first[0]["choices"][0]["text"]
    finally:
        stop_all([w])
