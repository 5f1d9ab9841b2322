"""Spawns the worker processes, talks to them over ZeroMQ, replaces one that died, ends them all.

Each start of a worker (an incarnation) gets its own control socket, so nothing queued for a
dead process can reach its replacement."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from minipd.transfer import shm
from minipd.workers import messages as m
from minipd.workers.launch import WorkerSpec, run_worker

log = logging.getLogger("minipd.pool")


UNRESPONSIVE_S = 5.0  # a worker that has shown no sign of life (heartbeats every 0.5 s) this long is named


def unresponsive(pool, workers) -> dict[int, float]:
    """Worker id -> seconds without a sign of life, for those of `workers` silent past UNRESPONSIVE_S
    (/health says degraded, a mode switch does not wait on them, placements and seats avoid them)."""
    now = time.monotonic()
    silent = {w.worker_id: pool.hung_for(w, now) for w in workers}
    return {wid: s for wid, s in silent.items() if s > UNRESPONSIVE_S}


@dataclass(slots=True)
class WorkerHandle:
    worker_id: int
    config: dict
    device: str
    process: mp.Process | None = None
    control: zmq.Socket | None = None
    incarnation: int = -1
    info: m.Ready | None = None
    stats: m.WorkerStats | None = None
    role: str = "both"  # the role it has, or gets when it comes back
    state: str = "starting"  # starting | up | restarting | dead
    draining: bool = False  # its requests are being moved away; it gets no new ones
    leaving: bool = False  # it was sent SIGTERM (this incarnation)
    last_heard: float = 0.0  # time.monotonic() of its last message
    step_s: float = 0.0  # its last heartbeat: how long the step under way had run
    stalled_s: float = 0.0  # ... how long its loop had not come round outside a step
    exit_cause: str | None = None
    kill_reason: str | None = None  # why the supervisor killed it, if it did
    stop_requested: bool = False  # an operator's drain with restart: its clean exit is not a crash
    restarts: list[float] = field(default_factory=list)  # when it crashed and was restarted (the crash budget)
    num_restarts: int = 0  # times it came back, asked for or not

    @property
    def alive(self) -> bool:
        return self.state == "up"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def peer(self) -> dict:
        """How other workers reach this one's KV (transfer.wire.Peer fields)."""
        i = self.info
        return {"kv_address": i.kv_address, "cache_name": i.kv_cache_name, "cache_shape": i.kv_cache_shape,
                "cache_dtype": i.kv_cache_dtype, "cache_handle": i.kv_cache_handle}  # fmt: skip


