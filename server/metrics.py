"""Prometheus metrics of the server, in the app's own registry, under vLLM's metric names where vLLM has one.

Engine gauges and token counters are read from ``engine.stats()`` at scrape time; latencies and finished
requests are recorded by the request handlers.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)

StatsSource = Callable[[], dict[str, int] | None]


class _EngineCollector:
    """Gauges and counters taken from the engine's stats on every scrape (zeros before it is ready)."""

    def __init__(self, stats: StatsSource, model_name: str):
        self._stats, self._labels = stats, [model_name]

    def _family(self, kind, name: str, doc: str, value: float):
        family = kind(name, doc, labels=["model_name"])
        family.add_metric(self._labels, value)
        return family

    def collect(self):
        s = self._stats() or {}
        get = lambda key: s.get(key, 0)
        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        yield self._family(gauge, "vllm:num_requests_running", "Requests being prefilled or decoded.", get("running"))
        yield self._family(gauge, "vllm:num_requests_waiting", "Requests waiting for a slot.", get("waiting"))
        yield self._family(gauge, "vllm:kv_cache_usage_perc", "Share of KV cache pages in use (0-1).",
                           get("pages_used") / max(get("pages_total"), 1))
        yield self._family(gauge, "hybrid_jax:kv_pages_used", "KV cache pages in use.", get("pages_used"))
        yield self._family(gauge, "hybrid_jax:kv_pages_total", "KV cache pages (without the null page).",
                           get("pages_total"))
        yield self._family(gauge, "hybrid_jax:state_slots_used", "GDN state slots in use.", get("slots_used"))
        yield self._family(gauge, "hybrid_jax:state_slots_total", "GDN state slots (without the null slot).",
                           get("slots_total"))
        yield self._family(gauge, "hybrid_jax:programs_pending", "Programs still compiling in the background.",
                           get("programs_pending"))
        yield self._family(gauge, "hybrid_jax:programs_first_runs_pending",
                           "Programs built in the background not yet run once (a first run costs more on a GPU; the "
                           "engine runs each while it idles).", get("programs_first_runs_pending"))
        yield self._family(counter, "vllm:prompt_tokens", "Prefilled prompt tokens.", get("prompt_tokens"))
        yield self._family(counter, "vllm:generation_tokens", "Generated tokens.", get("generation_tokens"))
        yield self._family(counter, "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                           get("prefix_cache_queries"))
        yield self._family(counter, "vllm:prefix_cache_hits", "Prompt tokens the prefix cache supplied.",
                           get("prefix_cache_hits"))
        yield self._family(counter, "hybrid_jax:prefix_cache_host_hits",
                           "Prompt tokens the prefix cache brought back from host memory (part of the hits).",
                           get("prefix_cache_host_hits"))
        yield self._family(gauge, "hybrid_jax:prefix_cache_host_bytes_used",
                           "Host memory the prefix cache's evicted blocks take.", get("host_bytes_used"))


class ServerMetrics:
    """The app's registry: engine state plus time to first token, time per output token, finished requests."""

    def __init__(self, stats: StatsSource, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats, model_name))
        labels = ["model_name"]
        self._ttft = Histogram("vllm:time_to_first_token_seconds", "Time from arrival to the first token.",
                               labels, buckets=TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self._tpot = Histogram("vllm:time_per_output_token_seconds", "Time between consecutive output tokens.",
                               labels, buckets=LATENCY_BUCKETS, registry=self.registry).labels(model_name)
        self._e2e = Histogram("vllm:e2e_request_latency_seconds", "Time from arrival to the last token.",
                              labels, buckets=TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self._finished = Counter("vllm:request_success", "Finished requests by finish reason.",
                                 ["model_name", "finished_reason"], registry=self.registry)
        self._model_name = model_name

    def first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def next_token(self, seconds: float) -> None:
        self._tpot.observe(seconds)

    def finished(self, reason: str, seconds: float) -> None:
        self._finished.labels(self._model_name, reason).inc()
        self._e2e.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
