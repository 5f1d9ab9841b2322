"""Faults a test can inject into real worker processes through the MINIPD_FAULTS environment
variable, e.g. MINIPD_FAULTS="fail_step_on_token=4242,slow_kv_copy_s=0.5". Off unless set.

    fail_step_on_token=T       a model step carrying token T raises
    slow_kv_copy_s=S           an in-place KV copy sleeps S seconds before each block run
    slow_step_s=S              every engine step sleeps S seconds first
    ignore_request_on_token=T  a request whose prompt has token T is dropped on arrival (a lost message)
    bad_stats_on_token=T       a request whose prompt has token T makes the worker send nonsense stats
    hang_on_token=T            a request whose prompt has token T hangs the worker's loop (outside a step)
"""

from __future__ import annotations

import logging
import os
import time

from minipd.workers import messages as m

log = logging.getLogger("minipd.worker")


def active() -> dict[str, float]:
    out = {}
    for item in filter(None, os.environ.get("MINIPD_FAULTS", "").split(",")):
        name, _, value = item.partition("=")
        out[name.strip()] = float(value or 1)
    return out


def install(worker) -> None:
    faults = active()
    if not faults:
        return
    log.warning("worker %d: test faults active: %s", worker.id, faults)
    if "fail_step_on_token" in faults:
        poison = int(faults["fail_step_on_token"])
        runner = worker.engine.runner
        run = runner.run

        def failing_run(batch):
            if any(poison in s.token_ids for s in batch.seqs):
                raise RuntimeError(f"injected fault: a step carrying token {poison}")
            return run(batch)

        runner.run = failing_run
    if "slow_kv_copy_s" in faults:
        delay = faults["slow_kv_copy_s"]
        worker.sender.copy_hook = lambda: time.sleep(delay)
    if "slow_step_s" in faults:
        pause, step = faults["slow_step_s"], worker.engine.step

        def slow_step():
            time.sleep(pause)
            return step()

        worker.engine.step = slow_step
    if {"ignore_request_on_token", "bad_stats_on_token", "hang_on_token"} & faults.keys():
        handle = worker.handle
        ignore = int(faults.get("ignore_request_on_token", -1))
        bad_stats = int(faults.get("bad_stats_on_token", -1))
        hang = int(faults.get("hang_on_token", -1))

        def faulty_handle(msg):
            tokens = getattr(msg, "prompt_token_ids", None) or ()
            if hang in tokens:
                log.warning("worker %d: injected fault: hanging on %s", worker.id, msg.key)
                while True:
                    time.sleep(1)
            if ignore in tokens:
                log.warning("worker %d: injected fault: dropped %s", worker.id, msg.key)
                return
            if bad_stats in tokens:
                worker.send(m.WorkerStats(worker.id, "nonsense", None, None, None, None, None, "x", None, None))
            handle(msg)

        worker.handle = faulty_handle
