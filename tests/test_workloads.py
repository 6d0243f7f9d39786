"""Workloads: seeded, sharing exactly what they claim to share, arriving at the asked rate."""

import json
from collections import Counter

import numpy as np
import pytest

from bench import make_trace
from bench.workloads import TRACE_BLOCK, WorkloadConfig, generate, trace_block


def reqs(**kw):
    return list(generate(WorkloadConfig(**kw)))


def gaps(rs):
    t = np.array([r.arrival_s for r in rs])
    return np.diff(t)


@pytest.mark.parametrize("name", ["shared-prefix", "multi-turn", "long-doc-qa", "skewed", "random", "mixed"])
def test_seeded_and_ordered(name):
    a = reqs(name=name, rate=20, duration_s=5, seed=3)
    b = reqs(name=name, rate=20, duration_s=5, seed=3)
    c = reqs(name=name, rate=20, duration_s=5, seed=4)
    assert [(r.arrival_s, r.prompt, r.max_tokens, r.session) for r in a] == [
        (r.arrival_s, r.prompt, r.max_tokens, r.session) for r in b
    ]
    assert [r.prompt for r in a] != [r.prompt for r in c]
    assert all(x.arrival_s <= y.arrival_s for x, y in zip(a, a[1:]))
    assert all(0 <= r.arrival_s < 5 for r in a)
    assert all(100 <= t < 32000 for r in a for t in r.prompt)


def test_shared_prefix_groups():
    rs = reqs(name="shared-prefix", rate=50, duration_s=10, groups=3, prefix_len=64, question_len=8, output_len=5)
    prefixes = {tuple(r.prompt[:64]) for r in rs}
    assert len(prefixes) == 3
    assert all(len(r.prompt) == 72 and r.max_tokens == 5 for r in rs)
    assert len({tuple(r.prompt[64:]) for r in rs}) == len(rs)
    by_group = {r.session: tuple(r.prompt[:64]) for r in rs}
    assert len(by_group) == 3


def test_skewed_gives_the_hot_prefixes_their_shares_and_spreads_the_rest():
    rs = reqs(name="skewed", rate=200, duration_s=20, prefix_len=32, question_len=8)
    share = Counter(r.session for r in rs)
    assert abs(share["group-0"] / len(rs) - 0.4) < 0.03 and abs(share["group-1"] / len(rs) - 0.2) < 0.03
    cold = [share[f"group-{g}"] / len(rs) for g in range(2, 48)]
    assert len(share) == 48 and max(cold) < 0.02
    with pytest.raises(ValueError, match="hot shares"):
        reqs(name="skewed", rate=5, duration_s=1, hot="0.7,0.5")


def test_long_doc_qa_defaults_are_few_long_documents():
    rs = reqs(name="long-doc-qa", rate=5, duration_s=10)
    assert len({tuple(r.prompt[:8192]) for r in rs}) <= 4
    assert all(len(r.prompt) == 8192 + 64 for r in rs)


def test_multi_turn_prompt_grows_from_previous_turn():
    rs = reqs(
        name="multi-turn", rate=10, duration_s=30, think_s=2, turns=4, prefix_len=32, question_len=8, output_len=4
    )
    sessions: dict[str, list] = {}
    for r in rs:
        sessions.setdefault(r.session, []).append(r)
    assert len(sessions) > 1
    for turns in sessions.values():
        assert len(turns) <= 4
        assert (len(turns[0].prompt) - 32 - 8) % 12 == 0
        for prev, nxt in zip(turns, turns[1:]):
            assert nxt.prompt[: len(prev.prompt)] == prev.prompt
            assert len(nxt.prompt) == len(prev.prompt) + 4 + 8
            assert 0.5 < nxt.arrival_s - prev.arrival_s < 10
    assert len({tuple(r.prompt[:32]) for r in rs}) == 1
    early = [len(r.prompt) for r in rs if r.arrival_s < 2]
    assert max(early) >= 32 + 3 * 12 + 8 and min(early) == 32 + 8


def test_mixed_is_long_unique_documents_among_chats_sharing_a_system_prompt():
    rs = reqs(
        name="mixed",
        rate=100,
        duration_s=20,
        long_fraction=0.3,
        input_len=1000,
        long_output_len=16,
        prefix_len=64,
        question_len=8,
        output_len=40,
    )
    long = [r for r in rs if r.session is None]
    chat = [r for r in rs if r.session == "chat"]
    assert len(long) + len(chat) == len(rs) and 0.25 < len(long) / len(rs) < 0.35
    assert all(500 <= len(r.prompt) <= 1500 and r.max_tokens == 16 for r in long)
    assert len({tuple(r.prompt[:16]) for r in long}) == len(long), "every document is new"
    assert all(len(r.prompt) == 72 and r.max_tokens == 40 for r in chat)
    assert len({tuple(r.prompt[:64]) for r in chat}) == 1
    assert len({tuple(r.prompt[64:]) for r in chat}) == len(chat)
    default = reqs(name="mixed", rate=50, duration_s=10)
    assert {r.max_tokens for r in default} == {64, 256}


def test_random_shares_nothing():
    rs = reqs(name="random", rate=20, duration_s=5, input_len=64)
    assert len({tuple(r.prompt[:16]) for r in rs}) == len(rs)
    assert all(32 <= len(r.prompt) <= 96 for r in rs)


