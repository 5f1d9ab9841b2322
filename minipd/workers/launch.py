"""What the main process needs to start a worker, without importing torch itself."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class WorkerSpec:
    worker_id: int
    engine: dict  # EngineConfig fields
    control_address: str  # this worker binds it
    main_address: str  # the main process binds it
    kv_transport: str = "shm"
    kv_link_gbps: float | None = None
    kv_link_latency_ms: float = 0.0
    kv_transfer_timeout: float = 60.0
    seat_timeout: float = 300.0
    tag: str = "0"  # names this server's shared-memory segments
    incarnation: int = 0  # how many times this worker id was started before


def run_worker(spec: WorkerSpec) -> None:
    """The worker process's entry point (spawned). A terminal's Ctrl-C (or systemd's SIGTERM to the
    whole group) is the main process's to handle: it drains, then tells the workers to stop. A
    SIGTERM to this worker alone asks the main process to move its requests away and stop it."""
    import faulthandler
    import signal

    try:
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # the server asks when a start takes too long
    except (RuntimeError, ValueError, OSError):  # no usable stderr: the server then never asks (see SigCgt)
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # until the worker can say it is leaving
    from minipd.heap import freeze_startup_heap
    from minipd.workers.worker import Worker

    worker = Worker(spec)
    freeze_startup_heap()  # torch, the model: a full collection walked them all, mid-step (minipd/heap.py)
    signal.signal(signal.SIGTERM, lambda signum, frame: worker.leave())
    worker.loop()
