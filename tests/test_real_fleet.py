"""The real-fleet comparison: two fleets of sim workers behind real gateways, one report."""

import json

import pytest

from bench import real_fleet

pytestmark = pytest.mark.slow


def test_fleet_spec_parsing():
    assert real_fleet.parse_fleet("pd=slo_goodput@prefill:1,decode:2") == (
        "pd",
        "slo_goodput",
        ["prefill", "decode", "decode"],
    )
    for bad in ("pd", "pd=slo_goodput", "pd=slo_goodput@gpu:1", "pd=slo_goodput@mixed:x"):
        with pytest.raises(ValueError):
            real_fleet.parse_fleet(bad)


def test_compares_a_pd_fleet_with_a_mixed_one(tmp_path):
    out = tmp_path / "report.json"
    real_fleet.main(
        [
            "--fleet",
            "1p1d=slo_goodput@prefill:1,decode:1",
            "--fleet",
            "2mixed=slo_goodput@mixed:2",
            "--executor",
            "sim",
            "--gateway-arg=--pd-min-uncached-tokens=32",
            "--workload",
            "shared-prefix",
            "--groups",
            "2",
            "--prefix-len",
            "96",
            "--question-len",
            "16",
            "--output-len",
            "4",
            "--sweep",
            "3,4",
            "--duration",
            "2",
            "--slo-ttft-ms",
            "20000",
            "--slo-tpot-ms",
            "20000",
            "--log-dir",
            str(tmp_path),
            "--out",
            str(out),
        ]
    )
    report = json.loads(out.read_text())
    pd, mixed = report["policies"]["1p1d"], report["policies"]["2mixed"]
    for entry in (pd, mixed):
        assert [r["rate_rps"] for r in entry["runs"]] == [3, 4]
        assert all(r["errors"] == 0 and r["requests"] > 0 for r in entry["runs"])
        assert entry["goodput_rps"] == 4
    # The prefix caches are emptied between rates: without that, the second rate's prompts
    # would all be cached on the decode worker and none would be worth disaggregating.
    assert all(r["pd_requests"] > 0 for r in pd["runs"])
    assert all(r["pd_requests"] == 0 for r in mixed["runs"])
    assert {r["worker"] for r in pd["runs"][0]["records"]} == {"1p1d-d1"}
    assert (tmp_path / "report-cdf.png").exists()
