"""`python -m minipd serve`: the main process (asyncio + uvloop) and its worker processes."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from aiohttp import web


def add_serve_parser(sub, add_engine_args) -> None:
    s = sub.add_parser("serve", help="run the OpenAI-compatible server")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--mode", default="colocated", choices=["colocated", "chunked", "disagg"])
    s.add_argument("--chunk-tokens", type=int, default=512)
    s.add_argument("--prefill-workers", type=int, default=1)
    s.add_argument("--decode-workers", type=int, default=1)
    s.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    s.add_argument("--workers", type=int, default=2, help="CPU: number of worker processes")
    s.add_argument("--threads-per-worker", type=int, default=None, help="CPU: torch threads in each worker")
    s.add_argument("--gpus", default=None, help="CUDA: comma-separated GPU indices (default: all visible)")
    s.add_argument("--kv-transport", default=None, choices=["shm", "cuda-ipc", "tcp"],
                   help="how KV moves between workers (default: shm on CPU, cuda-ipc on CUDA)")
    s.add_argument("--kv-link-gbps", type=float, default=None, help="tcp: emulate a link of this many Gbit/s")
    s.add_argument("--kv-link-latency-ms", type=float, default=0.0, help="tcp: emulate this one-way latency")
    s.add_argument("--max-waiting", type=int, default=256,
                   help="bounded queue: requests beyond max-num-seqs per worker plus this many get 429")
    s.add_argument("--kv-transfer-timeout", type=float, default=60.0,
                   help="disagg: seconds a KV handoff may take before its request fails and its blocks are freed")
    s.add_argument("--log-level", default="info")
    add_engine_args(s)
    s.set_defaults(func=lambda args: run(args))


def worker_configs(args) -> list[dict]:
    base = {"model": args.model, "dtype": args.dtype, "block_size": args.block_size,
            "kv_cache_tokens": args.kv_cache_tokens, "max_num_seqs": args.max_num_seqs,
            "chunk_tokens": args.chunk_tokens}  # fmt: skip
    if args.device == "cuda":
        import torch

        gpus = [int(g) for g in args.gpus.split(",")] if args.gpus else list(range(torch.cuda.device_count()))
        if not gpus:
            raise SystemExit("--device cuda: torch sees no GPU")
        return [{**base, "device": f"cuda:{g}", "threads": 1} for g in gpus]
    if args.workers < 1:
        raise SystemExit("--workers must be >= 1")
    threads = args.threads_per_worker or max(1, (os.cpu_count() or 1) // args.workers)
    return [{**base, "device": "cpu", "threads": threads} for _ in range(args.workers)]


async def serve(args) -> None:
    from minipd.models.loader import load_tokenizer, read_config, resolve, served_name
    from minipd.server.app import Api
    from minipd.server.metrics import Metrics
    from minipd.server.router import Mode, Router
    from minipd.server.worker_pool import WorkerPool

    log = logging.getLogger("minipd")
    if args.kv_transport is None:
        args.kv_transport = "cuda-ipc" if args.device == "cuda" else "shm"
    if (args.kv_transport, args.device) in (("shm", "cuda"), ("cuda-ipc", "cpu")):
        raise SystemExit(f"--kv-transport {args.kv_transport} does not work with --device {args.device}; "
                         "use shm on cpu, cuda-ipc on cuda, or tcp on either")  # fmt: skip
    mode = Mode(args.mode, args.prefill_workers, args.decode_workers, args.chunk_tokens)
    configs = worker_configs(args)
    mode.check(len(configs))
    folder = resolve(args.model)  # converts a GGUF once, before any worker needs it
    tokenizer = load_tokenizer(args.model)
    max_pos = read_config(folder).max_position if folder else 4096
    max_model_len = min(max_pos, args.kv_cache_tokens)
    name = served_name(args.model)
    pool = WorkerPool(configs, args.kv_transport, args.kv_link_gbps, args.kv_link_latency_ms)
    router = Router(pool, tokenizer, Metrics(name), args.max_waiting, args.max_num_seqs, args.kv_transfer_timeout)
    api = Api(router, name, max_model_len)
    runner = web.AppRunner(api.app(), access_log=None)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    tasks = []
    try:
        await runner.setup()
        site = web.TCPSite(runner, args.host, args.port)
        await site.start()
        log.info("minipd: listening on http://%s:%d (health: 503 until the workers are ready)", args.host, args.port)
        await pool.start(router.on_message)
        tasks.append(loop.create_task(_pump(pool, router)))
        tasks.append(loop.create_task(router.watch_workers()))
        await router.set_mode(mode)
        router.ready = True
        log.info("minipd: serving %s in mode %s", name, mode.as_dict())
        for w in pool.workers:
            log.info("  worker %d pid %d on %s, role %s, %d KV blocks of %d tokens, KV at %s", w.worker_id, w.pid,
                     w.device, w.role, w.info.num_blocks, w.info.block_size, w.info.kv_address)  # fmt: skip
        log.info("minipd: ready")
        await stop.wait()
    finally:
        log.info("minipd: shutting down")
        for t in tasks:
            t.cancel()
        await runner.cleanup()
        await pool.stop()


async def _pump(pool, router) -> None:
    while True:
        router.on_message(await pool.receive())


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stdout)  # fmt: skip
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    try:
        asyncio.run(serve(args))
    except KeyboardInterrupt:
        pass
    return 0
