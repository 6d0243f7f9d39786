"""Client API keys at the gateway: who calls (a key and its tenant), its limits, its cache salt.

Keys come from `--api-key` (repeatable) and `--api-key-file`; a client presents one as with
OpenAI, `Authorization: Bearer KEY`, or gets a 401. Keys are held as SHA-256 digests and
looked up by digest, so neither memory dumps nor lookup timing give a key away. `/health` and
`/metrics` stay open: load balancers and Prometheus call them without keys, and they carry
no prompts and no per-key data beyond key names.

Each key belongs to a tenant whose requests are hashed with the tenant's `cache_salt`, so
tenants never share cached blocks (and cannot probe each other's prompts through cache hits)
unless their config gives them the same salt, or none (the fleet's shared cache).
"""

import hashlib
import json
import math
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter
from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from gateway.ratelimit import Limit, RateLimiter
from workers.protocol import checked_cache_salt, error_body
from workers.sampling_params import InvalidRequest

OPEN_PATHS = frozenset({"/health", "/metrics"})
# the paths a key's request rate limits: generation, tokenization, vLLM's pooling endpoints
# (gateway/forward.py PATHS) and its Responses API
LIMITED_PATHS = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/tokenize",
        "/detokenize",
        "/v1/embeddings",
        "/v2/embed",
        "/pooling",
        "/classify",
        "/score",
        "/v1/score",
        "/rerank",
        "/v1/rerank",
        "/v2/rerank",
        "/v1/responses",
    }
)
LIMITED_PREFIX = "/v1/responses/"  # a stored response's retrieve and cancel (gateway/responses.py)
SCOPE_KEY = "kvgate.api_key"
CACHE_HEADERS = (
    b"x-kvgate-worker",
    b"x-kvgate-prefill-worker",
    b"x-kvgate-policy",
    b"x-kvgate-predicted-cached-tokens",
    b"x-kvgate-route-reason",
    b"x-kvgate-candidates",
)
SHARED = None  # a tenant cache salt of None: the fleet's shared cache
MAX_TENANT_SALT = 128


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


@dataclass(frozen=True)
class ApiKey:
    """One client key. `name` appears in logs, metrics and rate-limit buckets (never the key);
    `client_cache_salt` lets the tenant's clients split its cache further with their own
    `cache_salt` (always inside the tenant's, never reaching another tenant's blocks)."""

    name: str
    digest: bytes
    tenant: str
    cache_salt: str | None
    rpm: int | None = None
    tpm: int | None = None
    client_cache_salt: bool = False

    @classmethod
    def from_json(cls, d: dict, rpm: int | None = None, tpm: int | None = None) -> "ApiKey":
        """A key-file entry: {"key", "name"?, "tenant"?, "cache_salt"?, "rpm"?, "tpm"?,
        "client_cache_salt"?}; limits default to `rpm`/`tpm`, the tenant to the name, the salt
        to one of the tenant's own (null: the shared cache). Raises ValueError."""
        if not isinstance(d, dict) or not set(d) <= {
            "key",
            "name",
            "tenant",
            "cache_salt",
            "rpm",
            "tpm",
            "client_cache_salt",
        }:
            raise ValueError(
                f"a key entry is an object with key, name, tenant, cache_salt, rpm, tpm, "
                f"client_cache_salt; got {d!r:.80}"
            )
        key = _key(d.get("key"))
        name = _str(d.get("name", "key-" + digest(key).hex()[:8]), "name")
        tenant = _str(d.get("tenant", name), "tenant")
        if len(tenant) > MAX_TENANT_SALT - len("tenant:"):
            raise ValueError(f"'tenant' (or the name it defaults to) is at most {MAX_TENANT_SALT - 7} characters")
        salt = d.get("cache_salt", f"tenant:{tenant}")
        if salt is not SHARED:
            salt = _str(salt, "cache_salt") or SHARED
            if salt and len(salt) > MAX_TENANT_SALT:
                raise ValueError(f"'cache_salt' is at most {MAX_TENANT_SALT} characters")
        return cls(
            name,
            digest(key),
            tenant,
            salt,
            _limit(d.get("rpm", rpm), "rpm"),
            _limit(d.get("tpm", tpm), "tpm"),
            _flag(d.get("client_cache_salt", False)),
        )

    def salt_for(self, client_salt: str | None) -> str | None:
        """The cache_salt a request of this key runs with: the tenant's, refined by the client's
        own when the tenant allows it (digested, so the pair fits the field's length)."""
        if not (client_salt and self.client_cache_salt):
            return self.cache_salt
        if self.cache_salt is SHARED:
            return client_salt
        return f"{self.cache_salt}\x1f{hashlib.sha256(client_salt.encode('utf-8', 'surrogatepass')).hexdigest()}"

    def limits(self) -> tuple[Limit | None, Limit | None]:
        return (Limit("rpm", self.rpm) if self.rpm else None, Limit("tpm", self.tpm) if self.tpm else None)


