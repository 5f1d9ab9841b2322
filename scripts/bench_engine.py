"""minipd vs Hugging Face transformers on the same model, dtype and thread count, in one run.

Prints prefill tokens/s (512, 2048 tokens) and decode tokens/s (batch 1, 8, 32), each with the
ratio minipd/HF and the hardware floor (decode: weight bytes / measured memory bandwidth;
prefill: FLOPs / measured matmul rate).

    python scripts/bench_engine.py --dtype float32 --threads 1
"""

from __future__ import annotations

import argparse
import time

import torch

from minipd.config import EngineConfig
from minipd.engine.engine import Engine
from minipd.models.loader import load_model, resolve
from minipd.sampling_params import SamplingParams


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def memory_bandwidth() -> float:
    """Bytes per second moved (read + write) by a large copy."""
    src = torch.empty(64 * 2**20, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    t = best_of(lambda: dst.copy_(src), 5)
    return 2 * src.numel() * 4 / t


def matmul_rate(dtype) -> float:
    a = torch.randn(2048, 2048, dtype=dtype)
    b = torch.randn(2048, 2048, dtype=dtype)
    t = best_of(lambda: a @ b, 3)
    return 2 * 2048**3 / t


def minipd_prefill(engine: Engine, n: int) -> float:
    def run():
        engine.add_request("p", list(range(100, 100 + n)), SamplingParams(max_tokens=1, temperature=0))
        engine.step()
        assert not engine.has_unfinished()
    run()
    return n / best_of(run, 2)


def hf_prefill(hf, n: int) -> float:
    x = torch.arange(100, 100 + n)[None]
    run = lambda: hf(x, logits_to_keep=1, use_cache=True)  # noqa: E731
    run()
    return n / best_of(run, 2)


def minipd_decode(engine: Engine, batch: int, ctx: int, steps: int) -> float:
    for i in range(batch):
        engine.add_request(f"d{i}", list(range(100 + i, 100 + i + ctx)),
                           SamplingParams(max_tokens=steps + 3, temperature=0, ignore_eos=True))  # fmt: skip
    while engine.scheduler.waiting or any(s.num_output_tokens == 0 for s in engine.scheduler.running):
        engine.step()
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - t
    for i in range(batch):
        engine.abort_request(f"d{i}")
    return batch * steps / elapsed


def hf_decode(hf, batch: int, ctx: int, steps: int) -> float:
    from transformers import DynamicCache

    x = torch.stack([torch.arange(100 + i, 100 + i + ctx) for i in range(batch)])
    cache = DynamicCache()
    out = hf(x, past_key_values=cache, use_cache=True, logits_to_keep=1)
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    t = time.perf_counter()
    for _ in range(steps):
        out = hf(nxt, past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    return batch * steps / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=128, help="prompt length before the decode steps")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)

    from transformers import AutoModelForCausalLM

    model = load_model(args.model, dtype, "cpu")
    hf = AutoModelForCausalLM.from_pretrained(resolve(args.model), dtype=dtype).eval()
    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype, kv_cache_tokens=32 * 512), model=model)
    params = sum(p.numel() for p in model.parameters())
    weight_bytes = params * model.embed_tokens.weight.element_size()
    bw, rate = memory_bandwidth(), matmul_rate(dtype)
    print(f"model {args.model or 'SmolLM2-135M-Instruct'}  dtype {args.dtype}  threads {args.threads}  "
          f"params {params / 1e6:.1f}M  weights {weight_bytes / 1e6:.0f} MB")  # fmt: skip
    print(f"measured: copy bandwidth {bw / 1e9:.1f} GB/s (read+write), matmul {rate / 1e9:.0f} GFLOP/s")
    print(f"{'what':<22}{'minipd':>12}{'HF':>12}{'ratio':>8}{'floor':>12}{'% of floor':>12}")
    def alternate(a, b, rounds=args.rounds):
        """Run the two side by side, alternating, and keep each one's best (the machine is noisy)."""
        ra, rb = [], []
        for _ in range(rounds):
            ra.append(a())
            rb.append(b())
        return max(ra), max(rb)

    with torch.inference_mode():
        for n in (512, 2048):
            m, h = alternate(lambda: minipd_prefill(engine, n), lambda: hf_prefill(hf, n))
            floor = rate / (2 * params)  # tokens/s if every matmul ran at peak; attention ignored
            print(f"{'prefill ' + str(n) + ' tok/s':<22}{m:>12.0f}{h:>12.0f}{m / h:>8.2f}{floor:>12.0f}{100 * m / floor:>11.0f}%")
        for b in (1, 8, 32):
            m, h = alternate(lambda: minipd_decode(engine, b, args.ctx, args.steps),
                             lambda: hf_decode(hf, b, args.ctx, args.steps))
            floor = b * bw / weight_bytes  # one full read of the weights per step
            print(f"{'decode b=' + str(b) + ' tok/s':<22}{m:>12.1f}{h:>12.1f}{m / h:>8.2f}{floor:>12.1f}{100 * m / floor:>11.0f}%")


if __name__ == "__main__":
    main()
