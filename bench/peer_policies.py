"""The peers' routing policies, modelled for the simulator only: baselines to compare kvgate's
policies with in virtual time (`kvgate simulate --policies bench.peer_policies:CacheAware,...`),
not policies to serve with.

`CacheAware` is sglang-router's `cache_aware` (sgl-router/src/policies/cache_aware.rs and
tree.rs); vllm-router's `cache_aware` (vllm-project/router, src/policies/cache_aware.rs) is the
same rule on the same tree (it adds a session map that only applies to prompts without text).
Both routers run it on the request's text in an approximate radix tree of what they sent to
each worker; here the tree is kept in KV blocks of token ids, which is the same up to a block's
granularity (the workloads' equal prefixes are equal text and equal tokens alike).
"""

from policies.api import FleetView, RequestView, Route, WorkerView
from policies.candidates import NO_WORKERS, route_to, serving_workers


class CacheAware:
    """Imbalanced (max load - min load > `balance_abs_threshold` and max load >
    `balance_rel_threshold` * min load, load being the router's own count of requests in
    flight): the least-loaded worker. Otherwise the worker that first sent the longest prefix
    of this prompt the router has sent anywhere, when that prefix is more than
    `cache_threshold` of the prompt; else the worker whose tree is smallest (fewest distinct
    tokens sent to it). Either way the prompt joins the chosen worker's tree.

    The defaults are both routers' command-line defaults (0.3, 64, 1.5). Their trees are
    trimmed every 120 s to 2^26 characters per worker, which a simulated run of minutes never
    reaches, so nothing is evicted here.
    """

    name = "cache_aware"

    def __init__(
        self, cache_threshold: float = 0.3, balance_abs_threshold: int = 64, balance_rel_threshold: float = 1.5
    ) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.first_sender: dict[int, str] = {}  # block hash -> the worker whose prompt first held it
        self.trees: dict[str, set[int]] = {}  # worker -> block hashes of the prompts sent to it

    def route(self, req: RequestView, fleet: FleetView) -> Route:
        workers = serving_workers(fleet)
        if not workers:
            return Route(reject=NO_WORKERS)
        loads = [w.in_flight for w in workers]
        low, high = min(loads), max(loads)
        if high - low > self.balance_abs_threshold and high > low * self.balance_rel_threshold:
            w = workers[loads.index(low)]
            reason = f"imbalanced ({high} against {low} in flight): least loaded"
        else:
            w, reason = self.by_cache(req, workers)
        self.insert(req, w.worker_id)
        return route_to(req, w, reason=reason)

    def by_cache(self, req: RequestView, workers: tuple[WorkerView, ...]) -> tuple[WorkerView, str]:
        """The first sender of the longest prefix sent before, when it is over the threshold;
        else the worker with the smallest tree."""
        matched = self.matched_blocks(req)
        by_id = {w.worker_id: w for w in workers}
        rate = matched * workers[0].block_size / max(1, req.num_tokens)
        holder = by_id.get(self.first_sender[req.block_hashes[matched - 1]]) if matched else None
        if holder is not None and rate > self.cache_threshold:
            return holder, f"prefix match {rate:.2f} of the prompt"
        sizes = [len(self.trees.get(w.worker_id, ())) for w in workers]
        return workers[sizes.index(min(sizes))], f"prefix match {rate:.2f}: smallest tree"

    def matched_blocks(self, req: RequestView) -> int:
        """Leading blocks of the prompt sent to any worker before (block hashes are chained, so
        a block sent before means its whole prefix was)."""
        n = 0
        for h in req.block_hashes:
            if h not in self.first_sender:
                break
            n += 1
        return n

    def insert(self, req: RequestView, worker_id: str) -> None:
        tree = self.trees.setdefault(worker_id, set())
        tree.update(req.block_hashes)
        for h in req.block_hashes:
            self.first_sender.setdefault(h, worker_id)
