"""Starts `python -m minipd serve` as a real subprocess (for tests and benchmarks) and makes sure it all ends."""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body: dict | bytes | None = None, timeout: float = 120,
         api_key: str | None = None) -> tuple[int, dict | str]:  # fmt: skip
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read()
    try:
        return status, json.loads(raw)
    except json.JSONDecodeError:
        return status, raw.decode()


class ServerProcess:
    log_dir: str | None = None  # where server logs go (tests point it at pytest's tmp_path)

    def __init__(self, *args: str, ready_timeout: float = 240, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "minipd", "serve", "--port", str(self.port), *args]
        log_dir = self.log_dir or tempfile.mkdtemp(prefix="minipd-server-")
        self.log = open(os.path.join(log_dir, f"server-{self.port}.log"), "w+")
        env = {**os.environ, **(env or {}), "MINIPD_STOP_WITH_PARENT": str(os.getpid())}
        self.api_key = args[args.index("--api-key") + 1] if "--api-key" in args else env.get("MINIPD_API_KEY")
        # a session of its own: a test can signal its whole process group, as a terminal's Ctrl-C does;
        # MINIPD_STOP_WITH_PARENT: it stops itself once this process is gone, however it ended
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            self._wait_ready(ready_timeout)
            self.worker_pids = [w["pid"] for w in self.get("/admin/workers")[1]["workers"]]
        except BaseException:
            self.stop()  # nothing it started may outlive a failed start
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.output()}")
            try:
                if http("GET", self.url + "/health", timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"server not ready in time:\n{self.output()}")

    def worker_pid(self, role: str | int) -> int:
        """The pid of worker `role` (an id, or the first worker with that role) right now."""
        workers = self.get("/admin/workers")[1]["workers"]
        return next(w["pid"] for w in workers if w["id"] == role or w["role"] == role)

    def get(self, path: str):
        return http("GET", self.url + path, api_key=self.api_key)

    def post(self, path: str, body):
        return http("POST", self.url + path, body, api_key=self.api_key)

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def children_seen(self) -> list[int]:
        """Every worker process this server has had (restarted ones included), as far as seen."""
        seen = set(getattr(self, "worker_pids", []))
        if self.proc.poll() is None:
            try:
                seen.update(w["pid"] for w in self.get("/admin/workers")[1]["workers"] if w["pid"])
            except (OSError, KeyError, TypeError):
                pass
            self.worker_pids = sorted(seen)
        return sorted(seen)

    def stop(self, sig=signal.SIGTERM, timeout: float = 30) -> int:
        self.children_seen()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def leftovers(self) -> tuple[list[int], list[str]]:
        """Worker processes still alive and shared-memory segments still present after stop()."""
        alive = []
        for pid in self.children_seen():
            try:
                os.kill(pid, 0)
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().split()[2] != "Z":
                        alive.append(pid)
            except (ProcessLookupError, FileNotFoundError):
                pass
        return alive, glob.glob(f"/dev/shm/minipd_{self.proc.pid}-*")
