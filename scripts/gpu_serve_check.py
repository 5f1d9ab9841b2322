"""The server on a GPU, checked against the same server on the CPU: two workers on one card in
disagg with the cuda-ipc transport (so the KV crosses processes through CUDA IPC), greedy and
seeded requests, then run-time switches to colocated and chunked. Prints one line per check;
exits 1 if any failed. Used by scripts/gpu_check.sh."""

from __future__ import annotations

import argparse


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", default="0,0", help="GPU index per worker")
    ap.add_argument("--model", default="tiny-random", help="model to serve on both")
    args = ap.parse_args()
    from minipd.bench.server_process import ServerProcess

    prompts = [[5 + i, 9, 300 + i] * (3 + 7 * i) for i in range(4)]
    failed = []

    def check(name: str, ok: bool, detail: str = "") -> None:
        print(f"{'PASS' if ok else 'FAIL'} {name}" + (f": {detail}" if detail and not ok else ""), flush=True)
        if not ok:
            failed.append(name)

    def outputs(server, **kw) -> list[tuple[str, list[int]]]:
        """Each reply's text and token ids (without the default model installed, tiny-random has no
        tokenizer and every text is empty: the ids are what is compared)."""
        replies = []
        for p in prompts:
            status, body = server.post("/v1/completions", {"prompt": p, "max_tokens": 16, "ignore_eos": True,
                                                           "return_token_ids": True, **kw})  # fmt: skip
            if status != 200:
                raise RuntimeError(f"HTTP {status}: {body}")
            replies.append((body["choices"][0]["text"], body["choices"][0]["token_ids"]))
        return replies

    common = ("--model", args.model, "--log-level", "warning")
    cpu = ServerProcess(*common, "--workers", "2", "--threads-per-worker", "1")
    try:
        want_greedy = outputs(cpu, temperature=0)
        want_seeded = outputs(cpu, temperature=0.8, seed=11)
    finally:
        cpu.stop()
    gpu = ServerProcess(*common, "--device", "cuda", "--gpus", args.gpus, "--mode", "disagg", "--kv-transport",
                        "cuda-ipc")  # fmt: skip
    try:
        workers = gpu.get("/admin/workers")[1]
        check("workers on cuda", all(w["device"].startswith("cuda") for w in workers["workers"]), str(workers))
        got = outputs(gpu, temperature=0)
        check("greedy disagg over cuda-ipc == cpu", got == want_greedy, f"{got} != {want_greedy}")
        t = gpu.get("/admin/workers")[1]
        check("kv handed over", all(w["integrity_error"] is None for w in t["workers"]), str(t))
        seeded = outputs(gpu, temperature=0.8, seed=11)
        check("seeded on cuda reproduces", seeded == outputs(gpu, temperature=0.8, seed=11))
        check("seeded on cuda == cpu", seeded == want_seeded, f"{seeded} != {want_seeded} (float rounding?)")
        for mode in ({"mode": "colocated"}, {"mode": "chunked", "chunk_tokens": 8}):
            status, body = gpu.post("/admin/mode", mode)
            check(f"switch to {mode['mode']}", status == 200, str(body))
            check(f"greedy {mode['mode']} == cpu", outputs(gpu, temperature=0) == want_greedy)
    finally:
        code = gpu.stop()
        check("clean shutdown", code == 0 and gpu.leftovers() == ([], []), f"exit {code}, left {gpu.leftovers()}")
    print(f"{len(failed)} failed" if failed else "all passed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