def _key(v: object) -> str:
    if not isinstance(v, str) or not v or v != v.strip() or any(c.isspace() for c in v):
        raise ValueError("an API key is a non-empty string without whitespace")
    return v


def _str(v: object, what: str) -> str:
    if not isinstance(v, str):
        raise ValueError(f"'{what}' must be a string")
    return v


def _limit(v: object, what: str) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"'{what}' must be a positive integer per minute")
    return v


def _flag(v: object) -> bool:
    if not isinstance(v, bool):
        raise ValueError("'client_cache_salt' must be true or false")
    return v


def read_key_file(path: str, rpm: int | None = None, tpm: int | None = None) -> list[ApiKey]:
    """A JSON list of key entries (see `ApiKey.from_json`), or plain text with one key a line
    (blank lines and `#` comments skipped). Raises ValueError naming the file."""
    text = Path(path).read_text()
    try:
        if text.lstrip().startswith(("[", "{")):
            entries = json.loads(text)
            if not isinstance(entries, list):
                raise ValueError("a JSON key file is a list of key entries")
            return [ApiKey.from_json(e, rpm, tpm) for e in entries]
        lines = (ln.strip() for ln in text.splitlines())
        return [ApiKey.from_json({"key": ln}, rpm, tpm) for ln in lines if ln and not ln.startswith("#")]
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


class ApiKeys:
    def __init__(self, keys: list[ApiKey]):
        self.by_digest: dict[bytes, ApiKey] = {}
        names: set[str] = set()
        for k in keys:
            if k.digest in self.by_digest or k.name in names:
                raise ValueError(f"API key {k.name!r} is given twice (same key or same name)")
            self.by_digest[k.digest] = k
            names.add(k.name)

    @classmethod
    def load(cls, keys: list[str], files: list[str], rpm: int | None = None, tpm: int | None = None) -> "ApiKeys":
        """`--api-key` values and `--api-key-file` paths; raises ValueError for a bad one."""
        out = [ApiKey.from_json({"key": k}, rpm, tpm) for k in keys]
        for path in files:
            out += read_key_file(path, rpm, tpm)
        return cls(out)

    @property
    def enabled(self) -> bool:
        return bool(self.by_digest)

    def authenticate(self, authorization: str | None) -> ApiKey | None:
        """The key a `Authorization: Bearer KEY` header presents, or None."""
        scheme, _, key = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return None
        return self.by_digest.get(digest(key.strip()))


def api_key(scope: MutableMapping[str, Any]) -> ApiKey | None:
    """The key a request was authenticated with (None when the gateway has no keys)."""
    return scope.get(SCOPE_KEY)


def limited(path: str) -> bool:
    """Whether a key's request rate limits requests to `path`."""
    return path in LIMITED_PATHS or path.startswith(LIMITED_PREFIX)


def retry_after(wait_s: float) -> int:
    """Whole seconds for Retry-After; a request that can never fit is told a minute."""
    return 60 if math.isinf(wait_s) else max(1, math.ceil(wait_s))


