"""Prometheus text for /metrics: queue depth, batch sizes, tokens/s, request latency, the
weight version. Kept per server (its own registry), so tests can run several in a process."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
RATE_WINDOW_S = 10.0


class ServerMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "lpx_requests", "score requests by HTTP status", ["code"], registry=r
        )
        self.latency = Histogram(
            "lpx_request_latency_seconds",
            "score request latency",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "lpx_batch_sequences", "sequences per scored batch", buckets=BATCH_BUCKETS, registry=r
        )
        self.queue = Gauge("lpx_queue_depth", "sequences waiting to be scored", registry=r)
        self.tokens = Counter("lpx_scored_tokens", "completion tokens scored", registry=r)
        self.rate = Gauge(
            "lpx_tokens_per_second", f"completion tokens/s over {RATE_WINDOW_S:g} s", registry=r
        )
        self.version = Gauge(
            "lpx_weight_version_info",
            "the weights in service",
            ["version", "fingerprint"],
            registry=r,
        )
        self.update_count = Counter("lpx_weight_updates", "weight updates loaded", registry=r)
        self.cancelled = Gauge(
            "lpx_cancelled_sequences", "sequences dropped before scoring", registry=r
        )
        self.updates = 0
        self._seen = {"batches": 0, "tokens": 0, "updates": 0}
        self._window: list[tuple[float, int]] = []

    def count_request(self, status: int) -> None:
        self.requests.labels(code=str(status)).inc()

    def observe_latency(self, seconds: float) -> None:
        self.latency.observe(seconds)

    def render(self, scheduler, version) -> bytes:
        stats = scheduler.stats
        new_batches = stats.batches - self._seen["batches"]
        for size in stats.batch_sizes[-new_batches:] if new_batches else []:
            self.batch_size.observe(size)
        self.tokens.inc(stats.tokens - self._seen["tokens"])
        self.update_count.inc(self.updates - self._seen["updates"])
        self._seen = {"batches": stats.batches, "tokens": stats.tokens, "updates": self.updates}
        now = time.monotonic()
        self._window = [(t, n) for t, n in self._window if now - t <= RATE_WINDOW_S]
        self._window.append((now, stats.tokens))
        first_t, first_n = self._window[0]
        self.rate.set((stats.tokens - first_n) / (now - first_t) if now > first_t else 0.0)
        self.queue.set(scheduler.queue_depth)
        self.cancelled.set(stats.cancelled)
        self.version.clear()
        self.version.labels(
            version=version.weight_version, fingerprint=version.weights_fingerprint
        ).set(1)
        return generate_latest(self.registry)
