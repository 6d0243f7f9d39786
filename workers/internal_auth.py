"""The fleet's internal token: who may call a worker's internal endpoints.

Internal calls (KV import and reset, state and step logs, KV events and snapshots, `kv_transfer`
on a completion) carry the fleet's shared secret in `x-kvgate-token`. A worker with a token
refuses them without it: cache residency and load are a prompt side channel, and imports write
into the cache. A worker started without one (a lone development worker) leaves the read
endpoints open and refuses every write. Tools find the token in $KVGATE_INTERNAL_TOKEN.
"""

import hmac
import os

TOKEN_HEADER = "x-kvgate-token"
TOKEN_ENV = "KVGATE_INTERNAL_TOKEN"


def token_matches(given: str | None, token: str | None) -> bool:
    """Constant-time check of a header's value, compared as bytes; never true without a
    configured token. A value that is not ASCII is not the token, never an error: any client
    can send such a header, and `compare_digest` raises on a non-ASCII str."""
    if not token:
        return False
    try:
        sent = (given or "").encode("ascii")
    except UnicodeEncodeError:
        return False
    return hmac.compare_digest(sent, token.encode())


def internal_headers(token: str | None = None) -> dict[str, str]:
    """The header an internal call sends: `token`, else $KVGATE_INTERNAL_TOKEN, else none."""
    token = token or os.environ.get(TOKEN_ENV)
    return {TOKEN_HEADER: token} if token else {}