def catches_signal(pid: int, signum: int) -> bool:
    """Whether the process has a handler for `signum` (Linux's /proc; False where it cannot tell)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next(line for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(int(caught.split()[1], 16) & (1 << (signum - 1)))


class WorkerPool:
    def __init__(self, engine_configs: list[dict], kv_transport: str = "shm", kv_link_gbps: float | None = None,
                 kv_link_latency_ms: float = 0.0, kv_transfer_timeout: float = 60.0, seat_timeout: float = 300.0):
        self.kv_transport = kv_transport
        self.spec_defaults = dict(kv_transport=kv_transport, kv_link_gbps=kv_link_gbps,
                                  kv_link_latency_ms=kv_link_latency_ms, kv_transfer_timeout=kv_transfer_timeout,
                                  seat_timeout=seat_timeout)  # fmt: skip
        self.tag = shm.new_tag()
        self.owner = shm.Owner(self.tag) if kv_transport == "shm" else None
        orphans = shm.remove_orphans() if kv_transport == "shm" else []
        if orphans:
            log.info("removed %d shared-memory segments left by servers that were killed: %s", len(orphans),
                     ", ".join(orphans[:4]))  # fmt: skip
        self.dir = tempfile.mkdtemp(prefix="minipd-")
        self.ctx = zmq.Context()
        self.actx = zmq.asyncio.Context()
        self.inbox = self.actx.socket(zmq.PULL)
        self.main_address = f"ipc://{self.dir}/main"
        self.inbox.bind(self.main_address)
        self.workers = [WorkerHandle(i, cfg, cfg.get("device", "cpu")) for i, cfg in enumerate(engine_configs)]

    def spawn(self, worker_id: int) -> WorkerHandle:
        """Start (or restart) a worker process; it reports Ready when its model is loaded."""
        w = self.workers[worker_id]
        if w.control is not None:
            w.control.close(linger=0)  # whatever was queued for the previous process is dropped
        w.incarnation += 1
        spec = WorkerSpec(worker_id, w.config, f"ipc://{self.dir}/w{worker_id}-{w.incarnation}", self.main_address,
                          tag=self.tag, incarnation=w.incarnation, **self.spec_defaults)  # fmt: skip
        proc = mp.get_context("spawn").Process(target=run_worker, args=(spec,), name=f"minipd-worker-{worker_id}",
                                               daemon=True)  # fmt: skip
        proc.start()
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)  # never block the event loop on a busy worker
        sock.connect(spec.control_address)
        w.process, w.control, w.info, w.stats = proc, sock, None, None
        w.last_heard, w.step_s, w.stalled_s, w.kill_reason = time.monotonic(), 0.0, 0.0, None
        w.stop_requested = False
        w.draining = w.leaving = False
        return w

    async def start(self, on_message, timeout: float = 300.0, report_after: float = 60.0) -> None:
        """Start every worker and wait until all are ready. Those not ready after `report_after`
        seconds are asked for their stacks (faulthandler, into the log), once: what a start waits on."""
        for w in self.workers:
            self.spawn(w.worker_id)
        pending = {w.worker_id for w in self.workers}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        report_at = loop.time() + report_after
        unasked: list[int] = []
        while pending:
            if report_at is not None and loop.time() > report_at:
                report_at = None
                unasked = self.report_stacks(sorted(pending), f"not ready after {report_after:g} s")
            elif unasked:
                unasked = [i for i in unasked if i in pending]
                able = [i for i in unasked if catches_signal(self.workers[i].process.pid, signal.SIGUSR1)]
                if able:
                    unasked = [i for i in unasked if i not in able]
                    self.report_stacks(able, "not ready yet, now able to answer")
            for i in pending:
                if not self.workers[i].process.is_alive():
                    raise RuntimeError(f"worker {i} exited while starting (exit code "
                                       f"{self.workers[i].process.exitcode}; see its log above)")  # fmt: skip
            try:
                msg = await asyncio.wait_for(self.receive(), timeout=min(1.0, max(0.01, deadline - loop.time())))
            except asyncio.TimeoutError:
                if loop.time() > deadline:
                    raise RuntimeError("workers did not become ready in time") from None
                continue
            if isinstance(msg, m.Ready):
                if self.on_ready(msg):
                    pending.discard(msg.worker_id)
            elif isinstance(msg, m.Heartbeat):
                self.on_heartbeat(msg)
            else:
                on_message(msg)
        for w in self.workers:
            w.state = "up"

    def report_stacks(self, worker_ids: list[int], why: str) -> list[int]:
        """Ask these workers to write their threads' stacks to the log. Returns those that cannot be
        asked yet: SIGUSR1 ends a process that has not installed its handler, so they are not sent it."""
        log.warning("worker(s) %s %s; each one's threads follow (SIGUSR1, faulthandler)", worker_ids, why)
        not_yet = []
        for i in worker_ids:
            proc = self.workers[i].process
            if proc is None or proc.pid is None or not proc.is_alive():
                continue
            if not catches_signal(proc.pid, signal.SIGUSR1):
                log.warning("worker %d is still starting its interpreter; its stacks follow once it can write them", i)
                not_yet.append(i)
                continue
            try:
                os.kill(proc.pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        return not_yet

    def on_ready(self, msg: m.Ready) -> bool:
        """Record a worker's Ready; False if it came from an incarnation that is already gone."""
        w = self.workers[msg.worker_id]
        if msg.incarnation != w.incarnation:
            return False
        w.info = msg
        return True

    def on_heartbeat(self, msg: m.Heartbeat) -> None:
        w = self.workers[msg.worker_id]
        if msg.incarnation == w.incarnation:
            w.step_s, w.stalled_s = msg.step_s, msg.stalled_s

    def hung_for(self, w: WorkerHandle, now: float) -> float:
        """Seconds the worker has shown no sign of progress: silent (stopped, or its heartbeat
        thread cannot run), or its loop stuck outside a step. A long step is progress."""
        return w.stalled_s + now - w.last_heard

    async def receive(self):
        msg = m.decode(await self.inbox.recv())
        worker_id = getattr(msg, "worker_id", None)
        if worker_id is not None and 0 <= worker_id < len(self.workers):
            self.workers[worker_id].last_heard = time.monotonic()
        return msg

    def send(self, worker_id: int, msg) -> bool:
        """Queue a message for a worker; False if it cannot take it (its process is gone)."""
        w = self.workers[worker_id]
        if w.control is None:
            return False
        try:
            w.control.send(m.encode(msg), zmq.NOBLOCK)
            return True
        except zmq.Again:
            log.debug("worker %d is not reachable; dropped a %s", worker_id, type(msg).__name__)
            return False

    def with_role(self, role: str) -> list[WorkerHandle]:
        return [w for w in self.workers if w.alive and w.role == role and not w.draining]

    def peers(self) -> dict[int, dict]:
        return {w.worker_id: w.peer() for w in self.workers if w.info is not None}

    async def stop(self, grace: float = 5.0) -> None:
        for w in self.workers:
            if w.process is None or not w.process.is_alive():
                continue
            if w.state in ("starting", "restarting"):  # deaf to Shutdown and SIGTERM until ready; holds nothing yet
                w.process.kill()
            else:
                self.send(w.worker_id, m.Shutdown())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while any(w.process and w.process.is_alive() for w in self.workers) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        self.kill()

    def kill(self) -> None:
        for w in self.workers:
            p = w.process
            if p is not None and p.is_alive():
                p.terminate()
                p.join(2)
            if p is not None and p.is_alive():
                p.kill()
                p.join(2)
        left = [n for n in shm.unlink_all(self.tag) if self.owner is None or n != os.path.basename(self.owner.path)]
        if left:
            log.info("removed %d shared-memory segments left by workers", len(left))
        if self.owner is not None:
            self.owner.release()
        self.ctx.destroy(linger=0)
        self.actx.destroy(linger=0)
        shutil.rmtree(self.dir, ignore_errors=True)

    def remove_segments_of(self, w: WorkerHandle) -> None:
        """A worker died, perhaps before it was ready: its KV cache segment would outlive it."""
        if self.kv_transport == "shm" and w.incarnation >= 0:
            shm.unlink_name(shm.cache_segment_name(self.tag, w.worker_id, w.incarnation))
