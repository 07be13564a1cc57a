"""`/metrics` of `epikv serve`, in Prometheus' text format through prometheus-client (one registry per server).

Names follow the usual serving ones (vLLM / TGI style, prefixed `epikv_`):
- epikv_requests_total{outcome}: completed, failed, cancelled (the client left), timeout, aborted (still open at
  the end of a drain), rejected (429 past --max-waiting, 503 while draining), invalid (400)
- epikv_prompt_tokens_total, epikv_generation_tokens_total
- epikv_time_to_first_token_seconds, epikv_inter_token_latency_seconds, epikv_request_latency_seconds (histograms)
- epikv_requests_waiting (admitted, no token yet), epikv_requests_running (generating)
- epikv_cache_pages_in_use, epikv_cache_pages_free (paged engine) or epikv_cache_cells_in_use,
  epikv_cache_cells_free (llama.cpp), epikv_evictions_total, epikv_evicted_tokens_total,
  epikv_preemptions_total: read from the engine (`Backend.gauges`) when scraped
"""

from __future__ import annotations

OUTCOMES = ("completed", "failed", "cancelled", "timeout", "aborted", "rejected", "invalid")
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


def mean_p50(hist: dict[int, int]) -> tuple[float | None, int | None, int]:
    """Mean and median of a histogram {value: count}, and its count (None, None, 0 when empty)."""
    items = sorted(hist.items())
    n = sum(c for _, c in items)
    if not n:
        return None, None, 0
    acc = 0
    for k, c in items:
        acc += c
        if 2 * acc >= n:
            return sum(k * c for k, c in items) / n, k, n
    raise AssertionError("unreachable")


class Metrics:
    def __init__(self, server) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = reg = CollectorRegistry(auto_describe=True)
        self.requests = Counter("epikv_requests", "Requests by outcome", ["outcome"], registry=reg)
        for o in OUTCOMES:
            self.requests.labels(o)  # every outcome shown from the start, at 0
        self.prompt_tokens = Counter("epikv_prompt_tokens", "Prompt tokens of admitted requests", registry=reg)
        self.generation_tokens = Counter("epikv_generation_tokens", "Tokens generated", registry=reg)
        self.ttft = Histogram("epikv_time_to_first_token_seconds", "From admission to the first token",
                              buckets=_LATENCY, registry=reg)
        self.itl = Histogram("epikv_inter_token_latency_seconds", "Between consecutive tokens of a request",
                             buckets=_ITL, registry=reg)
        self.latency = Histogram("epikv_request_latency_seconds", "From admission to the last token",
                                 buckets=_LATENCY, registry=reg)
        Gauge("epikv_requests_waiting", "Admitted requests without a token yet (the queue)",
              registry=reg).set_function(lambda: server.waiting())
        Gauge("epikv_requests_running", "Requests generating", registry=reg).set_function(
            lambda: server.running())
        reg.register(_EngineCollector(server))

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class _EngineCollector:
    """The engine's own numbers, read at scrape time."""

    def __init__(self, server) -> None:
        self.server = server

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        try:
            g = self.server.backend.gauges()
        except Exception:  # a scrape must never take the server down; the series are then absent
            return
        if "pages_in_use" in g:  # a paged engine (transformers)
            yield GaugeMetricFamily("epikv_cache_pages_in_use", "KV cache pages held by requests",
                                    value=g["pages_in_use"])
            yield GaugeMetricFamily("epikv_cache_pages_free", "KV cache pages free", value=g["pages_free"])
        if "cells_in_use" in g:  # an engine that evicts single cells (llama.cpp)
            yield GaugeMetricFamily("epikv_cache_cells_in_use", "KV cache cells held by requests",
                                    value=g["cells_in_use"])
            yield GaugeMetricFamily("epikv_cache_cells_free", "KV cache cells free", value=g["cells_free"])
        yield CounterMetricFamily("epikv_evictions", "Evictions (one per request and eviction step)",
                                  value=g["evictions"])
        yield CounterMetricFamily("epikv_evicted_tokens", "Tokens evicted", value=g["evicted_tokens"])
        yield CounterMetricFamily("epikv_preemptions", "Requests preempted (offloaded or re-prefilled)",
                                  value=g["preemptions"])


def merge_replicas(texts: dict[str, str]) -> bytes:
    """Several servers' /metrics (Prometheus text, by replica id) as one exposition: every sample of every family
    with a `replica` label added, the families' help and type kept (the usual way a scrape covers several
    replicas: `sum without (replica) (...)` gives the deployment's totals). A replica whose text does not parse is
    left out, never the whole scrape."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.metrics_core import Metric
    from prometheus_client.parser import text_string_to_metric_families

    merged: dict[str, Metric] = {}
    for replica, text in sorted(texts.items()):
        try:
            families = list(text_string_to_metric_families(text))
        except Exception:  # noqa: BLE001 (one replica's bad text must not fail the scrape)
            continue
        for fam in families:
            out = merged.setdefault(fam.name, Metric(fam.name, fam.documentation, fam.type, fam.unit))
            for s in fam.samples:
                out.add_sample(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp, s.exemplar)

    class _Merged:
        def collect(self):
            return list(merged.values())

    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Merged())
    return generate_latest(reg)
