"""The report: SLO attainment with failures as misses, DistServe goodput, JSON and plots."""

import json
import math
import sys

import pytest

from bench import report as rep
from bench.plots import plot_report
from tests.sim_report import ENTRY_METRICS, two_policy_sim


def rec(ttft, e2e, out=11, prompt=100, cached=50, error=None, arrival=0.0, worker="w0"):
    return {
        "arrival_s": arrival,
        "prompt_tokens": prompt,
        "output_tokens": out,
        "cached_tokens": cached,
        "ttft_ms": ttft,
        "e2e_ms": e2e,
        "tpot_ms": rep.tpot_ms(ttft, e2e, out) if ttft is not None else None,
        "worker": worker,
        "error": error,
    }


def test_meets_slo():
    assert rep.meets_slo(rec(100, 200), 150, 20)
    assert not rep.meets_slo(rec(200, 300), 150, 20)
    assert not rep.meets_slo(rec(100, 400), 150, 20)
    assert rep.meets_slo(rec(100, 100, out=1), 150, 1e-9)
    assert not rep.meets_slo(rec(None, None, error="http 500: boom"), 150, 20)
    assert rep.tpot_ms(100, 200, 1) is None
    assert rep.tpot_ms(100, 200, 11) == 10


def test_summarize():
    rs = [rec(100 * (i + 1), 100 * (i + 1) + 100, arrival=i * 0.5, worker=f"w{i % 2}") for i in range(10)]
    rs.append(rec(None, None, out=0, error="rejected: full", arrival=1.0))
    s = rep.summarize(rs, slo_ttft_ms=500, slo_tpot_ms=20)
    assert s["requests"] == 11 and s["completed"] == 10 and s["errors"] == 1
    assert s["error_kinds"] == {"rejected": 1}
    assert s["slo_attainment"] == pytest.approx(5 / 11)
    assert s["ttft_p50_ms"] == pytest.approx(550)
    assert s["tpot_p90_ms"] == pytest.approx(10)
    assert s["cached_token_ratio"] == pytest.approx(0.5)
    span = 4.5 + 1.1
    assert s["span_s"] == pytest.approx(span)
    assert s["throughput_rps"] == pytest.approx(10 / span)
    assert s["throughput_tok_s"] == pytest.approx(110 / span)
    assert s["workers_used"] == 2 and s["worker_imbalance"] == 1.0
    assert len(s["cdf"]["ttft"]) == rep.CDF_POINTS and s["cdf"]["ttft"][0] == 100


def test_summarize_itl_when_present():
    r = rec(100, 200)
    r["itl_ms"] = [5.0, 15.0]
    s = rep.summarize([r], 500, 50)
    assert s["itl_p50_ms"] == 10.0 and s["cdf"]["itl"][0] == 5.0


def test_goodput_interpolates_between_passing_and_failing_rates():
    g, how = rep.goodput([(4, 0.5), (1, 1.0), (2, 0.95)])
    assert how == "interpolated" and g == pytest.approx(2 + 0.05 / 0.45 * 2)
    assert rep.goodput([(1, 1.0), (2, 0.95)]) == (2, "at_highest_rate")
    assert rep.goodput([(1, 0.5), (2, 0.1)]) == (0.0, "below_lowest_rate")
    assert rep.goodput([(1, 0.9), (2, 0.2)]) == (1, "interpolated")


def sweep() -> dict:
    """Policies a and b at 1, 2 and 4 req/s, each run's TTFT growing with its rate."""
    return {
        name: [
            {"rate_rps": r, **rep.summarize([rec(50 * r * k, 50 * r * k + 100) for k in range(1, 5)], 300, 50)}
            for r in (1, 2, 4)
        ]
        for name in ("a", "b")
    }


