"""Client API keys, per-key rate limits, tenant cache salts and hidden cache headers.

Pure parts first (key files, bearer parsing, token buckets, salts), then real gateways: two
replicas sharing rate limits through a private redis-server, in front of one sim worker, and
a third gateway that hides the x-kvgate-* headers.
"""

import asyncio
import json
import math
import random

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.auth import SHARED, ApiKey, ApiKeys, digest
from gateway.ratelimit import Limit, RateLimiter, take
from gateway.procs import Worker, free_port, start_gateway, start_redis, stop_all, wait_for, wait_redis

MODEL = "smollm2-135m"
WORDS = "cache block token worker gateway prefix decode prefill route fleet queue page hash".split()


# key files and bearer tokens


def test_plain_and_json_key_files(tmp_path):
    plain = tmp_path / "keys.txt"
    plain.write_text("# ops keys\nsk-one\n\n  sk-two  \n")
    doc = tmp_path / "keys.json"
    doc.write_text(
        json.dumps(
            [
                {"key": "sk-a", "name": "alice", "tenant": "acme", "rpm": 5},
                {"key": "sk-s", "name": "shared", "cache_salt": None, "tpm": 900, "client_cache_salt": True},
            ]
        )
    )
    keys = ApiKeys.load(["sk-flag"], [str(plain), str(doc)], rpm=60)
    flag, one = keys.authenticate("Bearer sk-flag"), keys.authenticate("Bearer sk-one")
    assert flag.tenant == flag.name == "key-" + digest("sk-flag").hex()[:8] and flag.rpm == 60
    assert one.cache_salt != flag.cache_salt, "keys are separate tenants unless configured"
    alice = keys.authenticate("Bearer sk-a")
    assert (alice.name, alice.tenant, alice.rpm, alice.tpm) == ("alice", "acme", 5, None)
    assert alice.cache_salt == "tenant:acme"
    shared = keys.authenticate("bearer   sk-s ")
    assert shared.cache_salt is SHARED and shared.tpm == 900 and shared.rpm == 60 and shared.client_cache_salt
    assert keys.authenticate("Bearer sk-two").name.startswith("key-")


@pytest.mark.parametrize(
    "header", [None, "", "Bearer", "Bearer ", "Basic sk-a", "sk-a", "Bearer sk-b", "Bearer sk-a\x00", "Bearer \ud800"]
)
def test_only_the_bearer_of_a_known_key_is_authenticated(header):
    assert ApiKeys.load(["sk-a"], []).authenticate(header) is None


@pytest.mark.parametrize(
    "entries,why",
    [
        ([{"key": "sk-a"}, {"key": "sk-a", "name": "other"}], "twice"),
        ([{"key": "sk-a", "name": "n"}, {"key": "sk-b", "name": "n"}], "twice"),
        ([{"key": "has space"}], "whitespace"),
        ([{"key": ""}], "whitespace"),
        ([{"key": "sk-a", "rpm": 0}], "rpm"),
        ([{"key": "sk-a", "tpm": 1.5}], "tpm"),
        ([{"key": "sk-a", "rpm": True}], "rpm"),
        ([{"key": "sk-a", "cache_salt": 3}], "cache_salt"),
        ([{"key": "sk-a", "cache_salt": "s" * 129}], "cache_salt"),
        ([{"key": "sk-a", "name": "n" * 200}], "tenant"),
        ([{"key": "sk-a", "client_cache_salt": "yes"}], "client_cache_salt"),
        ([{"key": "sk-a", "admin": True}], "key entry"),
        ({"key": "sk-a"}, "list"),
    ],
)
def test_bad_key_files_are_refused(tmp_path, entries, why):
    f = tmp_path / "keys.json"
    f.write_text(json.dumps(entries))
    with pytest.raises(ValueError, match=why):
        ApiKeys.load([], [str(f)])


# tenant cache salts


def key(**kw) -> ApiKey:
    return ApiKey.from_json({"key": "sk-x", "name": "x", **kw})


@pytest.mark.parametrize(
    "kw,client,salt",
    [
        ({}, None, "tenant:x"),
        ({}, "tenant:other", "tenant:x"),  # a client cannot pick another tenant's salt
        ({"tenant": "acme"}, None, "tenant:acme"),
        ({"cache_salt": None}, "mine", None),  # the shared cache
        ({"cache_salt": ""}, None, None),
        ({"cache_salt": None, "client_cache_salt": True}, "mine", "mine"),
    ],
)
def test_a_request_runs_with_its_tenants_salt(kw, client, salt):
    assert key(**kw).salt_for(client) == salt


