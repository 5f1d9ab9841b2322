"""Tokens from the workers to the client: the text they make (detokenized, stop strings applied),
their timing, and the latency metrics they feed."""

from __future__ import annotations

import time

from minipd.server.metrics import Metrics
from minipd.server.request_state import Delta, RequestState
from minipd.workers import messages as m


class Relay:
    def __init__(self, metrics: Metrics, kv_transport: str = "shm"):
        self.metrics = metrics
        self.kv_transport = kv_transport

    @staticmethod
    def in_order(state: RequestState, msg: m.Tokens) -> list[m.Tokens]:
        """The Tokens messages that can be relayed now, in order: one that arrives before the ones
        before it waits (state.gap_since says since when the first one missing is awaited); one
        already relayed (an attempt's duplicate) is dropped."""
        have = len(state.output_token_ids)
        if msg.index < have:
            return []
        state.early[msg.index] = msg
        ready = []
        while have in state.early:
            ready.append(state.early.pop(have))
            have += len(ready[-1].token_ids)
        if not state.early:
            state.gap_since = None
        elif ready or state.gap_since is None:
            state.gap_since = time.monotonic()
        return ready

    def tokens(self, state: RequestState, msg: m.Tokens) -> tuple[str | None, str, list | None]:
        """Record the tokens and stream their text. Returns (finish reason or None, text and
        logprobs still to send): a finished request's last text goes out with its ending."""
        met, model = self.metrics, self.metrics.model
        if state.token_times:
            met.itl.labels(model).observe(msg.time - state.token_times[-1])
        else:
            met.ttft.labels(model).observe(msg.time - state.arrival)
        state.token_times += [msg.time] * len(msg.token_ids)
        state.output_token_ids += msg.token_ids
        met.generation_tokens.labels(model).inc(len(msg.token_ids))
        stop_token = msg.finished and msg.finish_reason == "stop"  # eos or stop_token_ids (the engine's stops)
        text = state.stream.push(msg.token_ids, final=msg.finished, stop_token=stop_token) if state.stream else ""
        logprobs = [[t, *entry] for t, entry in zip(msg.token_ids, msg.logprobs)] if msg.logprobs else None
        if msg.prompt_logprobs is not None and msg.index == 0:
            state.prompt_logprobs = msg.prompt_logprobs
        if state.stream is not None and state.stream.stopped:
            state.stop_reason = state.stream.stop_reason
            return "stop", text, logprobs
        if msg.finished:
            state.stop_reason = msg.stop_reason
            return msg.finish_reason, text, logprobs
        state.deltas.put_nowait(Delta(text, len(msg.token_ids), logprobs=logprobs, token_ids=msg.token_ids))
        return None, "", None

    def event(self, state: RequestState, msg: m.Event) -> None:
        first = msg.kind not in state.events
        state.events[msg.kind] = msg.time
        met, model = self.metrics, self.metrics.model
        if msg.kind == "prefill_start" and first:
            met.queue_time.labels(model).observe(msg.time - state.arrival)
        elif msg.kind == "transfer_end":
            state.kv_bytes, state.kv_seconds = msg.data["bytes"], msg.data["seconds"]
            met.kv_bytes.labels(model).inc(state.kv_bytes)
            met.kv_seconds.labels(model).observe(state.kv_seconds)
            met.handoffs.labels(model, self.kv_transport, "imported").inc()