def test_poisson_rate_and_gamma_burstiness():
    p = gaps(reqs(name="random", rate=100, duration_s=100, input_len=4))
    assert 1 / p.mean() == pytest.approx(100, rel=0.05)
    assert p.std() / p.mean() == pytest.approx(1.0, rel=0.1)
    g = gaps(reqs(name="random", rate=100, duration_s=100, input_len=4, arrival="gamma", burstiness=3.0))
    assert 1 / g.mean() == pytest.approx(100, rel=0.15)
    assert g.std() / g.mean() == pytest.approx(3.0, rel=0.2)


def write_trace(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_trace_equal_hash_ids_give_equal_tokens(tmp_path):
    rows = [
        {"timestamp": 0, "input_length": 1200, "output_length": 7, "hash_ids": [1, 2, 3]},
        {"timestamp": 500, "input_length": 700, "output_length": 3, "hash_ids": [1, 9]},
        {"timestamp": 1000, "input_length": 1100, "output_length": 5, "hash_ids": [4]},
    ]
    cfg = WorkloadConfig(name="trace", rate=0, duration_s=100, trace=write_trace(tmp_path / "t.jsonl", rows))
    a, b, c = generate(cfg)
    assert [len(r.prompt) for r in (a, b, c)] == [1200, 700, 1100]
    assert [r.max_tokens for r in (a, b, c)] == [7, 3, 5]
    assert [r.arrival_s for r in (a, b, c)] == [0.0, 0.5, 1.0]
    assert a.prompt[:TRACE_BLOCK] == b.prompt[:TRACE_BLOCK] == list(trace_block(1, 0, 32000))
    assert a.prompt[TRACE_BLOCK : 2 * TRACE_BLOCK] != b.prompt[TRACE_BLOCK : 2 * TRACE_BLOCK]
    assert c.prompt[:TRACE_BLOCK] == list(trace_block(4, 0, 32000))
    assert c.prompt[TRACE_BLOCK:] != a.prompt[TRACE_BLOCK:1100]


def test_trace_rate_rescales_time(tmp_path):
    rows = [{"timestamp": 1000 * i, "input_length": 16, "output_length": 1, "hash_ids": [i]} for i in range(11)]
    cfg = WorkloadConfig(name="trace", rate=5.5, duration_s=100, trace=write_trace(tmp_path / "t.jsonl", rows))
    rs = list(generate(cfg))
    assert rs[-1].arrival_s == pytest.approx(2.0)
    assert len(list(generate(WorkloadConfig(**{**cfg.__dict__, "duration_s": 0.9})))) == 5


def test_synthetic_mooncake_trace(tmp_path):
    out = tmp_path / "mc.jsonl"
    make_trace.main(["--requests", "400", "--rate", "10", "--out", str(out)])
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 400
    for r in rows:
        assert set(r) == {"timestamp", "input_length", "output_length", "hash_ids"}
        assert len(r["hash_ids"]) == -(-r["input_length"] // TRACE_BLOCK)
    assert 1 / np.diff([r["timestamp"] / 1000 for r in rows]).mean() == pytest.approx(10, rel=0.2)
    firsts = [r["hash_ids"][0] for r in rows]
    assert len(set(firsts)) < len(rows) * 0.7
    rs = list(generate(WorkloadConfig(name="trace", rate=0, duration_s=1e9, trace=str(out))))
    assert len(rs) == 400 and all(len(r.prompt) == row["input_length"] for r, row in zip(rs, rows))


def test_rate_zero_replays_a_trace_at_its_own_timestamps(tmp_path):
    """`--rate 0` on either CLI: a trace at its own mean rate (no time scaled), refused with a
    message for the other workloads and for negative rates; before any request is sent."""
    from bench import loadgen, simulate

    rows = [{"timestamp": 250 * i, "input_length": 32, "output_length": 2, "hash_ids": [i % 3]} for i in range(9)]
    path = write_trace(tmp_path / "t.jsonl", rows)
    out = tmp_path / "sim.json"
    simulate.main(
        [
            "--workers",
            "2",
            "--policies",
            "round_robin",
            "--workload",
            "trace",
            "--trace",
            path,
            "--rate",
            "0",
            "--duration",
            "10",
            "--drain-s",
            "5",
            "--jobs",
            "1",
            "--out",
            str(out),
        ]
    )
    [run] = json.loads(out.read_text())["policies"]["round_robin"]["runs"]
    assert run["rate_rps"] == pytest.approx(9 / 2.0) and run["requests"] == 9
    cfg = WorkloadConfig(name="trace", rate=run["rate_rps"], duration_s=10, trace=path)
    assert [r.arrival_s for r in generate(cfg)] == pytest.approx([0.25 * i for i in range(9)])
    for argv in (
        ["--workload", "random", "--rate", "0"],
        ["--workload", "trace", "--trace", path, "--rate", "-1"],
        ["--workload", "trace", "--rate", "0"],
    ):
        for main, extra in (
            (simulate.main, ["--workers", "1"]),
            (loadgen.main, ["serve", "--url", "http://127.0.0.1:9"]),
        ):
            with pytest.raises(SystemExit) as e:
                main(extra + argv + ["--out", str(tmp_path / "x.json")])
            assert "rate" in str(e.value.code) or "--trace" in str(e.value.code)
