"""Weight-only int8 (--quantization int8) against float32 on the default model: greedy agreement
on held-out chat prompts (not the ones the tests use), and decode speed at batch 1 and 8, side by
side in one run. About 3 minutes on 2 cores.

    python scripts/bench_int8.py --threads 1
"""

from __future__ import annotations

import argparse

PROMPTS = [
    "Give me three tips for a job interview.", "Why is the sky blue?", "Describe a cat to someone who has never seen one.",
    "What is photosynthesis?", "Suggest a name for a bakery.", "How do airplanes stay in the air?",
    "Write a short poem about autumn.", "What are the benefits of exercise?", "Explain what a computer virus is.",
    "How do I boil an egg?", "What is the difference between weather and climate?", "Tell me a fun fact about octopuses.",
    "What should I pack for a beach trip?", "How does a refrigerator keep food cold?", "What is a black hole?",
    "Name three famous painters.", "Why do we have seasons?", "How can I improve my sleep?",
    "What is the water cycle?", "Summarise the story of Cinderella.",
]  # fmt: skip


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--max-tokens", type=int, default=48, help="greedy tokens per prompt")
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    import time

    import torch

    from minipd import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    llms = {name: LLM(quantization=q, kv_cache_tokens=8192) for name, q in (("float32", None), ("int8", "int8"))}
    outs = {name: [o.token_ids for o in llm.chat(chats, greedy, use_tqdm=False)] for name, llm in llms.items()}
    same = sum(a == b for a, b in zip(outs["float32"], outs["int8"]))
    prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
              for a, b in zip(outs["float32"], outs["int8"])]  # fmt: skip
    print(f"greedy agreement on {len(PROMPTS)} held-out prompts x {args.max_tokens} tokens: {same} identical replies; "
          f"tokens equal before the first difference: median {sorted(prefix)[len(prefix) // 2]}, "
          f"{sum(prefix) / sum(len(a) for a in outs['float32']):.0%} of all")  # fmt: skip
    for a, b, p in list(zip(outs["float32"], outs["int8"], PROMPTS))[:3]:
        tok = llms["float32"].get_tokenizer()
        print(f"  {p}\n    float32: {tok.decode(a)!r}\n    int8:    {tok.decode(b)!r}")

    def decode_rate(llm, batch: int) -> float:
        e = llm.engine
        for i in range(batch):
            e.add_request(f"d{i}", list(range(100 + i, 612 + i)), SamplingParams(max_tokens=args.steps + 4,
                                                                              temperature=0, ignore_eos=True))  # fmt: skip
        while e.scheduler.waiting or any(s.num_output_tokens == 0 for s in e.scheduler.running):
            e.step()
        t = time.perf_counter()
        for _ in range(args.steps):
            e.step()
        rate = batch * args.steps / (time.perf_counter() - t)
        for i in range(batch):
            e.abort_request(f"d{i}")
        return rate

    for batch in (1, 8):
        rates = {name: max(decode_rate(llm, batch) for _ in range(2)) for name, llm in llms.items()}
        print(f"decode b={batch} ctx 512: float32 {rates['float32']:.1f} tok/s, int8 {rates['int8']:.1f} tok/s, "
              f"x{rates['int8'] / rates['float32']:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
