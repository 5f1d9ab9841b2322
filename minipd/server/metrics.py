"""Prometheus metrics with vLLM's meanings, under the minipd: prefix."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        labels = ["model_name"]
        self.model = model_name
        self.ttft = Histogram("minipd:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.itl = Histogram("minipd:inter_token_latency_seconds", "Gap between streamed tokens.", labels,
                             buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.e2e = Histogram("minipd:e2e_request_latency_seconds", "End-to-end request latency.", labels,
                             buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.queue_time = Histogram("minipd:request_queue_time_seconds",
                                    "Arrival to prefill start (router queue, seat wait, worker queue).", labels,
                                    buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.running = Gauge("minipd:num_requests_running", "Requests in a worker's running batch.", labels, registry=r)
        self.waiting = Gauge("minipd:num_requests_waiting", "Requests waiting (router queue and workers).", labels,
                             registry=r)  # fmt: skip
        self.kv_usage = Gauge("minipd:kv_cache_usage_perc", "KV blocks used or reserved, 0-1.", ["model_name", "worker"],
                              registry=r)  # fmt: skip
        self.prompt_tokens = Counter("minipd:prompt_tokens", "Prompt tokens.", labels, registry=r)
        self.generation_tokens = Counter("minipd:generation_tokens", "Generated tokens.", labels, registry=r)
        self.success = Counter("minipd:request_success", "Finished requests.", ["model_name", "finished_reason"],
                               registry=r)  # fmt: skip
        self.kv_bytes = Counter("minipd:kv_transfer_bytes", "KV bytes handed from prefill to decode workers.", labels,
                                registry=r)  # fmt: skip
        self.kv_seconds = Histogram("minipd:kv_transfer_seconds", "Time of one KV handoff.", labels,
                                    buckets=TRANSFER_BUCKETS, registry=r)  # fmt: skip

    def render(self) -> bytes:
        return generate_latest(self.registry)
