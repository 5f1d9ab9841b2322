"""Faults a test can inject into real worker processes through the MINIPD_FAULTS environment
variable, e.g. MINIPD_FAULTS="fail_step_on_token=4242,slow_kv_copy_s=0.5". Off unless set.

    fail_step_on_token=T       a model step carrying token T raises
    slow_kv_copy_s=S           an in-place KV copy sleeps S seconds before each block run
    slow_step_s=S              every engine step sleeps S seconds first
    ignore_request_on_token=T  a request whose prompt has token T is dropped on arrival (a lost message)
    bad_stats_on_token=T       a request whose prompt has token T makes the worker send nonsense stats
    hang_on_token=T            a request whose prompt has token T hangs the worker's loop (outside a step)
    fail_kv_write_on_token=T   the prefill worker fails to start writing the KV of a prompt with token T
    hang_at_start_s=S          the worker sleeps S seconds before it reports Ready (a start that hangs)
    slow_seat_s=S              the worker sleeps S seconds before it reserves seats (a move's seat that comes late)

The KV of a prompt with token T on its way (the middle part is the one numbered parts // 2):

    drop_kv_part_on_token=T    tcp: its middle part is lost on the wire
    cut_kv_part_on_token=T     tcp: its middle part arrives cut to half its bytes
    reset_kv_link_on_token=T   tcp: the connection is reset halfway: BEGIN and the parts before the middle are
                               lost, the rest arrives on the new connection
    kv_outage_on_token=T       the link to its decode worker goes silent for kv_outage_s seconds (default 3),
                               from its middle part (in place: from its END) on: nothing can be sent on it meanwhile
    kv_faults_first_attempt=1  the four above hit only a request's first attempt (key ending in .1): its redo goes through
"""

from __future__ import annotations

import logging
import os
import time

import zmq

from minipd.transfer import wire
from minipd.workers import messages as m

log = logging.getLogger("minipd.worker")
KV_LINK_FAULTS = ("drop_kv_part_on_token", "cut_kv_part_on_token", "reset_kv_link_on_token", "kv_outage_on_token")


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
    if "hang_at_start_s" in faults:
        time.sleep(faults["hang_at_start_s"])
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
    if "slow_seat_s" in faults:
        pause, reserve = faults["slow_seat_s"], worker._reserve

        def slow_reserve(msg):
            time.sleep(pause)
            return reserve(msg)

        worker._reserve = slow_reserve
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
    if "fail_kv_write_on_token" in faults:
        poison, handoff_kv = int(faults["fail_kv_write_on_token"]), worker.engine.handoff_kv

        def failing_handoff_kv(key):
            if poison in worker.engine.scheduler.handoffs[key].token_ids:
                raise RuntimeError(f"injected fault: the KV write of a prompt with token {poison} could not start")
            return handoff_kv(key)

        worker.engine.handoff_kv = failing_handoff_kv
    if faults.keys() & set(KV_LINK_FAULTS):
        tokens = {name: int(faults[name]) for name in KV_LINK_FAULTS if name in faults}
        _install_kv_link_faults(worker.sender, tokens, faults.get("kv_outage_s", 3.0),
                                bool(faults.get("kv_faults_first_attempt")))


def _install_kv_link_faults(sender, tokens: dict[str, int], outage_s: float, first_attempt: bool = False) -> None:
    hit: dict[str, tuple[str, int]] = {}  # key -> (fault, its middle part)
    silent_until: dict[str, float] = {}  # address -> end of its outage
    silenced: set[str] = set()  # keys whose KV met its outage
    write = sender.write

    def write_and_mark(key, kv, meta, *args):
        prompt = meta["token_ids"][: meta["num_prompt_tokens"]]
        for name, token in tokens.items():
            if token in prompt and not (first_attempt and not key.endswith(".1")):
                hit[key] = (name, kv.num_parts // 2)
        return write(key, kv, meta, *args)

    def on_the_wire(address, frames):
        kind, body = wire.parse(frames)
        key, index = body[:2] if kind == wire.PART else (body["key"], None)
        name, middle = hit.get(key, (None, None))
        begins = kind == wire.END and body["outcome"] == wire.WRITTEN if sender.in_place else index == middle
        if name == "kv_outage_on_token" and begins and key not in silenced:
            silenced.add(key)
            silent_until[address] = time.monotonic() + outage_s
        if time.monotonic() < silent_until.get(address, 0.0):
            time.sleep(0.02)  # what a poll for room would wait
            raise zmq.Again()
        if name == "drop_kv_part_on_token" and index == middle:
            return None
        if name == "cut_kv_part_on_token" and index == middle:
            data = bytes(memoryview(frames[3]))
            return [*frames[:3], data[: len(data) // 2]]
        if name == "reset_kv_link_on_token" and (kind == wire.BEGIN or index is not None and index < middle):
            return None
        return frames

    sender.write = write_and_mark
    sender.wire_hook = on_the_wire
