"""Signed worker registrations and Redis URLs fit for logs (pure: no Redis)."""

import json
import time
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from workers.kv import redis_schema as rs

TOKEN = "fleet-secret"


def reg(**changes) -> rs.Registration:
    base = rs.Registration("w1", "http://10.0.0.5:8100", "smollm2-135m", time.time(), {"waiting": 0, "x": 0.25})
    return replace(base, **changes)


def test_a_signed_registration_survives_the_json_round_trip():
    signed = reg().signed(TOKEN)
    again = rs.Registration.from_json(json.loads(json.dumps(signed.to_json())))
    assert again == signed and again.why_invalid(TOKEN) is None


@pytest.mark.parametrize(
    "field,value",
    [("url", "http://evil:1"), ("worker_id", "w2"), ("pool", "other"), ("state", {"waiting": 1}), ("ts", 0.0)],
)
def test_changing_any_signed_field_breaks_the_signature(field, value):
    signed = reg().signed(TOKEN)
    assert replace(signed, **{field: value}).why_invalid(TOKEN) == "bad signature"


def test_unsigned_wrong_token_and_stale_registrations_are_invalid():
    assert reg().why_invalid(TOKEN) == "unsigned"
    assert reg().signed("other").why_invalid(TOKEN) == "bad signature"
    old = reg(ts=time.time() - rs.MAX_REGISTRATION_AGE_S - 5).signed(TOKEN)
    assert old.why_invalid(TOKEN) == "stale"
    assert reg(ts=float("nan")).signed(TOKEN).why_invalid(TOKEN) == "stale"


@given(st.text())
def test_any_forged_signature_is_rejected_without_an_error(sig):
    assert replace(reg(), sig=sig).why_invalid(TOKEN) in ("unsigned", "bad signature")


@pytest.mark.parametrize(
    "body",
    [
        [],
        {"worker_id": "w"},
        {"worker_id": 1, "url": "u", "pool": "p", "ts": 1},
        {"worker_id": "w", "url": "u", "pool": "p", "ts": "x"},
        {"worker_id": "w", "url": "u", "pool": "p", "ts": 10**400},
        {"worker_id": "w", "url": "u", "pool": "p", "ts": 1, "state": []},
    ],
)
def test_a_malformed_registration_is_a_value_error(body):
    with pytest.raises(ValueError):
        rs.Registration.from_json(body)


@pytest.mark.parametrize(
    "url,shown",
    [
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("redis://:pw@127.0.0.1:6379/0", "redis://***@127.0.0.1:6379/0"),
        (
            "rediss://user:pw@cache.internal:6380/1?ssl_ca_certs=/ca.pem",
            "rediss://***@cache.internal:6380/1?ssl_ca_certs=/ca.pem",
        ),
        ("redis://:pw@[::1]:6379", "redis://***@[::1]:6379"),
    ],
)
def test_redact_url_hides_the_password(url, shown):
    assert rs.redact_url(url) == shown


def record(**changes) -> rs.AgentRecord:
    layout = {"agent": "kvgate-d-1", "metadata": "bWQ=", "mem": "DRAM", "base": 4096}
    return replace(rs.AgentRecord("d", "kvgate-d-1", layout), **changes)


def test_a_signed_agent_record_survives_the_json_round_trip():
    signed = record().signed(TOKEN)
    again = rs.AgentRecord.from_json(json.loads(json.dumps(signed.to_json())))
    assert again == signed and again.why_invalid(TOKEN) is None


def test_an_agent_record_is_invalid_unsigned_forged_or_for_another_agent():
    assert record().why_invalid(TOKEN) == "unsigned"
    assert record().signed("other").why_invalid(TOKEN) == "bad signature"
    moved = {**record().layout, "base": 0}
    assert replace(record().signed(TOKEN), layout=moved).why_invalid(TOKEN) == "bad signature"
    other = record(agent="kvgate-d-2").signed(TOKEN)
    assert other.why_invalid(TOKEN) == "the layout is another agent's"


@pytest.mark.parametrize("body", [[], {"agent": "a"}, {"worker_id": "d", "agent": "a", "layout": []}])
def test_a_malformed_agent_record_is_a_value_error(body):
    with pytest.raises(ValueError):
        rs.AgentRecord.from_json(body)


def test_reconnect_backoff_doubles_to_its_cap_and_starts_over_once_connected():
    b = rs.Backoff(first=0.2, longest=1.0)
    assert [b.next() for _ in range(5)] == [0.2, 0.4, 0.8, 1.0, 1.0]
    assert rs.Backoff(first=0.5).next() == 0.5
    b.reset()
    assert b.next() == 0.2
