"""`python -m minipd serve`: the main process (asyncio + uvloop) and its worker processes.
The main process never imports torch (a test checks it)."""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import os
import signal
import socket
import sys

from minipd.cli_help import DefaultsFormatter, nonnegative_float, port_number, positive_float, positive_int

log = logging.getLogger("minipd")


class UserError(Exception):
    """A mistake in how the server was started: one line on stderr, exit code 2."""


def add_serve_parser(sub, add_engine_args) -> None:
    s = sub.add_parser("serve", help="run the OpenAI-compatible server", description=__doc__.splitlines()[0],
                       formatter_class=DefaultsFormatter)  # fmt: skip
    g = s.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    g.add_argument("--port", type=port_number, default=8000, help="HTTP port")
    g.add_argument(
        "--api-key",
        default=os.environ.get("MINIPD_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 and /admin (default: none; env MINIPD_API_KEY)",
    )
    g.add_argument("--allowed-origins", type=_name_list, default=[],
                   help="web pages (origins, e.g. http://localhost:3000; '*' for any) that may use /v1 from a "
                        "browser; pages from other origins may not change the server in any case (default: none)")
    g.add_argument("--allowed-hosts", type=_name_list, default=[],
                   help="Host header names accepted besides this machine's own (bound to loopback, others are "
                        "refused against DNS rebinding; '*': any) (default: none)")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log level")
    g.add_argument("--default-max-tokens", type=int, default=1024,
                   help="chat requests without max_tokens get this many at most (completions: 16, as OpenAI)")
    g.add_argument("--max-waiting", type=int, default=256,
                   help="requests queued beyond what the workers run; past it new requests get 429")
    g.add_argument("--request-timeout", type=positive_float, default=600.0,
                   help="seconds a request may take in all; past it, it ends with an error and frees its KV")
    g.add_argument("--drain-timeout", type=nonnegative_float, default=30.0,
                   help="on SIGTERM or Ctrl-C, seconds to let running requests finish before exiting")
    g.add_argument("--timeout-keep-alive", type=positive_float, default=75.0,
                   help="seconds a connection may wait for its next request, or for the rest of a request's "
                        "headers, before it is closed")
    g.add_argument("--send-timeout", type=positive_float, default=60.0,
                   help="seconds a reply may wait for its client to read any of it (the socket's buffers full); "
                        "past it the connection is closed and the request ends, freeing its KV (a slow reader "
                        "that keeps reading goes on)")
    g.add_argument("--max-connections", type=positive_int, default=None,
                   help="open client connections at most; past it the oldest connection waiting for a request is "
                        "closed, or (none idle) the new one's request gets a 503 (default: half the open-files "
                        "limit, raised to its hard limit at start, at most 10,000)")
    g = s.add_argument_group("modes")
    g.add_argument("--mode", default="colocated", choices=["colocated", "chunked", "disagg", "auto"],
                   help="how prefill and decode share the workers (switch at run time: POST /admin/mode); auto: "
                        "start colocated and let the advisor switch live from measured traffic (GET /admin/advisor)")
    g.add_argument("--advisor-window", type=positive_float, default=30.0,
                   help="auto: seconds of traffic behind each decision")
    g.add_argument("--advisor-min-gain", type=nonnegative_float, default=0.1,
                   help="auto: the predicted goodput gain (0.1 = 10%%) a switch must promise, twice in a row")
    g.add_argument("--advisor-model", default="sim", choices=["sim", "planner"],
                   help="auto: how the advisor predicts each mode: sim replays the window's requests through the "
                        "simulator on step times fitted from the workers' own steps; planner is the planner's "
                        "mean-value model (blind to stalls)")
    g.add_argument("--advisor-profile", metavar="FILE",
                   help="auto with --advisor-model sim: step times from a profile measured by `python -m minipd "
                        "profile` instead of fitted live")
    g.add_argument("--rebalance-ratio", type=nonnegative_float, default=None,
                   help="move running replies from a worker that decodes more than this many times the replies of "
                        "the emptiest one (and at least 4 more) to it, at a token boundary; 0: off (none: off, "
                        "but 2 while auto is on)")
    g.add_argument("--rebalance-interval", type=positive_float, default=1.0, help="seconds between two rebalancing checks")
    g.add_argument("--slo-ttft-ms", type=positive_float, default=1000.0, help="auto: the TTFT SLO the advisor plans for")
    g.add_argument("--slo-tpot-ms", type=positive_float, default=100.0, help="auto: the TPOT SLO the advisor plans for")
    g.add_argument("--chunk-tokens", type=int, default=512,
                   help="chunked: token budget per step: every running decode, then prompt chunks with the rest (at least a quarter)")
    g.add_argument("--switch-drain-timeout", type=positive_float, default=600.0,
                   help="a switch with {\"drain\": true}: seconds it waits for the running requests to finish (new "
                        "ones wait meanwhile); past it the switch is given up with a 503 and they go on in the old "
                        "mode. Other switches move running replies instead of waiting for them")
    g = s.add_argument_group("disagg and KV transfer")
    g.add_argument("--prefill-workers", type=int, default=1, help="disagg: workers that read prompts (P of xPyD)")
    g.add_argument("--decode-workers", type=int, default=1, help="disagg: workers that write replies (D of xPyD)")
    g.add_argument("--local-prefill-tokens", type=int, default=0,
                   help="disagg: prompts shorter than this are prefilled by their decode worker itself, not sent "
                        "to a prefill worker (per-request disaggregation, as Dynamo and llm-d do; 0: never)")
    g.add_argument("--kv-transport", default=None, choices=["shm", "cuda-ipc", "tcp"],
                   help="how KV moves between workers (default: shm on cpu, cuda-ipc on cuda)")
    g.add_argument(
        "--kv-link-gbps", type=positive_float, default=None, help="tcp: emulate a link of this many Gbit/s (default: unpaced)"
    )
    g.add_argument("--kv-link-latency-ms", type=nonnegative_float, default=0.0, help="tcp: emulate this one-way latency")
    g.add_argument("--kv-transfer-timeout", type=positive_float, default=60.0,
                   help="disagg: seconds from a prompt's first token until its KV is in the decode worker; "
                        "past it the request fails and both sides free its blocks")  # fmt: skip
    g.add_argument("--seat-timeout", type=positive_float, default=300.0,
                   help="disagg: seconds a decode seat waits for its KV before it is given back")
    g.add_argument("--decode-headroom-tokens", type=int, default=512,
                   help="disagg: tokens of a reply's growth booked with its seat, so decoding need not preempt")
    g = s.add_argument_group("workers")
    g.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the workers run")
    g.add_argument("--workers", type=int, default=None,
                   help="number of worker processes (cpu: default 2; cuda: default one per GPU of --gpus, and "
                        "more than the GPUs are spread over them)")
    g.add_argument("--threads-per-worker", type=int, default=None,
                   help="cpu: torch threads in each worker (default: cores / workers)")
    g.add_argument("--gpus", default=None, help="cuda: comma-separated GPU indices, one worker each (default: all)")
    g.add_argument("--worker-timeout", type=positive_float, default=60.0,
                   help="a worker silent this long (no heartbeat: stopped, frozen) or stuck this long outside a "
                        "step is killed and replaced; a long step is not silence (see --step-timeout). A worker "
                        "not ready this long after start writes its threads' stacks to the log")
    g.add_argument("--step-timeout", type=positive_float, default=600.0,
                   help="a single engine step running longer than this is taken for a hang (inside the model) "
                        "and its worker is replaced; a step merely slower than --worker-timeout is fine")
    g.add_argument("--max-worker-restarts", type=int, default=5,
                   help="restarts of one worker within 10 minutes before it is left dead")
    add_engine_args(s.add_argument_group("engine"))
    s.set_defaults(func=run)


def _name_list(text: str) -> list[str]:
    """'a,b' or vLLM's JSON form '["a", "b"]'."""
    import json

    if text.strip().startswith("["):
        try:
            names = json.loads(text)
        except json.JSONDecodeError:
            raise argparse.ArgumentTypeError(f"not a JSON list: {text}") from None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise argparse.ArgumentTypeError(f"not a list of strings: {text}")
        return names
    return [n.strip() for n in text.split(",") if n.strip()]


def worker_configs(args) -> list[dict]:
    base = {"model": args.model, "dtype": args.dtype, "block_size": args.block_size,
            "kv_cache_tokens": args.kv_cache_tokens, "max_num_seqs": args.max_num_seqs,
            "chunk_tokens": args.chunk_tokens, "quantization": args.quantization, "prepack": args.prepack}  # fmt: skip
    if args.workers is not None and args.workers < 1:
        raise UserError("--workers must be >= 1")
    if args.device == "cuda":
        gpus = _gpus(args.gpus)
        if args.workers is not None and args.gpus is not None and args.workers != len(gpus):
            raise UserError(f"--workers {args.workers} and --gpus {args.gpus} disagree: --gpus starts one worker "
                            f"per index (repeat one, as in 0,0, for two workers on a GPU)")  # fmt: skip
        if args.workers is not None:
            gpus = [gpus[i % len(gpus)] for i in range(args.workers)]
        return [{**base, "device": f"cuda:{g}", "threads": 1} for g in gpus]
    workers = 2 if args.workers is None else args.workers
    threads = args.threads_per_worker or max(1, (os.cpu_count() or 1) // workers)
    return [{**base, "device": "cpu", "threads": threads} for _ in range(workers)]


def _gpus(text: str | None) -> list[int]:
    """--gpus as indices of visible GPUs (None: all of them)."""
    visible = _cuda_device_count()
    if not visible:
        raise UserError("--device cuda: no GPU is visible")
    if text is None:
        return list(range(visible))
    try:
        gpus = [int(g) for g in text.split(",")]
    except ValueError:
        raise UserError(f"--gpus takes comma-separated GPU indices, got {text!r}") from None
    for g in gpus:
        if not 0 <= g < visible:
            raise UserError(f"--gpus: GPU {g} is not among the {visible} visible (0..{visible - 1})")
    return gpus


def _cuda_device_count() -> int:
    """Without importing torch here: ask a child process."""
    import subprocess

    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                         capture_output=True, text=True)  # fmt: skip
    return int(out.stdout.strip() or 0)


def preflight(args) -> tuple[list[dict], object]:
    """Everything that can be checked before anything heavy starts. Raises UserError."""
    from minipd.models.files import ModelNotFound, check_exists
    from minipd.server.errors import InvalidRequest
    from minipd.server.modes import Mode

    if args.kv_transport is None:
        args.kv_transport = "cuda-ipc" if args.device == "cuda" else "shm"
    if (args.kv_transport, args.device) in (("shm", "cuda"), ("cuda-ipc", "cpu")):
        raise UserError(f"--kv-transport {args.kv_transport} does not work with --device {args.device}; "
                        "use shm on cpu, cuda-ipc on cuda, or tcp on either")  # fmt: skip
    if (args.rebalance_ratio or 0) < 0 or args.rebalance_interval <= 0:
        raise UserError("--rebalance-ratio must be >= 0 (0: off) and --rebalance-interval > 0")
    if args.quantization == "int8" and args.device != "cpu":
        raise UserError(f"--quantization int8 runs on cpu only (its int8 matmul is untested on --device {args.device})")
    if (args.kv_link_gbps is not None or args.kv_link_latency_ms) and args.kv_transport != "tcp":
        raise UserError("--kv-link-gbps and --kv-link-latency-ms emulate a network link: they need --kv-transport tcp")
    try:
        check_exists(args.model)
    except ModelNotFound as err:
        raise UserError(str(err)) from None
    _check_port(args.host, args.port)
    args.advisor_step_profile = _advisor_profile(args.advisor_profile)
    configs = worker_configs(args)
    mode = Mode("colocated" if args.mode == "auto" else args.mode, args.prefill_workers, args.decode_workers, args.chunk_tokens,
                kv_link_gbps=args.kv_link_gbps, kv_link_latency_ms=args.kv_link_latency_ms,
                local_prefill_tokens=args.local_prefill_tokens)
    try:
        mode.check(len(configs))
    except InvalidRequest as err:
        raise UserError(f"--mode {args.mode}: {err} (--workers {len(configs)})") from None
    return configs, mode


def _advisor_profile(path: str | None):
    if path is None:
        return None
    from minipd.sim.profile import Profile

    try:
        return Profile.load(path)
    except (OSError, ValueError, TypeError, KeyError) as err:
        raise UserError(f"--advisor-profile {path}: {err}") from None


def _check_port(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as err:
            why = (err.strerror or str(err)).lower()
            if err.errno == errno.EADDRINUSE:
                hint = "another server there? pick another port with --port"
            elif err.errno == errno.EACCES:
                hint = "ports below 1024 need privileges: pick another with --port"
            else:
                hint = "--host must be an address of this machine, such as 127.0.0.1 or 0.0.0.0"
            raise UserError(f"cannot listen on {host}:{port}: {why} ({hint})") from None


def check_shared_memory(kv_bytes_per_token: int, args, num_workers: int) -> None:
    if args.kv_transport != "shm":
        return
    need = kv_bytes_per_token * args.kv_cache_tokens * num_workers
    st = os.statvfs("/dev/shm")
    have = st.f_bavail * st.f_frsize
    if need > have:
        raise UserError(f"the shm transport keeps each worker's KV cache in /dev/shm: {need / 2**20:.0f} MiB needed, "
                        f"{have / 2**20:.0f} MiB free; use --kv-transport tcp, a smaller --kv-cache-tokens, or a "
                        f"larger /dev/shm (docker run --shm-size=...)")  # fmt: skip


async def serve(args, configs: list[dict], mode) -> None:
    from minipd.heap import freeze_startup_heap
    from minipd.models.files import model_config, served_name
    from minipd.server.app import Api
    from minipd.server.browser_guard import BrowserGuard
    from minipd.server.http_runner import default_max_connections, raise_open_files_limit
    from minipd.server.metrics import Metrics
    from minipd.server.supervisor import Supervisor
    from minipd.server.worker_pool import WorkerPool
    from minipd.tokenizer import load_tokenizer
    from minipd.workers import messages as m

    mcfg = model_config(args.model, convert_here=False)  # converts a GGUF once, in a child process
    dtype_bytes = 4 if args.dtype == "float32" else 2
    check_shared_memory(mcfg.kv_bytes_per_token(dtype_bytes), args, len(configs))
    if args.device == "cpu":  # once, here, before the workers: none of them builds or waits on a lock
        from minipd.models.kernel_build import build_in_child

        log.info("%s", build_in_child(timeout=240.0))
    tokenizer = load_tokenizer(args.model, convert_here=False)
    max_model_len = min(mcfg.max_position, args.kv_cache_tokens)
    name = served_name(args.model)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        log.warning("minipd: listening on %s without --api-key: anyone on the network can send requests "
                    "and switch modes", args.host)  # fmt: skip
    pool = WorkerPool(configs, args.kv_transport, args.kv_link_gbps, args.kv_link_latency_ms,
                      args.kv_transfer_timeout, args.seat_timeout)  # fmt: skip
    router = build_router(args, pool, tokenizer, Metrics(name, len(configs)), mode)
    supervisor = Supervisor(router, pool, args.worker_timeout, args.max_worker_restarts, step_timeout=args.step_timeout)
    guard = BrowserGuard(args.host, args.allowed_origins, args.allowed_hosts)
    api = Api(router, name, max_model_len, args.default_max_tokens, args.api_key, args.kv_transport, guard)

    from aiohttp import web

    open_files = raise_open_files_limit()
    max_connections = args.max_connections or default_max_connections(open_files)
    if max_connections > open_files - 256:
        log.warning("minipd: --max-connections %d is near the open-files limit (%d): past it, connections fail "
                    "before the limit can close idle ones", max_connections, open_files)  # fmt: skip
    runner = api.runner(access_log=None, handler_cancellation=True, shutdown_timeout=2.0,
                        keepalive_timeout=args.timeout_keep_alive, max_connections=max_connections,
                        send_timeout=args.send_timeout)  # fmt: skip
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = []

    def on_signal():
        signals.append(1)
        if len(signals) > 1:
            log.warning("minipd: second signal: stopping now")
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    tasks = []
    parent = os.environ.get("MINIPD_STOP_WITH_PARENT", "")
    if parent.isdigit():
        tasks.append(loop.create_task(_stop_with_parent(int(parent), lambda: (on_signal(), on_signal()))))

    def route(msg) -> None:
        if isinstance(msg, m.Ready):
            supervisor.on_ready(msg)
        elif isinstance(msg, m.Heartbeat):
            supervisor.on_heartbeat(msg)
        else:
            router.on_message(msg)

    async def start() -> None:
        await runner.setup()
        await web.TCPSite(runner, args.host, args.port).start()
        port = runner.addresses[0][1] if runner.addresses else args.port  # --port 0: the one the system gave
        log.info("minipd: listening on http://%s:%d (health: 503 until the workers are ready)", args.host, port)
        await pool.start(router.on_message, report_after=args.worker_timeout)
        supervisor.watch_all()
        tasks.append(_guard(loop.create_task(_pump(pool, route)), router, "the message pump"))
        tasks.append(_guard(loop.create_task(supervisor.run()), router, "the supervisor"))
        await router.set_mode(mode)
        router.ready = True
        freeze_startup_heap()  # (minipd/heap.py) the relay of every stream: a full collection froze them all
        if args.mode == "auto":
            router.advisor.enable()
        router.rebalancer.start()
        log.info("minipd: serving %s in mode %s%s", name, mode.as_dict(), " (auto: the advisor decides every "
                 f"{args.advisor_window:g} s)" if args.mode == "auto" else "")  # fmt: skip
        for w in pool.workers:
            log.info("  worker %d pid %d on %s, role %s, %d KV blocks of %d tokens, KV at %s", w.worker_id, w.pid,
                     w.device, w.role, w.info.num_blocks, w.info.block_size, w.info.kv_address)  # fmt: skip
        log.info("minipd: ready")

    try:
        starting, stopping = loop.create_task(start()), loop.create_task(stop.wait())
        await asyncio.wait([starting, stopping], return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():  # a signal before the workers were ready: nothing is served yet
            log.info("minipd: stopped while starting")
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            return
        stopping.cancel()
        starting.result()  # a start that failed raises here
        await stop.wait()
        stop.clear()
        if len(signals) < 2 and router.requests:
            log.info("minipd: draining %d requests (up to %g s; a second Ctrl-C stops now)", len(router.requests),
                     args.drain_timeout)  # fmt: skip
            drain = loop.create_task(router.drain(args.drain_timeout))
            second = loop.create_task(stop.wait())
            await asyncio.wait([drain, second], return_when=asyncio.FIRST_COMPLETED)
            drain.cancel()
            second.cancel()
        router.accepting = False
        for state in list(router.requests.values()):
            router.fail(state, "the server is shutting down", status=503, code="shutting_down")
        router.events.close()  # open /admin/events streams end, so the HTTP server can stop at once
    finally:
        log.info("minipd: shutting down")
        supervisor.stop()
        for t in tasks:
            t.cancel()
        await runner.cleanup()
        await pool.stop()


def build_router(args, pool, tokenizer, metrics, mode):
    from minipd.server.router import Limits, Router

    limits = Limits(args.max_waiting, args.max_num_seqs, args.kv_transfer_timeout, args.request_timeout,
                    args.decode_headroom_tokens)  # fmt: skip
    router = Router(pool, tokenizer, metrics, limits, switch_drain_timeout=args.switch_drain_timeout,
                    kv_transport=args.kv_transport, target=mode)  # fmt: skip
    from minipd.server.advisor import AdvisorConfig

    router.advisor.config = AdvisorConfig(window_s=args.advisor_window, slo_ttft_s=args.slo_ttft_ms / 1e3,
                                          slo_tpot_s=args.slo_tpot_ms / 1e3, min_gain=args.advisor_min_gain,
                                          model=args.advisor_model,
                                          profile=getattr(args, "advisor_step_profile", None))  # fmt: skip
    router.rebalancer.chosen_ratio, router.rebalancer.interval_s = args.rebalance_ratio, args.rebalance_interval
    return router


async def _stop_with_parent(parent: int, stop_now) -> None:
    """A server started by a command (bench, demo, plan, a test) stops once that command is gone,
    however it ended (SIGKILL included): nothing else would stop it, in a session of its own."""
    while os.getppid() == parent:
        await asyncio.sleep(0.5)
    log.warning("minipd: the process that started this server (pid %d) is gone: stopping", parent)
    stop_now()


def _guard(task: asyncio.Task, router, what: str) -> asyncio.Task:
    """If a task the server needs ends by an error, /health says so."""

    def done(t: asyncio.Task) -> None:
        if not t.cancelled() and t.exception() is not None:
            router.fault = f"{what} stopped: {t.exception()!r}"
            log.error("minipd: %s", router.fault)

    task.add_done_callback(done)
    return task


async def _pump(pool, route) -> None:
    from minipd.workers.messages import BadMessage

    while True:
        try:
            msg = await pool.receive()
        except BadMessage as err:
            log.warning("ignored a message from a worker: %s", err)
            continue
        try:
            route(msg)
        except Exception:
            log.exception("handling a %s from worker %s failed", type(msg).__name__, getattr(msg, "worker_id", "?"))


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stdout)  # fmt: skip
    try:
        configs, mode = preflight(args)
    except UserError as err:
        log.debug("preflight", exc_info=True)
        print(f"minipd: {err}", file=sys.stderr)
        return 2
    try:
        import uvloop

        run_loop = uvloop.run
    except ImportError:
        run_loop = asyncio.run
    try:
        run_loop(serve(args, configs, mode))
    except UserError as err:
        log.debug("startup", exc_info=True)
        print(f"minipd: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    return 0
