"""What a worker's answer to a control-plane call (`/state`, `/kv/events`, `/kv/snapshot`)
means when it is not a good one: a 403 is a refusal (the gateway lacks the fleet's internal
token), said as such so the operator sees the fix, not a generic error status."""

import aiohttp


class Refused(aiohttp.ClientError):
    """A worker refused a control-plane call: the gateway lacks the fleet's internal token."""


def refused(url: object) -> Refused:
    return Refused(
        f"{url} refuses the gateway (403): the worker has an internal token; "
        "give the gateway the same one (--internal-token or $KVGATE_INTERNAL_TOKEN)"
    )


def check(r: aiohttp.ClientResponse) -> None:
    """Raise Refused for a worker that wants another internal token, ClientResponseError for
    any other error status."""
    if r.status == 403:
        raise refused(r.url)
    r.raise_for_status()
