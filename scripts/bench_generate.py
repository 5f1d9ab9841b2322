"""One prompt end to end: minipd's `LLM.generate` against transformers' `generate` on the same
model, dtype and threads, side by side in one run (alternating rounds, best of each, as the
machine is noisy). Greedy, a prompt of random token ids (held out: drawn from --seed), and every
new token made (ignore_eos / min_new_tokens).

Prints each side's wall time and new tokens per second, the ratio, whether the tokens agree, and
where minipd's time goes: its prefill step, its decode steps (inside them: the model runner), and
what lies outside the engine's steps. `python -m minipd info` says which kernels ran.

    python scripts/bench_generate.py --threads 1
"""

from __future__ import annotations

import argparse


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default=None, help="model (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weights and KV")
    ap.add_argument("--threads", type=int, default=1, help="torch threads, the same for both")
    ap.add_argument("--prompt-tokens", type=int, default=512, help="tokens in the prompt")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens to generate")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds; each side keeps its best")
    ap.add_argument("--seed", type=int, default=1234, help="draws the prompt's token ids")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    import random
    import time

    import torch
    from transformers import AutoModelForCausalLM

    from minipd import LLM, SamplingParams
    from minipd.info import describe
    from minipd.models.files import resolve

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    llm = LLM(model=args.model, dtype=args.dtype)
    hf = AutoModelForCausalLM.from_pretrained(resolve(args.model), dtype=dtype).eval()
    vocab = hf.config.vocab_size
    rng = random.Random(args.seed)
    prompt = [rng.randrange(100, vocab) for _ in range(args.prompt_tokens)]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    engine = llm.engine
    steps: list[float] = []
    runs: list[float] = []

    def timed(fn, into: list[float]):
        def wrapped(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            into.append(time.perf_counter() - t)
            return out

        return wrapped

    engine.step = timed(engine.step, steps)
    engine.runner.run = timed(engine.runner.run, runs)

    def minipd_once() -> tuple[float, list[int], list[float], list[float]]:
        steps.clear()
        runs.clear()
        t = time.perf_counter()
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        return time.perf_counter() - t, out.token_ids, list(steps), list(runs)

    x = torch.tensor([prompt])

    @torch.inference_mode()
    def hf_once() -> tuple[float, list[int], float]:
        t = time.perf_counter()
        hf(x, logits_to_keep=1, use_cache=True)
        prefill = time.perf_counter() - t
        t = time.perf_counter()
        out = hf.generate(x, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                          attention_mask=torch.ones_like(x), pad_token_id=hf.config.eos_token_id)  # fmt: skip
        return time.perf_counter() - t, out[0, len(prompt):].tolist(), prefill

    minipd_once(), hf_once()  # warm up: kernels, oneDNN's primitives, allocator
    mine, theirs = [], []
    for _ in range(args.rounds):
        mine.append(minipd_once())
        theirs.append(hf_once())
    m = min(mine, key=lambda r: r[0])
    h = min(theirs, key=lambda r: r[0])
    info = describe(llm.engine.runner.model.config.head_dim)
    cpu = info["cpu"]
    print(f"one prompt end to end: {args.prompt_tokens} prompt tokens, {args.new_tokens} new, greedy, {args.dtype}, "
          f"threads {args.threads}; {cpu['name']}, {cpu['isa']} (torch: {cpu['torch_capability']}), minipd kernels "
          f"{info['kernels']['isa'] or 'off'}; best of {args.rounds} rounds each")  # fmt: skip
    new = args.new_tokens
    print(f"{'':<28}{'minipd':>10}{'HF':>10}{'ratio':>8}")
    print(f"{'wall time (s)':<28}{m[0]:>10.3f}{h[0]:>10.3f}{h[0] / m[0]:>8.2f}")
    print(f"{'new tokens / s':<28}{new / m[0]:>10.1f}{new / h[0]:>10.1f}{h[0] / m[0]:>8.2f}")
    prefill_m, decode_m = m[2][0], sum(m[2][1:])
    decode_h = h[0] - h[2]
    print(f"{'prefill (s)':<28}{prefill_m:>10.3f}{h[2]:>10.3f}{h[2] / prefill_m:>8.2f}")
    print(f"{'decode, per token (ms)':<28}{1e3 * decode_m / max(1, len(m[2]) - 1):>10.2f}"
          f"{1e3 * decode_h / max(1, new - 1):>10.2f}{(decode_h / max(1, new - 1)) / (decode_m / max(1, len(m[2]) - 1)):>8.2f}")  # fmt: skip
    outside = m[0] - sum(m[2])
    in_steps = sum(m[2]) - sum(m[3])
    print(f"minipd's time: {len(m[2])} engine steps {sum(m[2]):.3f} s (model runner {sum(m[3]):.3f} s, the rest of "
          f"the steps {in_steps * 1e3:.1f} ms), outside the steps {outside * 1e3:.1f} ms")  # fmt: skip
    same = m[1] == h[1]
    agree = next((i for i, (a, b) in enumerate(zip(m[1], h[1])) if a != b), min(len(m[1]), len(h[1])))
    print(f"tokens equal to transformers': {'yes' if same else f'no, the first {agree} of {new}'}")


if __name__ == "__main__":
    main()
