"""bench/tiers_goodput.py: one table of goodput and hit ratio per setting and tier configuration,
read from simulate reports (by policy) and real-fleet reports (their only fleet)."""

import json

import pytest

from bench.tiers_goodput import main


def report(path, command: str, **policies: float) -> str:
    rows = {
        name: {"goodput_rps": g, "cached_token_ratio": g / 100, "slo_attainment": 0.95, "at_rate_rps": g}
        for name, g in policies.items()
    }
    path.write_text(json.dumps({"command": command, "policies": rows}))
    return str(path)


def test_rows_are_read_by_policy_or_their_only_fleet(tmp_path):
    sim = report(tmp_path / "sim.json", "kvgate simulate A", prefix_affinity=40.0, slo_goodput=50.0)
    real = report(tmp_path / "real.json", "python -m bench.real_fleet B", host=33.0)
    out = tmp_path / "t.json"
    main(["--row", "8 sim", "host", sim, "--row", "4 real", "host", real, "--out", str(out)])
    settings = json.loads(out.read_text())["settings"]
    assert (
        settings["8 sim"]["host"]["goodput_rps"] == 50.0 and settings["8 sim"]["host"]["command"] == "kvgate simulate A"
    )
    assert settings["4 real"]["host"]["policy"] == "host" and settings["4 real"]["host"]["cached_token_ratio"] == 0.33
    assert (tmp_path / "t.png").exists()
    with pytest.raises(SystemExit):
        main(["--row", "s", "v", sim, "--policy", "kv_cost", "--out", str(out)])
