"""The server's ``/metrics``, kept with ``prometheus-client`` (names follow llama-server's
``llamacpp:*`` ones, prefixed ``localllm_``).

Each app has its own registry (never the process-wide default), so that several servers in
one process (the tests) do not share counters.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    """Request counts and token throughput.

    Args:
        processing / waiting: read when scraped (the scheduler's running and queued jobs).
    """

    def __init__(self, processing: Callable[[], int] = lambda: 0,
                 waiting: Callable[[], int] = lambda: 0) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = Counter("localllm_requests", "Requests answered, by endpoint and status.",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("localllm_prompt_tokens", "Prompt tokens evaluated.",
                                     registry=r)
        self.prompt_seconds = Counter("localllm_prompt_seconds",
                                      "Seconds spent evaluating prompts.", registry=r)
        self.predicted_tokens = Counter("localllm_tokens_predicted", "Tokens generated.",
                                        registry=r)
        self.predicted_seconds = Counter("localllm_tokens_predicted_seconds",
                                         "Seconds spent generating.", registry=r)
        self._totals = [0.0, 0.0, 0.0, 0.0]  # prompt tokens, seconds; predicted tokens, seconds
        self._lock = threading.Lock()
        Gauge("localllm_prompt_tokens_seconds", "Average prompt throughput in tokens/s.",
              registry=r).set_function(lambda: self._rate(0))
        Gauge("localllm_predicted_tokens_seconds", "Average generation throughput in tokens/s.",
              registry=r).set_function(lambda: self._rate(2))
        Gauge("localllm_requests_processing", "Requests generating now.",
              registry=r).set_function(processing)
        Gauge("localllm_requests_deferred", "Requests waiting in the queue.",
              registry=r).set_function(waiting)

    def count(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def add_timings(self, t: dict) -> None:
        """Add one generation's llama-server ``timings`` object."""
        values = (t["prompt_n"], t["prompt_ms"] / 1e3, t["predicted_n"], t["predicted_ms"] / 1e3)
        for counter, value in zip((self.prompt_tokens, self.prompt_seconds,
                                   self.predicted_tokens, self.predicted_seconds), values):
            counter.inc(value)
        with self._lock:
            self._totals = [a + b for a, b in zip(self._totals, values)]

    def _rate(self, i: int) -> float:
        with self._lock:
            tokens, seconds = self._totals[i], self._totals[i + 1]
        return tokens / seconds if seconds else 0.0

    def text(self) -> bytes:
        """The exposition text."""
        return generate_latest(self.registry)


__all__ = ["CONTENT_TYPE", "Metrics"]