def test_a_clients_own_salt_stays_inside_its_tenant():
    a = key(tenant="a", client_cache_salt=True)
    b = key(tenant="b", client_cache_salt=True)
    assert a.salt_for("s") != a.salt_for("t") and a.salt_for("s").startswith("tenant:a")
    assert a.salt_for("s") != b.salt_for("s")
    assert b.salt_for(a.salt_for("s")) != a.salt_for("s")


# token buckets


def test_a_bucket_admits_a_minutes_worth_then_its_rate():
    lim = Limit("rpm", 60)
    state, now = None, 100.0
    for _ in range(60):
        state, wait = take(state, lim, 1, now)
        assert wait == 0.0
    state, wait = take(state, lim, 1, now)
    assert wait == pytest.approx(1.0)
    state, wait = take(state, lim, 1, now + 1.0)
    assert wait == 0.0
    assert take(state, lim, 61, now + 1000)[1] == math.inf


@given(st.lists(st.tuples(st.floats(0, 5), st.integers(1, 40)), max_size=60), st.integers(10, 200))
def test_a_bucket_never_admits_more_than_its_limit_allows(steps, per_minute):
    """Over any span T, admitted units <= one bucket + the refill over T; a refused take is
    admitted once its wait has passed."""
    lim, state, now, admitted = Limit("tpm", per_minute), None, 0.0, 0
    for dt, cost in steps:
        now += dt
        state, wait = take(state, lim, cost, now)
        if wait == 0.0:
            admitted += cost
        elif wait != math.inf:
            assert take(state, lim, cost, now + wait + 1e-9)[1] == 0.0
        assert admitted <= per_minute + now * lim.rate + 1e-6


def test_the_limiter_limits_per_replica_while_redis_is_unreachable():
    async def run():
        limiter = RateLimiter(f"redis://127.0.0.1:{free_port()}/0")
        lim = Limit("rpm", 2)
        waits = [await limiter.acquire("k", lim, 1) for _ in range(3)]
        await limiter.close()
        return waits

    waits = asyncio.run(run())
    assert waits[:2] == [0.0, 0.0] and waits[2] > 0


# real gateways

KEYS = [
    {"key": "sk-alice", "name": "alice", "tenant": "acme"},
    {"key": "sk-bob", "name": "bob", "tenant": "acme"},
    {"key": "sk-eve", "name": "eve", "tenant": "evil"},
    {"key": "sk-limited", "name": "limited", "rpm": 3},
    {"key": "sk-tokens", "name": "tokens", "tpm": 400},
]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    d = tmp_path_factory.mktemp("auth")
    logs = str(d)
    (d / "keys.json").write_text(json.dumps(KEYS))
    procs = []
    try:
        server = wait_redis(start_redis(log_dir=logs))
        procs.append(server)
        url = f"redis://127.0.0.1:{server.port}/0"
        worker = Worker(worker_id="w0", log_dir=logs)
        procs.append(worker)
        extra = ["--api-key-file", str(d / "keys.json")]
        replicas = [
            start_gateway(
                [worker.url], "round_robin", redis=url, name=f"gw-{c}", log_dir=logs, extra=extra + ["--replica-id", c]
            )
            for c in "ab"
        ]
        hidden = start_gateway(
            [worker.url],
            "round_robin",
            name="gw-hidden",
            log_dir=logs,
            extra=["--api-key", "sk-plain", "--hide-cache-headers"],
        )
        procs += replicas + [hidden]
        worker.ready()
        for g in replicas + [hidden]:
            g.wait_ready("/health")
        yield {"a": replicas[0].url, "b": replicas[1].url, "hidden": hidden.url}
    finally:
        stop_all(procs[::-1])


def post(url: str, key: str | None, prompt: str = "hello", max_tokens: int = 2, **body) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(
        url + "/v1/completions",
        headers=headers,
        timeout=30,
        json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, **body},
    )


