"""Asking a starting worker for its stacks must never end it."""

import asyncio
import signal

from minipd.__main__ import build_parser
from minipd.server.cli import worker_configs
from minipd.server.worker_pool import WorkerPool


def test_asking_for_stacks_the_moment_a_worker_is_spawned_does_not_kill_it():
    """Defect: SIGUSR1's default action ends a process, and a worker only installs its handler
    (faulthandler) once the interpreter has started: `--worker-timeout 1` killed workers that
    were still starting (exit code -10) instead of reporting on them."""
    args = build_parser().parse_args(["serve", "--model", "tiny-random", "--workers", "1",
                                      "--threads-per-worker", "1"])  # fmt: skip
    pool = WorkerPool(worker_configs(args))
    try:
        proc = pool.spawn(0).process
        pool.report_stacks([0], "asked at once")
        proc.join(timeout=1.0)
        assert proc.exitcode != -signal.SIGUSR1
        proc.kill()
        proc.join()
        asyncio.run(pool.start(lambda msg: None, timeout=120.0, report_after=0.0))  # spawns afresh, asks at once
        assert pool.workers[0].process.is_alive() and pool.workers[0].info is not None
    finally:
        pool.kill()
