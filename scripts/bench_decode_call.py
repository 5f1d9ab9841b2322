"""Decode steps with every layer in one call (csrc/decode_layers.cpp) against the same steps
through the Python layer loop, side by side in one process: the same model, prompts and tokens,
alternating rounds, the median decode step of each, their ratio, and whether the tokens agree
(they must: the same kernels run in the same order).

    python scripts/bench_decode_call.py --threads 1
"""

from __future__ import annotations

import argparse
import random
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batches", default="1,8", help="decode batch sizes")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    import torch

    from minipd import LLM, SamplingParams
    from minipd.info import cpu_name

    torch.set_num_threads(args.threads)
    llm = LLM(model=args.model, dtype=args.dtype)
    model, runner = llm.engine.runner.model, llm.engine.runner
    rows = model.decode_rows
    if rows == 0:
        raise SystemExit("the one-call decode is not in use here (python -m minipd info says which kernels run)")
    print(f"{cpu_name()}, torch capability {torch.backends.cpu.get_cpu_capability()}, {args.dtype}, "
          f"{args.threads} thread(s), one call up to {rows} rows; median decode step over {args.rounds} rounds")  # fmt: skip
    rng = random.Random(1234)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    run, times = runner.run, []

    def timed(batch):
        t = time.perf_counter()
        out = run(batch)
        times.append((len(batch.seqs), all(n == 1 for n in batch.num_new_tokens), time.perf_counter() - t))
        return out

    runner.run = timed
    try:
        for batch in (int(b) for b in args.batches.split(",")):
            if batch > rows:
                print(f"batch {batch}: more rows than the one call takes here ({rows})")
                continue
            prompts = [[rng.randrange(100, model.config.vocab_size) for _ in range(args.prompt_tokens)]
                       for _ in range(batch)]  # fmt: skip
            steps, tokens = {"one call": [], "layer loop": []}, {}
            for _ in range(args.rounds):
                for name, limit in (("one call", rows), ("layer loop", 0)):
                    model.decode_rows = limit
                    times.clear()
                    tokens[name] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
                    steps[name] += [s for n, decode, s in times if decode and n == batch]
            one, loop = statistics.median(steps["one call"]), statistics.median(steps["layer loop"])
            print(f"batch {batch}: one call {one * 1e3:.1f} ms, layer loop {loop * 1e3:.1f} ms, "
                  f"speed-up {loop / one:.2f}x; same tokens: {'yes' if tokens['one call'] == tokens['layer loop'] else 'NO'}")  # fmt: skip
    finally:
        runner.run = run
        model.decode_rows = rows


if __name__ == "__main__":
    main()
