"""`kilnx serve`'s /metrics: Prometheus counters, gauges and histograms of the requests and the batching
(prometheus_client, a registry per server)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from kilnx.runtime.request import Finished
from kilnx.runtime.scheduler import Scheduler

_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class _Steps:
    """The scheduler's own totals, read at scrape time."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler

    def collect(self):
        s = self.scheduler
        yield CounterMetricFamily("kilnx_decode_steps", "Decode steps run (all rows of a step count once).",
                                  value=s.steps)
        yield CounterMetricFamily("kilnx_decode_rows", "Rows those steps decoded (over steps: the mean batch).",
                                  value=s.rows_decoded)
        if s.rounds is not None:        # vLLM's spec_decode_num_draft_tokens / _num_accepted_tokens
            yield CounterMetricFamily("kilnx_spec_decode_draft_tokens", "Tokens guessed by speculative rounds.",
                                      value=s.drafted)
            yield CounterMetricFamily("kilnx_spec_decode_accepted_tokens", "Guessed tokens the model kept.",
                                      value=s.accepted)
        if s.store is not None:
            yield CounterMetricFamily("kilnx_prefix_store_saves", "Kept sequences copied into the prefix store.",
                                      value=s.store.saved)
            yield CounterMetricFamily("kilnx_prefix_store_loads", "Stored prefixes copied back into a row.",
                                      value=s.store.loaded)


class Metrics:
    def __init__(self, scheduler: Scheduler):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kilnx_requests", "Requests finished, by finish reason.", ["reason"], registry=r)
        self.prompt_tokens = Counter("kilnx_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.cached_tokens = Counter("kilnx_prompt_cached_tokens",
                                     "Prompt tokens whose K/V was reused (kept in a row, copied from another row or the prefix store).", registry=r)
        self.generation_tokens = Counter("kilnx_generation_tokens", "Tokens generated.", registry=r)
        self.first_token = Histogram("kilnx_time_to_first_token_seconds", "From a request's arrival to its first "
                                     "token.", buckets=_LATENCY, registry=r)
        self.latency = Histogram("kilnx_request_seconds", "From a request's arrival to its end.", buckets=_LATENCY,
                                 registry=r)
        Gauge("kilnx_requests_running", "Requests holding a cache row.", registry=r).set_function(
            lambda: sum(row is not None for row in scheduler.rows))
        Gauge("kilnx_requests_waiting", "Requests waiting for a cache row.", registry=r).set_function(
            lambda: scheduler.waiting)
        r.register(_Steps(scheduler))

    def finished(self, f: Finished, first_token_s: float | None, total_s: float) -> None:
        self.requests.labels(f.reason).inc()
        self.prompt_tokens.inc(f.prompt_tokens)
        self.cached_tokens.inc(f.cached_tokens)
        self.generation_tokens.inc(f.completion_tokens)
        if first_token_s is not None:
            self.first_token.observe(first_token_s)
        self.latency.observe(total_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