def test_build_write_and_plot(tmp_path):
    runs = sweep()
    report = rep.build(runs, {"title": "t", "slo_ttft_ms": 300, "slo_tpot_ms": 50})
    for e in report["policies"].values():
        for key in ENTRY_METRICS:
            assert key in e
    assert report["reference_rate_rps"] == 1
    assert report["policies"]["a"]["goodput_rps"] == pytest.approx(1 + 0.1 / 0.25)
    assert report["policies"]["a"]["goodput_method"] == "interpolated"
    assert report["policies"]["a"]["slo_attainment"] == 1.0
    report["policies"]["a"]["runs"][0]["nan"] = math.nan
    path = tmp_path / "r.json"
    pngs = plot_report(report, str(path))
    rep.write_json(str(path), report)
    assert json.loads(path.read_text())["policies"]["a"]["runs"][0]["nan"] is None
    for p in pngs:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_loadgen_counts_a_length_finish_short_of_max_tokens_as_an_error():
    """As the simulator does: a server that cuts a request (finish_reason length before
    max_tokens) did not serve it; an EOS stop did, and a full length finish did. The stream
    comes split mid-event, as TCP may deliver it."""
    import asyncio
    import json

    from bench.loadgen import send
    from bench.workloads import BenchRequest
    from gateway.upstream import UPSTREAM_KEEPALIVE_S, Pool

    def sse(n: int, finish: str) -> bytes:
        chunks = [
            {"choices": [{"text": "x", "token_ids": [7], "finish_reason": finish if i == n - 1 else None}]}
            for i in range(n)
        ]
        chunks.append({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n}})
        return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        n, finish = json.loads(await reader.readexactly(length))["prompt"][1:]
        body = sse(n, ("length", "stop")[finish])
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nx-kvgate-worker: w7\r\n")
        writer.write(b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body))
        for i in range(0, len(body), 37):
            writer.write(body[i : i + 37])
            await writer.drain()
        writer.close()

    async def all_three() -> list[dict]:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        pool = Pool(connect_timeout=5.0, keepalive_s=UPSTREAM_KEEPALIVE_S)
        try:
            return [
                await send(pool, url, BenchRequest(0, 0.0, [1, n, finish], 5), None, {}, True)
                for n, finish in ((3, 0), (3, 1), (5, 0))
            ]
        finally:
            pool.close()
            server.close()

    cut, eos, full = asyncio.run(all_three())
    assert cut["error"] == "cut short: 3 of 5 tokens (finish_reason length)"
    assert eos["error"] is None and full["error"] is None
    assert cut["output_tokens"] == eos["output_tokens"] == 3 and full["output_tokens"] == 5
    assert cut["worker"] == "w7" and cut["ttft_ms"] is not None and len(full["itl_ms"]) <= 4


def test_bench_serve_against_a_url_where_every_request_fails_still_reports(tmp_path, capsys):
    """Nothing listens at the URL: the JSON is written with every request counted as an error,
    both plots are drawn (the CDF one saying nothing succeeded), and a single-rate run reports
    attainment at its rate, not a goodput; the table's first column names the target."""
    from bench import loadgen
    from gateway.procs import free_port

    out = tmp_path / "dead.json"
    loadgen.main(
        [
            "serve",
            "--url",
            f"http://127.0.0.1:{free_port()}",
            "--rate",
            "20",
            "--duration",
            "0.5",
            "--workload",
            "random",
            "--input-len",
            "8",
            "--output-len",
            "2",
            "--model",
            "m",
            "--timeout",
            "5",
            "--out",
            str(out),
        ]
    )
    report = json.loads(out.read_text())
    (entry,) = report["policies"].values()
    assert entry["errors"] == entry["runs"][0]["requests"] > 0 and entry["slo_attainment"] == 0
    assert entry["goodput_rps"] is None and entry["goodput_method"] == "single_rate"
    for p in report["plots"]:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    err = capsys.readouterr().err
    assert "attainment at 20 req/s (one rate: no goodput" in err and "goodput from the sweep" not in err
    lines = err.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("attainment at"))
    assert lines[head + 1].startswith("target ") and "requests failed at 20 req/s" in err


def test_a_sweep_reports_goodput_and_names_the_policy_column(capsys):
    runs = sweep()
    rep.print_table(rep.build(runs, {"kind": "simulate"}), sys.stderr)
    err = capsys.readouterr().err
    assert err.startswith("goodput from the sweep; the other columns at 1 req/s")
    assert err.splitlines()[1].split()[:3] == ["policy", "goodput_rps", "slo_attainment"]


def test_simulate_where_a_policy_rejects_everything_still_reports(tmp_path, capsys):
    report = two_policy_sim(tmp_path / "sim.json", 2, "--slo-ttft-ms", "0.001", "--slo-tpot-ms", "0.001")
    entry = report["policies"]["slo_goodput"]
    assert entry["errors"] == entry["runs"][0]["requests"] > 0 and entry["error_kinds"] == {"rejected": entry["errors"]}
    err = capsys.readouterr().err
    assert "attainment at 5 req/s" in err and "slo_goodput: " in err and "requests failed at 5 req/s" in err
    assert rep.run_line(entry["runs"][0]).startswith("attainment 0.000, no request succeeded, errors")
