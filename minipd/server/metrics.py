"""Prometheus metrics with vLLM's names and meanings under the minipd: prefix, plus minipd's own
(mode, switches, seats, handoffs, redos, worker restarts)."""

from __future__ import annotations

import prometheus_client
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST

prometheus_client.disable_created_metrics()  # vLLM's exposition has no *_created series either


class Metrics:
    def __init__(self, model_name: str, num_workers: int = 0):
        self.registry = r = CollectorRegistry()
        labels = ["model_name"]
        self.model = model_name

        def histogram(name, doc, buckets=LATENCY_BUCKETS):
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        def counter(name, doc, extra=()):
            return Counter(name, doc, [*labels, *extra], registry=r)

        def gauge(name, doc, extra=()):
            return Gauge(name, doc, [*labels, *extra], registry=r)

        self.ttft = histogram("minipd:time_to_first_token_seconds", "Time to first token.")
        self.itl = histogram("minipd:inter_token_latency_seconds", "Gap between streamed tokens.")
        self.e2e = histogram("minipd:e2e_request_latency_seconds", "End-to-end request latency.")
        self.queue_time = histogram("minipd:request_queue_time_seconds",
                                    "Arrival to prefill start (router queue, seat wait, worker queue).")  # fmt: skip
        self.running = gauge("minipd:num_requests_running", "Requests in a worker's running batch.")
        self.waiting = gauge("minipd:num_requests_waiting", "Requests waiting (for a seat, and in the workers).")
        self.preemptions = counter("minipd:num_preemptions", "Requests preempted: their KV freed, to be read again.")
        self.kv_usage = gauge("minipd:kv_cache_usage_perc", "KV blocks used (seats included), 0-1.", ["worker"])
        self.prompt_tokens = counter("minipd:prompt_tokens", "Prompt tokens.")
        self.generation_tokens = counter("minipd:generation_tokens", "Generated tokens.")
        self.success = counter("minipd:request_success", "Finished requests.", ["finished_reason"])
        self.kv_bytes = counter("minipd:kv_transfer_bytes", "KV bytes handed from prefill to decode workers.")
        self.kv_seconds = histogram("minipd:kv_transfer_seconds", "Time of one KV handoff.", TRANSFER_BUCKETS)
        self.handoffs = counter("minipd:kv_handoffs", "KV handoffs by transport and outcome.", ["transport", "outcome"])
        self.seats_reserved = counter("minipd:seats_reserved", "Decode seats granted.")
        self.seats_waiting = gauge("minipd:seats_waiting", "Requests waiting for a decode seat.")
        self.mode = Info("minipd:mode", "The serving mode.", registry=r)
        self.mode_switches = counter("minipd:mode_switches", "Run-time mode switches.")
        self.redos = counter("minipd:request_redos", "Requests redone after the worker holding them died.")
        self.moves = counter("minipd:request_moves", "Running replies moved between workers, by reason and outcome.",
                             ["reason", "outcome"])  # fmt: skip
        self.move_bytes = counter("minipd:request_move_bytes", "KV bytes of the replies moved between workers.")
        self.placements = counter("minipd:disagg_placements",
                                  "Disaggregated requests by path: remote (prefilled on a prefill worker), local "
                                  "(prompt under local_prefill_tokens, prefilled by its decode worker) or "
                                  "prefill_only (it ends at its first token, on the prefill worker).", ["path"])  # fmt: skip
        self.worker_restarts = counter("minipd:worker_restarts", "Workers restarted after they died.", ["worker"])
        self.worker_gc_longest = gauge("minipd:worker_gc_longest_full_collection_seconds",
                                       "The longest full garbage collection of the worker (it stops the worker's "
                                       "step), since it started.", ["worker"])  # fmt: skip
        self.worker_gc_seconds = counter("minipd:worker_gc_seconds",
                                         "Seconds the workers spent in garbage collection.", ["worker"])
        for family in (self.ttft, self.itl, self.e2e, self.queue_time, self.running, self.waiting, self.preemptions,
                       self.prompt_tokens,
                       self.generation_tokens, self.kv_bytes, self.kv_seconds, self.seats_reserved,
                       self.seats_waiting, self.mode_switches, self.redos, self.move_bytes):  # fmt: skip
            family.labels(model_name)  # every series exists from the start, at zero
        for w in range(num_workers):
            self.kv_usage.labels(model_name, str(w)).set(0)
            self.worker_restarts.labels(model_name, str(w))

    def render(self) -> bytes:
        return generate_latest(self.registry)
