"""Greedy bfloat16 output of minipd against transformers' bfloat16 on the default model, on
held-out chat prompts (bench_int8's, not the ones the tests use). Two bfloat16 implementations
cannot agree token for token: they round different sums (minipd sums in float32 and rounds each
product once; transformers' operators round after each one), and a near-tie between two tokens
goes either way, after which the replies differ. So it prints, per pair, how many replies are
identical and how many tokens agree before the first difference; and float32 (minipd against
transformers, which must be identical) as the control. About 5 minutes on 2 cores.

    python scripts/bench_bf16_agreement.py --threads 1
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from bench_int8 import PROMPTS  # noqa: E402


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--max-tokens", type=int, default=48, help="greedy tokens per prompt")
    return ap.parse_args()


def agreement(a: list[list[int]], b: list[list[int]]) -> str:
    same = sum(x == y for x, y in zip(a, b))
    prefix = [next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y))) for x, y in zip(a, b)]
    return (f"{same}/{len(a)} identical replies; tokens equal before the first difference: median "
            f"{sorted(prefix)[len(prefix) // 2]}, {sum(prefix) / sum(len(x) for x in a):.0%} of all")  # fmt: skip


def main() -> None:
    args = parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    from minipd import LLM, SamplingParams
    from minipd.info import describe
    from minipd.models.files import resolve

    torch.set_num_threads(args.threads)
    info = describe()
    print(f"cpu {info['cpu']['name']}, isa {info['cpu']['isa']}, bfloat16 instructions: "
          f"{', '.join(info['cpu']['bfloat16_instructions']) or 'none'}; threads {args.threads}")  # fmt: skip
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    outs = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(dtype=dtype, kv_cache_tokens=8192)
        prompts = [llm.apply_chat_template(c) for c in chats]
        eos = llm.get_tokenizer().eos_token_id
        outs[f"minipd {dtype}"] = [[t for t in o.token_ids if t != eos] for o in llm.generate(prompts, greedy, use_tqdm=False)]
        hf = AutoModelForCausalLM.from_pretrained(resolve(None), dtype=getattr(torch, dtype)).eval()
        replies = []
        with torch.inference_mode():
            for p in prompts:
                out = hf.generate(torch.tensor([p]), max_new_tokens=args.max_tokens, do_sample=False,
                                  eos_token_id=eos, pad_token_id=eos)[0, len(p):].tolist()  # fmt: skip
                replies.append([t for t in out if t != eos])
        outs[f"transformers {dtype}"] = replies
        del llm, hf
    for a, b in (("minipd float32", "transformers float32"), ("minipd bfloat16", "transformers bfloat16"),
                 ("transformers bfloat16", "transformers float32"), ("minipd bfloat16", "minipd float32")):  # fmt: skip
        print(f"{a} vs {b}: {agreement(outs[a], outs[b])}")


if __name__ == "__main__":
    main()
