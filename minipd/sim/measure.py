"""Measuring a profile on real workers: a few loads that cover the step model's terms (prompts of
several lengths read alone, decode batches of several sizes and contexts, prompt chunks beside
decodes, KV handoffs of several sizes, every worker at once and prompts on one worker beside
replies on another), through a running minipd server, with every engine step
read back from GET /admin/events. Nothing here is fitted to the runs a simulation is checked on."""

from __future__ import annotations

import platform
import statistics
import time
from collections import defaultdict

from minipd.bench.client import load_or_interrupt
from minipd.bench.metrics import RequestRecord
from minipd.bench.plan import _steps_since
from minipd.bench.target import Target
from minipd.bench.workloads import BenchRequest
from minipd.sim.profile import Host, Profile, WorkerShape, co_busy, fit_link, fit_steps, loop_gap, quantiles


def _load(target: Target, requests: list[BenchRequest], seed: int, concurrency: int | None = None):
    return load_or_interrupt(target.url, target.model, requests, api_key=target.api_key, seed=seed, progress=False,
                             max_concurrency=concurrency)  # fmt: skip


def measure(target: Target, quick: bool = False, seed: int = 11, say=print) -> Profile:
    """Profile the target's workers (it switches the server's mode; the last one is left set)."""
    if not target.is_minipd:
        raise RuntimeError("a profile is measured on minipd workers (it reads their engine steps)")
    since = time.time()
    records: list[RequestRecord] = []
    alone: list[RequestRecord] = []  # sent with nothing else in flight
    lengths = [16, 128, 512, 1024] if quick else [16, 128, 512, 1024, 2048]
    batches = [1, 2, 4, 8, 16, 32]  # past 16 a server under load runs them; the fit keeps its last slope beyond
    out_len = 24 if quick else 48
    n = iter(range(10**6))

    def load(reqs, concurrency=None):
        got = _load(target, reqs, seed + next(n), concurrency)
        bad = [r.error for r in got if r.error]
        if bad:
            raise RuntimeError(f"a profiling request failed: {bad[0]}")
        records.extend(got)
        if concurrency == 1:
            alone.extend(got)

    say("profile: prompts read alone")
    target.set_mode({"mode": "colocated", "workers": 1})
    load([BenchRequest(0, 32, 4, 0.0)])  # warm
    load([BenchRequest(i, L, 4, 0.0) for i, L in enumerate(lengths)], concurrency=1)
    for k in (3, 4):  # the first read alone, the rest in one step (prefill_first takes every waiting one that fits)
        load([BenchRequest(i, 1024, 2, 0.0) for i in range(k)])
    say("profile: decode batches")
    for b in batches:
        load([BenchRequest(i, 32, out_len, 0.0) for i in range(b)])
    load([BenchRequest(i, min(1024, target.max_model_len // 2), out_len, 0.0) for i in range(8)])
    n_all = target.num_workers

    def every_worker_decodes(part: int) -> None:
        """Decode batches on every worker at once, a third of them at each of three moments of the
        profile: on a VM the slowdown of workers reading memory together comes and goes in spells
        of seconds (docs/validation/README.md), and one moment would take whichever state it met."""
        target.set_mode({"mode": "colocated", "workers": None})
        for b in batches[1 + part :: 3]:
            load([BenchRequest(i, 32, out_len, 0.0) for i in range(b * n_all)])

    if n_all >= 2:  # the same on every worker at once: what a step costs while the others step too
        say("profile: every worker at once")
        target.set_mode({"mode": "colocated", "workers": None})
        load([BenchRequest(i, L, 4, 0.0) for i, L in enumerate(x for x in lengths[1:] for _ in range(n_all))])
        every_worker_decodes(0)
    say("profile: prompt chunks beside decodes")
    target.set_mode({"mode": "chunked", "chunk_tokens": 256, "workers": 1})
    load([BenchRequest(i, 64, 3 * out_len, 0.0) for i in range(6)] +
         [BenchRequest(6 + i, 1024 if not quick else 512, 2, 0.4 * (i + 1)) for i in range(3)])  # fmt: skip
    target.set_mode({"mode": "colocated", "workers": 1})
    load([BenchRequest(i, 64, 3 * out_len, 0.0) for i in range(4)] +
         [BenchRequest(4 + i, 256, 2, 0.3 * (i + 1)) for i in range(3)])  # fmt: skip
    transfers: list[tuple[int, float]] = []
    if n_all >= 2:
        every_worker_decodes(1)
        say("profile: KV handoffs")
        target.set_mode({"mode": "disagg", "prefill_workers": 1, "decode_workers": 1, "kv_link_gbps": None,
                         "local_prefill_tokens": 0})  # fmt: skip
        before = len(records)
        load([BenchRequest(i, L, 4, 0.0) for i, L in enumerate(lengths)], concurrency=1)
        for r in records[before:]:
            kv = (r.server_timeline or {}).get("kv_transfer") or {}
            if kv.get("bytes") and kv.get("seconds"):
                transfers.append((kv["bytes"], kv["seconds"]))
        say("profile: prompts on one worker beside replies on the other")  # what slows what: arithmetic, memory
        load([BenchRequest(i, 64, 16 * out_len, 0.0) for i in range(4)] +
             [BenchRequest(4 + i, L, 2, 0.3 * (i + 1)) for i, L in enumerate(lengths[1:] * 2)])  # fmt: skip
        every_worker_decodes(2)
    time.sleep(0.3)  # the last steps' events reach the log
    steps = _steps_since(target, since)
    return build(target, steps, records, transfers, quick, alone)


def build(target: Target, steps: list[dict], records: list[RequestRecord], transfers: list[tuple[int, float]],
          quick: bool, alone: list[RequestRecord]) -> Profile:  # fmt: skip
    """The profile from what was measured."""
    steps = [s for s in steps if "prefill_attention" in s]
    co_busy(steps)
    cost, quality = fit_steps(steps)
    cost.gap = loop_gap(steps)
    _, workers = target.get("/admin/workers")
    w0 = workers["workers"][0]
    shape = WorkerShape(num_blocks=w0["kv_blocks_total"], block_size=w0.get("kv_block_size") or 16,
                        max_model_len=target.max_model_len, kv_bytes_per_token=w0.get("kv_bytes_per_token") or 0,
                        workers_per_box=target.num_workers)  # fmt: skip
    transport = target.kv_transport or "shm"
    links = {transport: fit_link(transfers, blocks_writer=transport == "shm")} if transfers else {}
    delays = _token_delays(steps, records)
    host = Host(dispatch_s=_median([r.server_timeline["events"]["dispatched"] - r.send_time for r in alone
                                    if r.server_timeline and "dispatched" in r.server_timeline.get("events", {})]),
                token_s=_median(delays), token_quantiles=quantiles(delays) if delays else [])  # fmt: skip
    about = {"model": target.model, "workers": target.num_workers, "kv_transport": transport,
             "machine": _machine(), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "step_fit": quality, "quick": quick}  # fmt: skip
    points = {"steps": [{k: s[k] for k in ("worker", "time", "end", "prefill_tokens", "prefill_attention", "decodes",
                                            "decode_context", "co_busy")} for s in steps],
              "transfers": transfers}  # fmt: skip
    return Profile(cost, shape, links, host, "measured", about, points)


def _token_delays(steps: list[dict], records: list[RequestRecord]) -> list[float]:
    """A step's end -> the client's receipt of the token it made, for requests whose every token
    arrived in a chunk of its own (the i-th step that produced a token for the request made token i)."""
    ends = defaultdict(list)
    for s in steps:
        for key in s["keys"]:
            ends[key.rpartition(".")[0]].append(s["end"])
    out = []
    for r in records:
        rid = (r.server_timeline or {}).get("request_id")
        made = sorted(ends.get(rid, []))
        if rid and len(made) == len(r.token_times):
            out += [t - e for t, e in zip(r.token_times, made)]
    return out


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else 0.0


def _machine() -> dict:
    out = {"processor": platform.processor() or platform.machine(), "python": platform.python_version()}
    try:
        import torch

        out["isa"] = torch.backends.cpu.get_cpu_capability()
        out["torch"] = torch.__version__
    except Exception:  # the profile is still useful without it
        pass
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                out["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return out
