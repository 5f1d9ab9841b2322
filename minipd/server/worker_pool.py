"""Spawns the worker processes, talks to them over ZeroMQ, notices when one dies, ends them all."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import shutil
import tempfile
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from minipd.transfer import shm
from minipd.workers import messages as m
from minipd.workers.worker import WorkerSpec, run_worker

log = logging.getLogger("minipd.pool")


@dataclass(slots=True)
class WorkerHandle:
    worker_id: int
    process: mp.Process
    control: zmq.asyncio.Socket
    device: str
    info: m.Ready | None = None
    stats: m.WorkerStats | None = None
    role: str = "both"
    alive: bool = True
    inflight: set[str] = field(default_factory=set)

    @property
    def pid(self) -> int | None:
        return self.process.pid


class WorkerPool:
    def __init__(self, engine_configs: list[dict], kv_transport: str = "shm",
                 kv_link_gbps: float | None = None, kv_link_latency_ms: float = 0.0):  # fmt: skip
        self.engine_configs = engine_configs
        self.kv_transport = kv_transport
        self.link = (kv_link_gbps, kv_link_latency_ms)
        self.tag = f"{os.getpid()}"
        self.dir = tempfile.mkdtemp(prefix="minipd-")
        self.ctx = zmq.asyncio.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.main_address = f"ipc://{self.dir}/main"
        self.inbox.bind(self.main_address)
        self.workers: list[WorkerHandle] = []

    async def start(self, on_message, timeout: float = 300.0) -> None:
        spawn = mp.get_context("spawn")
        for i, cfg in enumerate(self.engine_configs):
            spec = WorkerSpec(i, cfg, f"ipc://{self.dir}/w{i}", self.main_address, self.kv_transport,
                              self.link[0], self.link[1], self.tag)  # fmt: skip
            proc = spawn.Process(target=run_worker, args=(spec,), name=f"minipd-worker-{i}", daemon=True)
            proc.start()
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(spec.control_address)
            self.workers.append(WorkerHandle(i, proc, sock, cfg.get("device", "cpu")))
        pending = set(range(len(self.workers)))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while pending:
            if any(not self.workers[i].process.is_alive() for i in pending):
                raise RuntimeError("a worker process exited while starting (see its log above)")
            try:
                data = await asyncio.wait_for(self.inbox.recv(), timeout=min(1.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                if loop.time() > deadline:
                    raise RuntimeError("workers did not become ready in time") from None
                continue
            msg = m.decode(data)
            if isinstance(msg, m.Ready):
                self.workers[msg.worker_id].info = msg
                pending.discard(msg.worker_id)
            else:
                on_message(msg)

    async def receive(self):
        return m.decode(await self.inbox.recv())

    async def send(self, worker_id: int, msg) -> None:
        await self.workers[worker_id].control.send(m.encode(msg))

    def dead_workers(self) -> list[WorkerHandle]:
        newly = [w for w in self.workers if w.alive and not w.process.is_alive()]
        for w in newly:
            w.alive = False
        return newly

    async def stop(self, grace: float = 5.0) -> None:
        for w in self.workers:
            if w.process.is_alive():
                try:
                    await w.control.send(m.encode(m.Shutdown()))
                except zmq.ZMQError:
                    pass
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while any(w.process.is_alive() for w in self.workers) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        self.kill()

    def kill(self) -> None:
        for w in self.workers:
            if w.process.is_alive():
                w.process.terminate()
                w.process.join(2)
            if w.process.is_alive():
                w.process.kill()
                w.process.join(2)
        left = shm.unlink_all(self.tag)
        if left:
            log.warning("removed %d shared-memory segments left by workers", len(left))
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.dir, ignore_errors=True)