class Access:
    """One gateway's client policy: its keys, their rate limits, whether cache headers show."""

    def __init__(
        self, keys: ApiKeys | None = None, limiter: RateLimiter | None = None, hide_cache_headers: bool = False
    ):
        self.keys = keys or ApiKeys([])
        self.limiter = limiter or RateLimiter()
        self.hide_cache_headers = hide_cache_headers
        self.rejected: Counter | None = None

    def register(self, registry: CollectorRegistry) -> None:
        self.rejected = Counter(
            "kvgate_gateway_client_rejections",
            "Requests refused for a key: unauthenticated (401), rpm or tpm (429)",
            ["key", "reason"],
            registry=registry,
        )

    def count(self, key: str, reason: str) -> None:
        if self.rejected is not None:
            self.rejected.labels(key, reason).inc()

    async def admit_request(self, key: ApiKey) -> float:
        """Take one request from the key's per-minute budget: 0.0, or the seconds to wait."""
        rpm = key.limits()[0]
        wait = await self.limiter.acquire(key.name, rpm, 1) if rpm else 0.0
        if wait:
            self.count(key.name, "rpm")
        return wait

    async def admit_tokens(self, key: ApiKey | None, tokens: int) -> float:
        """Take a request's tokens (prompt + max_tokens, as reserved) from its key's per-minute
        budget: 0.0, or the seconds to wait (`inf`: more than the whole budget)."""
        tpm = key.limits()[1] if key else None
        if key is None or not tpm:
            return 0.0
        wait = await self.limiter.acquire(key.name, tpm, tokens)
        if wait:
            self.count(key.name, "tpm")
        return wait

    def apply_cache_salt(self, key: ApiKey | None, body: dict) -> bool:
        """Set `body`'s cache_salt to what the key's tenant runs with; True when it changed.
        Without keys a client's own salt stands (vLLM's meaning: it only narrows sharing)."""
        if key is None:
            return False
        try:
            checked_cache_salt(body)
        except InvalidRequest:
            return False  # the client's own bad salt: refused where its body is checked, by the same rule
        given = body.get("cache_salt")
        salt = key.salt_for(given)
        if salt == given:
            return False
        if salt is None:
            body.pop("cache_salt", None)
        else:
            body["cache_salt"] = salt
        return True


def too_many_tokens(key: ApiKey, tokens: int, wait_s: float, embeddings: bool = False) -> str:
    """Why a request's tokens were refused: a generation counts its prompt and max_tokens, an
    embeddings request its inputs."""
    what = "inputs" if embeddings else "prompt + max_tokens"
    if math.isinf(wait_s):
        return (
            f"Request too large for key {key.name}: {tokens} tokens ({what}) exceed its limit of {key.tpm} "
            f"tokens per minute; {'send fewer inputs' if embeddings else 'ask for fewer max_tokens'}"
        )
    return f"Rate limit reached for key {key.name}: {key.tpm} tokens per minute ({what})"


class Guard:
    """ASGI middleware in front of the gateway: API keys (401), the per-key request rate (429),
    and, with `hide_cache_headers`, no x-kvgate-* routing headers to clients: they tell which
    worker holds a prefix and how much of a prompt was predicted cached, a prefix-cache side
    channel between clients."""

    def __init__(self, app, access: Access):
        self.app = app
        self.access = access

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.access.hide_cache_headers:
            send = _without_cache_headers(send)
        keys = self.access.keys
        if keys.enabled and scope["path"] not in OPEN_PATHS:
            key = keys.authenticate(Headers(scope=scope).get("authorization"))
            if key is None:
                return await self._unauthenticated(scope, receive, send)
            scope[SCOPE_KEY] = key
            wait = await self.access.admit_request(key) if limited(scope["path"]) else 0.0
            if wait:
                msg = f"Rate limit reached for key {key.name}: {key.rpm} requests per minute"
                resp = JSONResponse(
                    error_body(msg, "rate_limit_error", "rate_limit_exceeded"),
                    status_code=429,
                    headers={"retry-after": str(retry_after(wait))},
                )
                return await resp(scope, receive, send)
        await self.app(scope, receive, send)

    async def _unauthenticated(self, scope, receive, send) -> None:
        self.access.count("", "unauthenticated")
        given = Headers(scope=scope).get("authorization")
        msg = (
            "Incorrect API key provided."
            if given
            else "You didn't provide an API key. You need to provide your API key in an Authorization header "
            "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
        )
        resp = JSONResponse(
            error_body(msg, "invalid_request_error", "invalid_api_key"),
            status_code=401,
            headers={"www-authenticate": 'Bearer realm="kvgate"'},
        )
        await resp(scope, receive, send)


def _without_cache_headers(send):
    async def wrapped(message) -> None:
        if message["type"] == "http.response.start":
            message = {
                **message,
                "headers": [(k, v) for k, v in message.get("headers", []) if k.lower() not in CACHE_HEADERS],
            }
        await send(message)

    return wrapped
