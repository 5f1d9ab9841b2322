"""python -m minipd: serve, generate, and the tools around them."""

from __future__ import annotations

import argparse
import sys

from minipd.cli_help import DefaultsFormatter, nonnegative_float, nonnegative_int, positive_int


def add_engine_args(p) -> None:
    p.add_argument("--model", default=None,
                   help="a .gguf file, a Hugging Face folder or tiny-random (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="weights and KV")
    p.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block")
    p.add_argument("--kv-cache-tokens", type=positive_int, default=16384, help="KV cache size per worker, in tokens")
    p.add_argument("--max-num-seqs", type=positive_int, default=64, help="requests a worker runs at once")
    p.add_argument(
        "--quantization",
        default=None,
        choices=["int8"],
        help="cpu: weight-only int8 linears with bfloat16 activations; off, the weights stay float32, token-exact "
        "with HF (default: off)",
    )
    p.add_argument("--prepack", default=True, action=argparse.BooleanOptionalAction,
                   help="cpu: also keep the layers' weights in a faster layout, a second copy in memory "
                        "(AVX-512: minipd's column blocks for every float32 product, and bfloat16 with AVX512-BF16, "
                        "the LM head too; elsewhere, float32: oneDNN's blocked layout, 5-14%% faster prefill)")


def cmd_generate(args) -> int:
    from minipd import LLM, SamplingParams

    try:
        llm = LLM(model=args.model, dtype=args.dtype, block_size=args.block_size, kv_cache_tokens=args.kv_cache_tokens,
                  quantization=args.quantization, prepack=args.prepack)  # fmt: skip
    except ValueError as err:  # settings that cannot work together (a KV cache smaller than one block)
        print(f"python -m minipd generate: error: {err}", file=sys.stderr)
        return 2
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    if args.raw:
        out = llm.generate(args.prompt, params, use_tqdm=False)[0]
    else:
        out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)[0]
    print(out.text)
    if out.finish_reason == "length" and len(out.token_ids) < args.max_tokens:
        print(f"(stopped at the end of the model's context: {len(out.prompt_token_ids)} prompt and "
              f"{len(out.token_ids)} reply tokens, fewer than --max-tokens {args.max_tokens})", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from importlib.metadata import PackageNotFoundError, version

    parser = argparse.ArgumentParser(prog="python -m minipd", description=__doc__.splitlines()[0])
    try:
        installed = version("minipd")
    except PackageNotFoundError:  # a source tree on PYTHONPATH, never pip-installed
        installed = "(source tree, not installed)"
    parser.add_argument("--version", action="version", version=f"minipd {installed}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="answer one prompt offline and exit",
                         formatter_class=DefaultsFormatter)  # fmt: skip
    gen.add_argument("prompt", help="the user's message (or, with --raw, the text to continue)")
    gen.add_argument("--max-tokens", type=positive_int, default=64, help="tokens to generate at most")
    gen.add_argument("--temperature", type=nonnegative_float, default=0.0, help="0 = greedy")
    gen.add_argument("--seed", type=nonnegative_int, default=None, help="seed for sampling at temperature > 0 (default: random)")
    gen.add_argument("--raw", action="store_true", help="complete the text as is, without the chat template")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)
    from minipd.server.cli import add_serve_parser

    add_serve_parser(sub, add_engine_args)
    from minipd.trace.cli import add_trace_parser

    add_trace_parser(sub)
    tools = {"demo": "the interference stall, live, in each mode",
             "bench": "the same traffic through each mode: goodput, link study, planner",
             "plan": "profile the workers and recommend a P:D split",
             "profile": "measure the workers' step, transfer and host times into a profile JSON",
             "sim": "bench's experiments on a simulated server (minipd's own scheduler, a profile's times)",
             "info": "the CPU, its instruction sets, which kernels and paths run here, threads, versions"}  # fmt: skip
    for name, text in tools.items():
        sub.add_parser(name, help=f"{text} (see its --help)", add_help=False)
    return parser


TOOLS = {"demo": "minipd.demo.main", "bench": "minipd.bench.main", "plan": "minipd.bench.plan_main",
         "profile": "minipd.sim.profile_main", "sim": "minipd.sim.main", "info": "minipd.info"}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] in TOOLS:
        import importlib

        return importlib.import_module(TOOLS[argv[0]]).run(argv[1:])
    args = parser.parse_args(argv)
    from minipd.models.files import ModelNotFound

    try:
        return args.func(args)
    except ModelNotFound as err:
        print(f"minipd: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
