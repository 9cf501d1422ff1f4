"""Prometheus metrics of one server (vLLM's metric names, `polyrunner:` prefix).

Gauges are read from the AsyncLLM's latest engine counts when scraped (0 once the
engine died; `engine_healthy` says which); counters and histograms are fed
by the AsyncLLM's per-step stats (in its report thread; prometheus-client is
thread-safe). Each app owns its `CollectorRegistry`, so several servers can
live in one process.

With data parallelism (`data_parallel_size` N > 1) every gauge, counter and
histogram below also has a `replica` label: "0".."N-1" for each replica (a dead
replica's gauges read 0, its `engine_healthy` 0) and "total" for all of them
together (so sum over `replica!="total"` — or read "total"). One replica: no
`replica` label, as before.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from polyrunner.engine.async_llm import AsyncLLM
from polyrunner.engine.request_stats import StepStats

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
E2E_BUCKETS = [0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000]


class ServerMetrics:
    def __init__(self, async_llm: AsyncLLM, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self._dp = async_llm.data_parallel_size
        reg, labels, name = self.registry, ["model_name"] + (["replica"] if self._dp > 1 else []), model_name
        total = (name, "total") if self._dp > 1 else (name,)

        def gauge(metric: str, doc: str, fn, replica_fn=None) -> None:
            g = Gauge(metric, doc, labels, registry=reg)
            g.labels(*total).set_function(fn)
            for r in range(self._dp if self._dp > 1 else 0):
                g.labels(name, str(r)).set_function(lambda r=r: replica_fn(async_llm.replica_states()[r]))

        # a dead engine runs nothing, queues nothing and holds no KV cache (its last counts are stale)
        gauge("polyrunner:num_requests_running", "Number of requests in the running batch.",
              lambda: async_llm.num_running if async_llm.is_healthy else 0,
              lambda r: r.num_running if r.alive else 0)
        gauge("polyrunner:num_requests_waiting", "Number of requests waiting to be scheduled.",
              lambda: async_llm.num_waiting if async_llm.is_healthy else 0,
              lambda r: r.num_waiting if r.alive else 0)
        gauge("polyrunner:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).",
              lambda: async_llm.kv_cache_usage if async_llm.is_healthy else 0.0,
              lambda r: r.counts.kv_cache_usage if r.alive else 0.0)
        gauge("polyrunner:engine_healthy", "1 while the engine loop runs, 0 once it died.",
              lambda: 1.0 if async_llm.is_healthy else 0.0, lambda r: 1.0 if r.alive else 0.0)

        every = [total] + [(name, str(r)) for r in range(self._dp if self._dp > 1 else 0)]

        def shown(metric):   # every series is there (at 0) before anything happened
            for label_set in every:
                metric.labels(*label_set)
            return metric

        def counter(metric: str, doc: str):
            return shown(Counter(metric, doc, labels, registry=reg))

        self.prompt_tokens = counter("polyrunner:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("polyrunner:generation_tokens", "Number of generation tokens processed.")
        self.preemptions = counter("polyrunner:num_preemptions", "Cumulative number of preemptions.")
        self._success = Counter("polyrunner:request_success", "Count of finished requests by finish reason.",
                                labels + ["finished_reason"], registry=reg)
        self._name = name

        def histogram(metric: str, doc: str, buckets):
            return shown(Histogram(metric, doc, labels, buckets=buckets, registry=reg))

        reg.register(_SpecDecodeCollector(async_llm, name))
        self.ttft = histogram("polyrunner:time_to_first_token_seconds", "Time to first token (s).", TTFT_BUCKETS)
        self.itl = histogram("polyrunner:inter_token_latency_seconds", "Inter-token latency (s).", ITL_BUCKETS)
        self.e2e = histogram("polyrunner:e2e_request_latency_seconds", "End-to-end request latency (s).",
                             E2E_BUCKETS)
        self.request_prompt_tokens = histogram("polyrunner:request_prompt_tokens",
                                               "Number of prompt tokens per finished request.", TOKEN_BUCKETS)
        self.request_generation_tokens = histogram("polyrunner:request_generation_tokens",
                                                   "Number of generation tokens per finished request.",
                                                   TOKEN_BUCKETS)

    def _label_sets(self, replica: int | None) -> list[tuple[str, ...]]:
        """Where one step's stats count: the series of its replica and the total (one replica: the one series)."""
        if self._dp == 1:
            return [(self._name,)]
        return [(self._name, "total")] + ([(self._name, str(replica))] if replica is not None else [])

    def on_step(self, stats: StepStats) -> None:
        """AsyncLLM stats listener (its report thread)."""
        for labels in self._label_sets(stats.replica):
            self._count(stats, labels)

    def _count(self, stats: StepStats, labels: tuple[str, ...]) -> None:
        if stats.num_prompt_tokens:
            self.prompt_tokens.labels(*labels).inc(stats.num_prompt_tokens)
        if stats.num_generation_tokens:
            self.generation_tokens.labels(*labels).inc(stats.num_generation_tokens)
        if stats.num_preemptions:
            self.preemptions.labels(*labels).inc(stats.num_preemptions)
        ttft, itl = self.ttft.labels(*labels), self.itl.labels(*labels)
        for v in stats.time_to_first_token:
            ttft.observe(v)
        for v in stats.inter_token_latency:
            itl.observe(v)
        for t in stats.finished:
            self._success.labels(*labels, t.finish_reason or "unknown").inc()
            if t.finish_reason == "abort":   # latencies and sizes of completed requests only
                continue
            if t.e2e_latency is not None:
                self.e2e.labels(*labels).observe(t.e2e_latency)
            self.request_prompt_tokens.labels(*labels).observe(t.num_prompt_tokens)
            self.request_generation_tokens.labels(*labels).observe(t.num_generation_tokens)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _SpecDecodeCollector:
    """Speculative decoding counters (vLLM's `spec_decode_*` names) and, as gauges, the
    acceptance rate and mean acceptance length since start; nothing without speculation."""

    def __init__(self, async_llm: AsyncLLM, model_name: str) -> None:
        self.async_llm, self.name = async_llm, model_name

    def collect(self):
        counts = self.async_llm.counts.spec_decode
        if counts is None:
            return
        drafts, draft_tokens, accepted = counts
        for metric, doc, value in (
                ("polyrunner:spec_decode_num_drafts", "Number of spec decoding drafts.", drafts),
                ("polyrunner:spec_decode_num_draft_tokens", "Number of draft tokens.", draft_tokens),
                ("polyrunner:spec_decode_num_accepted_tokens", "Number of accepted tokens.", accepted)):
            family = CounterMetricFamily(metric, doc, labels=["model_name"])
            family.add_metric([self.name], value)
            yield family
        for metric, doc, value in (
                ("polyrunner:spec_decode_acceptance_rate", "Accepted / proposed draft tokens since start.",
                 accepted / draft_tokens if draft_tokens else 0.0),
                ("polyrunner:spec_decode_mean_acceptance_length",
                 "Tokens per request per verification step since start (1 + accepted drafts).",
                 1.0 + accepted / drafts if drafts else 1.0)):
            family = GaugeMetricFamily(metric, doc, labels=["model_name"])
            family.add_metric([self.name], value)
            yield family
