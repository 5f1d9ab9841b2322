"""KV handoff cost between real worker processes, per transport, against prompt length.

Starts the real server in disagg (1P1D) once per transport, sends prompts of several lengths,
and reads each request's handoff (bytes, seconds) from its timeline. Prints these next to the
memory-copy bandwidth measured here, and for tcp, next to the emulated link's configured rate.

    python scripts/bench_transfer.py --lengths 256 1024 2048 --link-gbps 1 10
"""

from __future__ import annotations

import argparse
import time


def copy_bandwidth(num_bytes: int) -> float:
    """Bytes per second of one plain memory copy (what a handoff at full speed would cost)."""
    import torch

    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return num_bytes / best


def handoffs(server, lengths: list[int], repeats: int) -> dict[int, tuple[int, float]]:
    out = {}
    for n in lengths:
        best = None
        for r in range(repeats):
            prompt = [100 + (i * 7 + r) % 40000 for i in range(n)]
            status, body = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 2, "temperature": 0,
                                                           "ignore_eos": True})  # fmt: skip
            assert status == 200, body
            t = server.get(f"/v1/requests/{body['id']}/timeline")[1]["kv_transfer"]
            if best is None or t["seconds"] < best[1]:
                best = (t["bytes"], t["seconds"])
        out[n] = best
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default=None, help="model (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048], help="prompt lengths in tokens")
    ap.add_argument("--link-gbps", type=float, nargs="+", default=[1.0, 10.0], help="emulated tcp link rates")
    ap.add_argument("--link-latency-ms", type=float, default=1.0, help="emulated one-way latency")
    ap.add_argument("--repeats", type=int, default=2, help="requests per length; the fastest handoff is kept")
    args = ap.parse_args()
    from minipd.bench.server_process import ServerProcess

    common = ["--mode", "disagg", "--workers", "2", "--threads-per-worker", "1", "--kv-cache-tokens",
              str(max(args.lengths) * 2 + 64), "--log-level", "warning"]  # fmt: skip
    if args.model:
        common += ["--model", args.model]
    runs = [("shm", None, [])] + [
        ("tcp", g, ["--kv-link-gbps", str(g), "--kv-link-latency-ms", str(args.link_latency_ms)])
        for g in args.link_gbps
    ]
    results = {}
    for transport, gbps, extra in runs:
        server = ServerProcess(*common, "--kv-transport", transport, *extra)
        try:
            results[(transport, gbps)] = handoffs(server, args.lengths, args.repeats)
        finally:
            server.stop()
    largest = max(b for r in results.values() for b, _ in r.values())
    bw = copy_bandwidth(largest)
    print(f"memory copy bandwidth here: {bw / 1e9:.2f} GB/s (one copy of {largest / 1e6:.0f} MB)")
    print(f"{'transport':<18}{'tokens':>7}{'KV MB':>9}{'handoff ms':>12}{'GB/s':>8}{'vs copy':>9}{'vs link':>9}")
    for (transport, gbps), rows in results.items():
        name = transport if gbps is None else f"tcp @ {gbps:g} Gb/s"
        for n, (num_bytes, seconds) in rows.items():
            rate = num_bytes / seconds
            vs_link = ""
            if gbps:
                wire = seconds - args.link_latency_ms / 1e3
                vs_link = f"{100 * (num_bytes * 8 / wire) / (gbps * 1e9):.0f}%"
            print(f"{name:<18}{n:>7}{num_bytes / 1e6:>9.1f}{seconds * 1e3:>12.2f}{rate / 1e9:>8.2f}"
                  f"{100 * rate / bw:>8.0f}%{vs_link:>9}")  # fmt: skip


if __name__ == "__main__":
    main()
