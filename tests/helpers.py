"""Shared test helpers: run requests through an engine with staggered arrivals."""

from __future__ import annotations

import time
from contextlib import contextmanager

from minipd.bench.server_process import ServerProcess
from minipd.engine.engine import Engine
from minipd.sampling_params import SamplingParams


def run_staggered(engine: Engine, prompts: list[list[int]], params: SamplingParams, join_every: int = 3,
                  check=None) -> list[list[int]]:  # fmt: skip
    """Add one prompt every `join_every` steps, so later ones join while earlier ones decode."""
    outputs = {str(i): [] for i in range(len(prompts))}
    pending = list(enumerate(prompts))
    step = 0
    while pending or engine.has_unfinished():
        if pending and step % join_every == 0:
            i, p = pending.pop(0)
            engine.add_request(str(i), p, params)
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
        if check:
            check(engine)
        step += 1
    return [outputs[str(i)] for i in range(len(prompts))]


def run_disaggregated(prefill: Engine, decode: Engine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Prefill every prompt on one engine, hand each KV into a seat on the other, decode there."""
    outputs = {str(i): [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        prefill.add_request(str(i), p, params)
    while prefill.has_unfinished() or decode.has_unfinished():
        for out in prefill.step():
            outputs[out.request_id] += out.new_token_ids
            if out.handoff:
                handoff = prefill.export_handoff(out.request_id)
                assert handoff.kv.shape[2] == len(prompts[int(out.request_id)])
                assert decode.reserve_seat(out.request_id, handoff.meta.num_computed_tokens)
                decode.import_handoff(handoff)
                prefill.release_handoff(out.request_id)
        for out in decode.step():
            outputs[out.request_id] += out.new_token_ids
    return [outputs[str(i)] for i in range(len(prompts))]


@contextmanager
def serving(*args: str):
    """A real server for the block; afterwards no worker process and no shared memory may remain."""
    server = ServerProcess(*args)
    try:
        yield server
    finally:
        server.stop()
    assert server.leftovers() == ([], [])


def wait_for_idle_workers(server: ServerProcess, timeout: float) -> None:
    """Until every worker reports no KV blocks in use and no request in flight."""
    deadline = time.monotonic() + timeout
    while True:
        workers = server.get("/admin/workers")[1]["workers"]
        if all(w["kv_blocks_used"] == 0 and w["inflight"] == 0 for w in workers):
            return
        assert time.monotonic() < deadline, workers
        time.sleep(0.2)
