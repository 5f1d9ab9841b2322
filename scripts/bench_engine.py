"""minipd's engine against Hugging Face transformers on the same model, dtype and thread count,
side by side in one run (alternating rounds, best of each, as the machine is noisy); or, with
--against float32, minipd in --dtype against minipd's own float32; or, with --against no-blocks,
minipd against itself without blocked_linear.

Rows: prefill (512 and 2048 tokens) and decode at batch 1, 8 and 32 with contexts of 512 and
2048 tokens, mixed in a batch. Each row prints tokens/s for both, the ratio minipd/HF, and the
hardware floor for this machine, measured in this process with the same threads: decode must
read every weight once per step (the tied embedding counts once, as the LM head) and every
sequence's KV, at the measured read bandwidth; prefill needs 2 FLOPs per weight per token of
the decoder layers (the embedding is a lookup; the LM head runs for the last token only) at the
measured matmul rate (attention's own FLOPs are not counted: a 2,048-token prompt adds a third).
About 5-10 minutes on 2 cores with the default model.

    python scripts/bench_engine.py --threads 1
    python scripts/bench_engine.py --dtype bfloat16 --against float32
    python scripts/bench_engine.py --against no-blocks      # blocked_linear as measured here, against off
"""

from __future__ import annotations

import argparse
import sys


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default=None, help="model (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weights and KV")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument("--threads", type=int, default=1, help="torch threads, the same for both")
    ap.add_argument("--steps", type=int, default=8, help="decode steps timed per row")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds; each side keeps its best")
    ap.add_argument("--batches", default="1,8,32", help="decode batch sizes")
    ap.add_argument("--contexts", default="512,2048",
                    help="decode rows: 512 (every sequence at 512) and/or 2048 (contexts 512-2048 mixed)")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="batches 1 and 8, one round")
    ap.add_argument("--against", default="transformers", choices=["transformers", "float32", "no-blocks"],
                    help="the other side: transformers in --dtype, minipd itself in float32, or minipd in --dtype "
                    "without blocked_linear (MINIPD_BLOCKED_LINEAR=0's paths)")  # fmt: skip
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    import functools
    import random
    import time

    import torch

    from minipd.config import EngineConfig
    from minipd.engine.engine import Engine
    from minipd.models.files import resolve
    from minipd.models.loader import load_model
    from minipd.sampling_params import SamplingParams

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    dev = torch.device(args.device)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    batches = [1, 8] if args.quick else [int(b) for b in args.batches.split(",")]
    rounds = 1 if args.quick else args.rounds

    def best_of(fn, repeats: int) -> float:
        times = []
        for _ in range(repeats):
            sync()
            t = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t)
        return min(times)

    def read_bandwidth() -> float:
        """Bytes per second read by a reduction over 512 MB (a read stream, no writes)."""
        x = torch.ones(128 * 2**20, dtype=torch.float32, device=dev)
        return x.numel() * 4 / best_of(lambda: x.sum(), 5)

    def matmul_rate() -> float:
        """The fastest of the BLAS torch uses (MKL on CPU) and oneDNN with plain or prepacked
        weights, on a prefill-shaped product; for bfloat16 on a CPU, float32's as well (where the
        CPU has no bfloat16 instructions, minipd widens the weights and runs float32's product)."""
        a, w = torch.randn(2048, 576, dtype=dtype, device=dev), torch.randn(1536, 576, dtype=dtype, device=dev)
        fns = [lambda: a @ w.t()]
        if dev.type == "cpu" and dtype != torch.float32:
            a32, w32 = a.float(), w.float()
            fns.append(lambda: a32 @ w32.t())
        if dev.type == "cpu" and torch.backends.mkldnn.is_available():
            try:  # oneDNN takes bfloat16 only where the CPU converts it (AVX-512 or AVX-NE-CONVERT)
                packed = torch.ops.mkldnn._reorder_linear_weight(w, 2048)
                fns.append(lambda: torch.ops.mkldnn._linear_pointwise(a, w, None, "none", [], ""))
                fns.append(lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""))
            except RuntimeError:
                pass
        return max(2 * 2048 * 576 * 1536 / best_of(fn, 5) for fn in fns)

    from transformers import AutoModelForCausalLM, DynamicCache

    model = load_model(args.model, dtype, args.device)
    if args.against == "transformers":
        hf = AutoModelForCausalLM.from_pretrained(resolve(args.model), dtype=dtype).to(dev).eval()
    other = {"transformers": "HF", "float32": "f32", "no-blocks": "no-blk"}[args.against]
    cfg = model.config
    layer_params = sum(p.numel() for n, p in model.named_parameters() if n.startswith("layers."))
    all_params = sum(p.numel() for p in model.parameters())  # tied embedding counted once
    esize = torch.empty((), dtype=dtype).element_size()
    kv_per_token = cfg.kv_bytes_per_token(esize)
    bw, rate = read_bandwidth(), matmul_rate()
    print(f"model {args.model or 'SmolLM2-135M-Instruct'}  {args.dtype}  {args.device}  threads {args.threads}  "
          f"weights {all_params * esize / 1e6:.0f} MB  KV {kv_per_token / 1e3:.1f} kB/token")  # fmt: skip
    print(f"measured here: read bandwidth {bw / 1e9:.1f} GB/s, matmul {rate / 1e9:.0f} GFLOP/s")
    if args.against == "no-blocks":
        from minipd.models import cpu_kernels

        rows = cpu_kernels.blocked_linear_rows()
        print(f"blocked_linear here: {'every product' if rows == sys.maxsize else f'up to {rows} rows' if rows else 'off'}")
    print(f"{'what':<34}{'minipd':>10}{other:>10}{'ratio':>8}{'floor':>10}{'of floor':>10}")

    def row(name: str, m: float, h: float, floor: float) -> None:
        print(f"{name:<34}{m:>10.1f}{h:>10.1f}{m / h:>8.2f}{floor:>10.1f}{100 * m / floor:>9.0f}%", flush=True)

    def alternate(a, b):
        ra, rb = [], []
        for _ in range(rounds):
            ra.append(a())
            rb.append(b())
        return max(ra), max(rb)

    def make_engine(model, dtype_name: str) -> Engine:
        return Engine(EngineConfig(model=args.model, dtype=dtype_name, device=args.device,
                                   kv_cache_tokens=max(batches) * 2064 + 64,
                                   max_num_seqs=max(batches), max_num_batched_tokens=4096), model=model)  # fmt: skip

    engine = make_engine(model, args.dtype)

    def minipd_prefill(n: int, engine=engine) -> float:
        def run():
            engine.add_request("p", list(range(100, 100 + n)), SamplingParams(max_tokens=1, temperature=0))
            engine.step()
            assert not engine.has_unfinished()

        run()
        return n / best_of(run, 2)

    def hf_prefill(n: int) -> float:
        x = torch.arange(100, 100 + n, device=dev)[None]
        run = lambda: hf(x, logits_to_keep=1, use_cache=True)  # noqa: E731
        run()
        return n / best_of(run, 2)

    def contexts(batch: int, longest: int) -> list[int]:
        rng = random.Random(batch * longest)
        return [longest] + [rng.randint(512, longest) for _ in range(batch - 1)] if longest > 512 else [512] * batch

    def minipd_decode(ctx: list[int], engine=engine) -> float:
        for i, n in enumerate(ctx):
            engine.add_request(f"d{i}", [100 + (i + j) % 40000 for j in range(n)],
                               SamplingParams(max_tokens=args.steps + 4, temperature=0, ignore_eos=True))  # fmt: skip
        while engine.scheduler.waiting or any(s.num_output_tokens == 0 for s in engine.scheduler.running):
            engine.step()
        engine.step()  # one decode step untimed: a GPU's first step of a shape loads its kernels
        sync()
        t = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        sync()
        elapsed = time.perf_counter() - t
        for i in range(len(ctx)):
            engine.abort_request(f"d{i}")
        return len(ctx) * args.steps / elapsed

    def hf_decode(ctx: list[int]) -> float:
        longest = max(ctx)
        x = torch.zeros(len(ctx), longest, dtype=torch.long)
        mask = torch.zeros_like(x)
        for i, n in enumerate(ctx):  # left padding, as HF batches mixed lengths
            x[i, longest - n :] = torch.tensor([100 + (i + j) % 40000 for j in range(n)])
            mask[i, longest - n :] = 1
        x, mask = x.to(dev), mask.to(dev)
        cache = DynamicCache()
        out = hf(x, attention_mask=mask, past_key_values=cache, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)

        def step(mask, nxt):
            mask = torch.cat([mask, torch.ones(len(ctx), 1, dtype=mask.dtype, device=dev)], dim=1)
            out = hf(nxt, attention_mask=mask, past_key_values=cache, use_cache=True)
            return mask, out.logits[:, -1].argmax(-1, keepdim=True)

        mask, nxt = step(mask, nxt)  # untimed, as minipd's
        sync()
        t = time.perf_counter()
        for _ in range(args.steps):
            mask, nxt = step(mask, nxt)
        sync()
        return len(ctx) * args.steps / (time.perf_counter() - t)

    other_prefill, other_decode = hf_prefill, hf_decode
    if args.against == "float32":
        engine32 = make_engine(load_model(args.model, torch.float32, args.device), "float32")
        other_prefill = functools.partial(minipd_prefill, engine=engine32)
        other_decode = functools.partial(minipd_decode, engine=engine32)
    if args.against == "no-blocks":
        measured_rows = cpu_kernels.blocked_linear_rows
        cpu_kernels.blocked_linear_rows = lambda: 0  # for the other engine's model alone (set as it is made)
        try:
            engine_nb = make_engine(load_model(args.model, dtype, args.device), args.dtype)
        finally:
            cpu_kernels.blocked_linear_rows = measured_rows
        other_prefill = functools.partial(minipd_prefill, engine=engine_nb)
        other_decode = functools.partial(minipd_decode, engine=engine_nb)

    with torch.inference_mode():
        for n in (512, 2048):
            m, h = alternate(lambda: minipd_prefill(n), lambda: other_prefill(n))
            row(f"prefill {n} tok/s", m, h, rate / (2 * layer_params))
        for b in batches:
            for longest in [int(c) for c in args.contexts.split(",")]:
                ctx = contexts(b, longest)
                m, h = alternate(lambda: minipd_decode(ctx), lambda: other_decode(ctx))
                step_bytes = all_params * esize + sum(ctx) * kv_per_token
                what = f"decode b={b} ctx {min(ctx)}-{max(ctx)} tok/s"
                row(what, m, h, b * bw / step_bytes)


if __name__ == "__main__":
    main()