def assert_openai_error(r: httpx.Response, status: int, type_: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == type_ and set(err) == {"message", "type", "param", "code"}
    return err


@pytest.mark.slow
def test_requests_without_a_valid_key_get_an_openai_401(fleet):
    a = fleet["a"]
    for key in (None, "sk-wrong"):
        r = post(a, key)
        assert assert_openai_error(r, 401, "invalid_request_error")["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"].startswith("Bearer")
    r = httpx.post(
        a + "/v1/chat/completions",
        headers={"authorization": "Basic c2stYWxpY2U="},
        json={"messages": [{"role": "user", "content": "hi"}]},
    )
    assert_openai_error(r, 401, "invalid_request_error")
    assert httpx.get(a + "/v1/models").status_code == 401
    assert httpx.get(a + "/v1/models", headers={"authorization": "Bearer sk-alice"}).status_code == 200
    assert httpx.get(a + "/health").status_code == 200
    metrics = httpx.get(a + "/metrics")
    assert (
        metrics.status_code == 200
        and 'kvgate_gateway_client_rejections_total{key="",reason="unauthenticated"}' in metrics.text
    )
    assert post(a, "sk-alice").status_code == 200


@pytest.mark.slow
def test_a_keys_request_rate_is_shared_by_replicas(fleet):
    """rpm 3 across two replicas: 3 requests pass wherever they land, the 4th is a 429 on
    either replica (each alone has seen fewer than 3)."""
    urls = [fleet["a"], fleet["b"], fleet["a"]]
    assert [post(u, "sk-limited").status_code for u in urls] == [200, 200, 200]
    for u in (fleet["b"], fleet["a"]):
        r = post(u, "sk-limited")
        assert assert_openai_error(r, 429, "rate_limit_error")["code"] == "rate_limit_exceeded"
        assert int(r.headers["retry-after"]) >= 1
    assert post(fleet["b"], "sk-alice").status_code == 200, "other keys are not limited"


@pytest.mark.slow
def test_a_keys_token_rate_counts_prompt_and_max_tokens(fleet):
    assert post(fleet["a"], "sk-tokens", max_tokens=300).status_code == 200
    r = post(fleet["b"], "sk-tokens", max_tokens=300)
    assert_openai_error(r, 429, "rate_limit_error")
    assert int(r.headers["retry-after"]) >= 1
    r = post(fleet["a"], "sk-tokens", max_tokens=1000)
    assert "Request too large" in assert_openai_error(r, 429, "rate_limit_error")["message"]


def cached(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.slow
def test_tenants_never_share_cache_unless_configured(fleet):
    a = fleet["a"]
    prompt = " ".join(random.Random(7).choice(WORDS) for _ in range(120))
    assert cached(post(a, "sk-alice", prompt)) == 0
    wait_for(
        lambda: int(post(a, "sk-alice", prompt).headers["x-kvgate-predicted-cached-tokens"]) > 0,
        timeout=10,
        interval=0.2,
        what="the gateway to see alice's blocks",
    )
    assert cached(post(a, "sk-alice", prompt)) > 0
    assert cached(post(a, "sk-bob", prompt)) > 0, "bob shares acme's cache"
    r = post(a, "sk-eve", prompt, cache_salt="tenant:acme")  # naming acme's salt does not reach its cache
    assert cached(r) == 0 and r.headers["x-kvgate-predicted-cached-tokens"] == "0"
    assert cached(post(a, "sk-eve", prompt)) > 0, "eve's own cache works (under her tenant's salt)"
    assert cached(post(fleet["hidden"], "sk-plain", prompt)) == 0, "a key outside acme"


@pytest.mark.slow
def test_cache_headers_can_be_hidden_from_clients(fleet):
    for stream in (False, True):
        r = post(fleet["hidden"], "sk-plain", stream=stream)
        assert r.status_code == 200
        assert not [h for h in r.headers if h.startswith("x-kvgate-") and h != "x-kvgate-request-id"], r.headers
    assert "x-kvgate-predicted-cached-tokens" in post(fleet["a"], "sk-alice").headers
    assert_openai_error(post(fleet["hidden"], None), 401, "invalid_request_error")


@pytest.mark.parametrize(
    "argv,why",
    [
        (["--worker", "http://127.0.0.1:1", "--rate-limit-rpm", "5"], "per API key"),
        (["--worker", "http://127.0.0.1:1", "--api-key", "k", "--rate-limit-tpm", "0"], "positive"),
        (["--worker", "http://127.0.0.1:1", "--api-key-file", "/nonexistent/keys"], "bad API keys"),
        (["--worker", "http://127.0.0.1:1", "--api-key", "k", "--api-key", "k"], "twice"),
        (["--redis", "redis://127.0.0.1:1/0"], "internal-token"),
    ],
)
def test_bad_gateway_flags_are_start_up_errors(monkeypatch, argv, why):
    from gateway.cli_args import parser
    from gateway.server import build

    monkeypatch.delenv("KVGATE_INTERNAL_TOKEN", raising=False)
    with pytest.raises(SystemExit, match=why):
        build(parser().parse_args(argv))


def test_a_worker_publishing_to_redis_without_the_token_is_a_start_up_error(monkeypatch):
    from workers.cli import main

    monkeypatch.delenv("KVGATE_INTERNAL_TOKEN", raising=False)
    with pytest.raises(SystemExit, match="internal-token"):
        main(["--model", MODEL, "--executor", "sim", "--redis", "redis://127.0.0.1:1/0"])
