"""The same prompt tokens read in one step as one long prompt or as many short ones, on minipd's
engine (default model, float32, one thread, as a worker runs), each against a profile's step model
when one is given: what a prompt token costs in a large step told from what its attention costs.
Best of three alternating rounds per shape; about 6 minutes on 2 cores.

    python scripts/bench_prompt_shapes.py [--profile profile.json]
"""

from __future__ import annotations

import argparse
import random
import time

SHAPES = [(1, 4096), (4, 1024), (8, 512), (16, 256), (32, 128), (1, 1024), (4, 256), (16, 64), (1, 6144), (6, 1024),
          (12, 512), (24, 256)]  # (prompts, tokens each)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default=None, help="a profile whose step model each shape is compared with")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    import torch

    from minipd.config import EngineConfig
    from minipd.engine.engine import Engine
    from minipd.models.loader import load_model
    from minipd.sampling_params import SamplingParams
    from minipd.sim.profile import Profile

    torch.set_num_threads(1)
    engine = Engine(EngineConfig(model=None, dtype="float32", device="cpu", kv_cache_tokens=9000, max_num_seqs=64,
                                 max_num_batched_tokens=8192), model=load_model(None, torch.float32, "cpu"))  # fmt: skip
    step = Profile.load(args.profile).step if args.profile else None
    rng = random.Random(0)

    def one_step(n: int, length: int) -> float:
        for i in range(n):
            engine.add_request(f"r{i}", [rng.randrange(100, 40000) for _ in range(length)],
                               SamplingParams(max_tokens=1, temperature=0))  # fmt: skip
        start = time.perf_counter()
        engine.step()
        took = time.perf_counter() - start
        assert not engine.has_unfinished(), "the prompts took more than one step"
        return took

    one_step(1, 64)
    best = {shape: float("inf") for shape in SHAPES}
    for _ in range(args.rounds):
        for shape in SHAPES:
            best[shape] = min(best[shape], one_step(*shape))
    print(f"cpu isa {torch.backends.cpu.get_cpu_capability()}, float32, 1 thread")
    for (n, length), took in best.items():
        tokens, pairs = n * length, n * length * (length + 1) // 2
        line = f"{n:3d} prompts of {length:5d} tokens ({tokens:5d}): {took:7.3f} s, {took / tokens * 1e3:.3f} ms a token"
        if step:
            modelled = step.seconds(tokens, pairs, 0, 0)
            line += f"; step model {modelled:7.3f} s, measured / modelled {took / modelled:.3f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
