"""Keeps the workers alive. A worker's exit is seen at once through its process sentinel (not a
poll); a worker that stops answering is killed after --worker-timeout. Either way its requests
are redone elsewhere and it is restarted with its role (weights reloaded), unless it keeps dying.
It also runs the requests' deadlines."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

from minipd.server.router import Router
from minipd.server.worker_pool import WorkerHandle, WorkerPool
from minipd.workers import messages as m

log = logging.getLogger("minipd.supervisor")
TICK_S = 0.25


class Supervisor:
    def __init__(self, router: Router, pool: WorkerPool, worker_timeout: float = 60.0, max_restarts: int = 5,
                 restart_window: float = 600.0, start_timeout: float = 300.0, step_timeout: float = 600.0):  # fmt: skip
        self.router, self.pool = router, pool
        self.worker_timeout = worker_timeout
        self.max_restarts, self.restart_window = max_restarts, restart_window
        self.start_timeout = start_timeout
        self.step_timeout = step_timeout
        self.ready: dict[int, asyncio.Future] = {}
        self.stopping = False
        self.num_restarts = 0

    def watch_all(self) -> None:
        for w in self.pool.workers:
            self._watch(w)

    def _watch(self, w: WorkerHandle) -> None:
        loop = asyncio.get_running_loop()
        loop.add_reader(w.process.sentinel, self._on_exit, w.worker_id, w.incarnation, w.process.sentinel)

    def _on_exit(self, worker_id: int, incarnation: int, sentinel: int) -> None:
        asyncio.get_running_loop().remove_reader(sentinel)
        w = self.pool.workers[worker_id]
        if self.stopping or incarnation != w.incarnation:
            return
        w.process.join(1)  # the sentinel says it ended; reap it to read its exit code
        code = w.process.exitcode
        how = f"killed by {_signal_name(-code)}" if code is not None and code < 0 else f"exit code {code}"
        cause = f"worker {worker_id} (pid {w.pid}) died: {how}" + (f", as {w.kill_reason}" if w.kill_reason else "")
        requested = w.stop_requested and code == 0
        log.log(logging.INFO if requested else logging.ERROR, "%s", cause)
        self.pool.remove_segments_of(w)
        w.exit_cause = cause
        now = time.monotonic()
        recent = [t for t in w.restarts if now - t < self.restart_window]
        w.state = "restarting" if requested or len(recent) < self.max_restarts else "dead"
        if w.state == "dead":
            log.error("worker %d died %d times in %.0f s: not restarting it", worker_id, len(recent) + 1,
                      self.restart_window)  # fmt: skip
        fut = self.ready.pop(worker_id, None)
        if fut is not None and not fut.done():
            fut.set_exception(RuntimeError(cause))
        self.router.on_worker_lost(worker_id, cause)
        if w.state == "restarting":
            self.router.spawn(self._restart(worker_id, counted=not requested))

    async def _restart(self, worker_id: int, counted: bool = True) -> None:
        w = self.pool.workers[worker_id]
        if counted:  # a restart the operator asked for is not a crash: it uses none of the budget
            w.restarts.append(time.monotonic())
        loop = asyncio.get_running_loop()
        self.ready[worker_id] = fut = loop.create_future()
        try:
            self.pool.spawn(worker_id)
        except Exception as err:
            log.error("worker %d could not be started again (%s): leaving it dead", worker_id, err)
            w.state, w.exit_cause = "dead", f"{w.exit_cause}; restart failed: {err}"
            self.router.on_worker_lost(worker_id, w.exit_cause)
            return
        incarnation = w.incarnation
        self._watch(w)
        log.info("restarting worker %d as %s (pid %d)", worker_id, w.role, w.pid)
        try:
            await asyncio.wait_for(fut, timeout=self.start_timeout)
            await self.router.switcher.assign(worker_id)
        except Exception as err:
            if w.incarnation == incarnation and w.process.is_alive():
                log.error("worker %d did not come back (%s); killing it", worker_id, err)
                w.process.kill()  # its sentinel fires and the next restart (or giving up) follows
            return
        if w.incarnation != incarnation or not w.process.is_alive():
            return
        self.num_restarts += 1
        w.num_restarts += 1
        self.router.metrics.worker_restarts.labels(self.router.metrics.model, str(worker_id)).inc()
        self.router.on_worker_back(worker_id)
        log.info("worker %d is back (pid %d, %s)", worker_id, w.pid, w.role)

    def on_heartbeat(self, msg: m.Heartbeat) -> None:
        self.pool.on_heartbeat(msg)

    def on_ready(self, msg: m.Ready) -> None:
        if not self.pool.on_ready(msg):
            return
        fut = self.ready.get(msg.worker_id)
        if fut is not None and not fut.done():
            fut.set_result(None)

    async def run(self) -> None:
        """Heartbeats and deadlines, every tick, for as long as the server runs."""
        while True:
            await asyncio.sleep(TICK_S)
            try:
                now = time.monotonic()
                for w in self.pool.workers:
                    how = self._hung(w, now) if w.alive else None
                    if how:
                        log.error("worker %d (pid %d) %s: killing it", w.worker_id, w.pid, how)
                        w.last_heard, w.stalled_s, w.step_s = now, 0.0, 0.0
                        w.kill_reason = f"it {how}"
                        os.kill(w.pid, signal.SIGKILL)  # the sentinel takes it from there
                self.router.check_deadlines()
            except Exception:
                log.exception("the supervisor's tick failed")

    def _hung(self, w, now: float) -> str | None:
        silent = now - w.last_heard
        if silent > self.worker_timeout:
            return f"has not answered for {silent:.0f} s"
        if self.pool.hung_for(w, now) > self.worker_timeout:
            return f"has been stuck outside a step for {self.pool.hung_for(w, now):.0f} s"
        if w.step_s and w.step_s + silent > self.step_timeout:
            return f"has been in one step for {w.step_s + silent:.0f} s (--step-timeout)"
        return None

    def stop(self) -> None:
        self.stopping = True
        loop = asyncio.get_running_loop()
        for w in self.pool.workers:
            if w.process is not None:
                loop.remove_reader(w.process.sentinel)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
