"""P/D decode requests held until their prompt's KV arrives: one rule for the engine and the
fleet simulator.

A decode leg reaches its worker before (or while) the prefill worker's blocks are imported. It
waits here until every block a prefix hit could cover is resident (then it is admitted as an
ordinary prefix-cache hit) or its deadline passes (then it is admitted to compute the prompt
itself: a fallback costs time, never a failure).
"""

from collections.abc import Callable, Iterator

from workers.kv_manager import KVCacheManager
from workers.request import Request


class PendingKV:
    def __init__(self, kv: KVCacheManager):
        self.kv = kv
        self._held: dict[str, Request] = {}

    def hold(self, req: Request, deadline: float | None) -> None:
        """Hold `req` until its blocks arrive or `deadline` (None: until they arrive or `take`)."""
        req.kv_deadline = deadline
        self._held[req.request_id] = req

    def ready(self, now: float, may_admit: Callable[[Request], bool] | None = None) -> list[tuple[Request, bool]]:
        """The held requests to admit now, oldest first, each with whether its blocks arrived
        (False: its deadline passed). `may_admit` can keep back a request not yet due."""
        out = []
        for req in list(self._held.values()):
            if may_admit is not None and not may_admit(req):
                continue
            if self.kv.prefix_resident(req):
                out.append((req, True))
            elif req.kv_deadline is not None and now >= req.kv_deadline:
                out.append((req, False))
            else:
                continue
            del self._held[req.request_id]
        return out

    def take(self, request_id: str) -> Request | None:
        """Stop holding a request (it was aborted, or is admitted by other means)."""
        return self._held.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._held

    def __len__(self) -> int:
        return len(self._held)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._held.values()))

    def clear(self) -> None:
        self._held.clear()
