"""A client connection as gateway.raw_send's `RawBody` sees it, for tests of what reaches it."""

import asyncio
from types import SimpleNamespace


class Client:
    """A client connection as `RawBody` writes to it: what reached it, chunk by chunk."""

    def __init__(self):
        self.disconnected, self.chunked_encoding, self.response_started, self.response_complete = (
            False,
            True,
            True,
            False,
        )
        self.got: list[bytes] = []
        self.transport = SimpleNamespace(write=self.got.append)
        self.flow = SimpleNamespace(write_paused=False, drain=lambda: asyncio.sleep(0))
