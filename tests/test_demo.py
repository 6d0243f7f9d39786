"""`kvgate demo` (sim workers: real gateway, scheduling and caching, no model) explains every
routing decision and compares the cache it got with round robin's on the same requests."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_demo_explains_each_routing_decision_and_compares_with_round_robin():
    """Nine chat turns explained, the cache compared with round robin's, and a Responses API
    conversation whose follow-ups go where their history is cached."""
    r = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "demo", "--executor", "sim", "--max-tokens", "8"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "model ready" in out and "is up on http" in out  # progress while setting up
    rows = re.findall(r"^ *(\d+)  ([ABC]) +(\d) +(\d+)  (.+?) +(cpu\d) +(\d+) +(\d+) +\d+$", out, re.M)
    assert len(rows) == 9, out
    assert len(re.findall(r"^    why: \S", out, re.M)) == 9
    for _, _, _, prompt, candidates, chosen, predicted, cached in rows:
        seen = dict(re.findall(r"(cpu\d) (\d+)/\d+", candidates))
        assert set(seen) == {"cpu0", "cpu1"} and int(seen[chosen]) == int(predicted) <= int(prompt)
        assert int(cached) <= int(prompt)
    m = re.search(
        r"served from the prefix cache: (\d+) of (\d+) .*\nround robin over cpu0, cpu1 on the same "
        r"requests: about (\d+)",
        out,
    )
    assert m, out
    assert int(m.group(1)) > int(m.group(3)), "prefix affinity keeps each chat's history where it is cached"
    turns = re.findall(r"^ +(\d)  (resp_\w+) +(cpu\d) +(\d+) +(\d+) +(\d+)$", out, re.M)
    assert [int(t[0]) for t in turns] == [1, 2, 3], out
    for before, after in zip(turns, turns[1:]):
        assert after[2] == before[2], "a follow-up goes where its history is cached"
        assert int(after[4]) == int(after[5]) >= int(before[3]) // 16 * 16, "the previous prompt's blocks hit"
