"""Prometheus metrics of a worker's P/D exports, NIXL quarantine and NIXL peer lookups
(workers/transfer_http.py, workers/transfer_nixl.py, workers/nixl_peers.py), beside workers/metrics.py's engine metrics: a module of its own so
the gateway, which shares metrics.py's buckets, imports none of the transfer code."""

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from workers.metrics import LABELS
from workers.nixl_peers import LOOKUP_SOURCES
from workers.transfer_http import TRANSPORTS, TransferService
from workers.transfer_nixl import QUARANTINE_OUTCOMES


class TransferCollector:
    """P/D exports, the NIXL quarantine and peer lookups, read from the TransferService at scrape time (on
    the event loop, where they change). Present on every worker, 0 where unused, so a panel or
    rule over them needs no `or vector(0)`."""

    def __init__(self, transfer: TransferService, model: str):
        self.transfer, self.labels = transfer, [model, transfer.host.worker_id]

    def collect(self):
        t, nixl = self.transfer, self.transfer.nixl
        releases = nixl.quarantine_releases if nixl is not None else dict.fromkeys(QUARANTINE_OUTCOMES, 0)
        lookups = nixl.peers.lookups if nixl is not None else dict.fromkeys(LOOKUP_SOURCES, 0)
        counters = (
            (
                "kvgate_worker_kv_sent_bytes",
                "K/V bytes exported to decode workers, by transport",
                "transport",
                TRANSPORTS,
                t.sent_bytes,
            ),
            (
                "kvgate_worker_kv_sent_seconds",
                "Seconds exports spent moving K/V, by transport",
                "transport",
                TRANSPORTS,
                t.sent_seconds,
            ),
            (
                "kvgate_worker_kv_quarantine_releases",
                "NIXL quarantines ended: completed (the writer said its WRITE is over) or timed_out (the bound passed)",
                "outcome",
                QUARANTINE_OUTCOMES,
                releases,
            ),
            (
                "kvgate_worker_nixl_peer_lookups",
                "NIXL P/D peers' cache layouts found, by source: cache (this worker's), redis, or http (GET /kv/nixl)",
                "source",
                LOOKUP_SOURCES,
                lookups,
            ),
        )
        for name, doc, label, keys, values in counters:
            c = CounterMetricFamily(name, doc, labels=[*LABELS, label])
            for key in keys:
                c.add_metric([*self.labels, key], values[key])
            yield c
        gauges = {
            "kvgate_worker_kv_export_backlog_bytes": (
                "K/V bytes of exports handed over and not yet sent: the queue ahead of a new export",
                t.backlog_bytes,
            ),
            "kvgate_worker_kv_quarantined_blocks": (
                "KV blocks held out of the pool because a failed or expired NIXL WRITE may still land in them",
                sum(len(q.blocks) for q in nixl.quarantined.values()) if nixl is not None else 0,
            ),
        }
        for name, (doc, value) in gauges.items():
            g = GaugeMetricFamily(name, doc, labels=LABELS)
            g.add_metric(self.labels, value)
            yield g
