"""`python -m minipd info`: the CPU, the instruction sets minipd's kernels were built for, which
path each part of a step takes per dtype, the threads, and the torch, oneDNN and MKL versions, so
that a user can tell why their figures differ from the README's."""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
from pathlib import Path

from minipd.cli_help import DefaultsFormatter, positive_int


def _prefill_linears(onednn: bool, onednn_max_rows: int) -> str:
    if not onednn:
        return "PyTorch (MKL)"
    if onednn_max_rows == sys.maxsize:
        return "oneDNN, prepacked weights"
    return f"oneDNN, prepacked weights, up to {onednn_max_rows} rows; then PyTorch (MKL)"


def _unpacked_prefill(onednn_max_rows: int) -> str:
    return "oneDNN" if onednn_max_rows == sys.maxsize else f"oneDNN to {onednn_max_rows} rows, then MKL"


def _blocked_source(isa: str | None, in_use: bool) -> str:
    """Why blocked_linear runs here or not: forced, known for the ISA, or measured on this CPU."""
    from minipd.models import blocked_choice, cpu_kernels, kernel_build

    state = "on" if in_use else "off"
    if forced := os.environ.get(kernel_build.BLOCKED_ENV, "").strip():
        return f"{state} ({kernel_build.BLOCKED_ENV}={forced})"
    if isa in cpu_kernels.BLOCKED_ISAS:
        return f"{state} (known for {isa})"
    if isa in kernel_build.MEASURED_BLOCKED_ISAS and cpu_kernels.small_linear_available():
        return blocked_choice.summary(blocked_choice.cached())
    return f"{state} (needs vector kernels)"


def cpu_name() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    for key in ("model name", "Hardware", "Model"):
        if m := re.search(rf"^{key}\s*:\s*(.+)$", text, re.M):
            return m.group(1).strip()
    return platform.machine()


def onednn_version(config: str) -> str | None:
    m = re.search(r"(?:MKL-DNN|oneDNN) v([\d.]+)", config)
    return m.group(1) if m else None


def describe(head_dim: int = 64) -> dict:
    """What runs here, for a model with this head_dim (the default model's is 64)."""
    import torch

    from minipd.models import cpu_kernels, kernel_build

    flags = kernel_build.cpu_flags()
    build_line = kernel_build.build_in_child()  # builds once (about a minute), or says why not
    built = cpu_kernels.available()
    isa = cpu_kernels.kernel_isa()
    vectors = cpu_kernels.small_linear_available()
    onednn = torch.backends.mkldnn.is_available()
    decode_attention = ("minipd paged_attention, " + (f"{isa} vectors" if head_dim in (64, 128) else "plain loops")
                        if built else "PyTorch SDPA over the gathered KV")  # fmt: skip
    blocked_rows = cpu_kernels.blocked_linear_rows()
    blocks = blocked_rows == sys.maxsize  # every product; fewer rows: the decode's, below
    blocked = f"minipd blocked_linear ({isa}, weights in column blocks"
    decode_blocks = f"minipd blocked_linear ({isa}, weights in column blocks) up to {blocked_rows} rows, then "
    unpacked = f"with --no-prepack: small_linear to {cpu_kernels.SMALL_LINEAR_MAX_ROWS} rows, then oneDNN"
    f32 = {
        "prefill_attention": f"minipd paged_prefill ({isa})" if cpu_kernels.paged_prefill_available(
            torch.float32, head_dim) else "PyTorch SDPA over the gathered KV",  # fmt: skip
        "decode_attention": decode_attention,
        "decode_linears": f"{blocked}; {unpacked})" if blocks
        else f"{decode_blocks}oneDNN (prepacked)" if blocked_rows
        else f"minipd small_linear ({isa}) up to {cpu_kernels.small_rows_beside_packed()} rows, then oneDNN (prepacked)"
        if vectors else ("oneDNN" if onednn else "PyTorch (MKL)"),
        "prefill_linears": f"{blocked}; with --no-prepack: {_unpacked_prefill(cpu_kernels.onednn_max_rows())})"
        if blocks
        else _prefill_linears(onednn, cpu_kernels.onednn_max_rows()),
        "elementwise": "minipd fused RMSNorm, SiLU x up, rotary" if built else "PyTorch operators",
    }
    native_bf16 = cpu_kernels.native_bfloat16()
    dot = "bf16" if isa == "neon" else "avx512_bf16"
    bf16_products = f"bfloat16 dot products ({dot})" if cpu_kernels.bfloat16_dot() else "bfloat16 widened"
    many_rows_bf16 = ("PyTorch (oneDNN bfloat16)" if native_bf16 else
                      "weights widened to float32 for the call, then PyTorch (no bfloat16 instructions)")  # fmt: skip
    bf16_blocks = blocks and cpu_kernels.blocked_bfloat16()
    bf16_decode_blocks = blocked_rows and not blocks and cpu_kernels.blocked_bfloat16()
    bf16_blocked = f"{blocked}, {bf16_products}, float32 sums; with --no-prepack: "
    attention_dot = built and cpu_kernels.prefill_bfloat16_dot()
    bf16 = {
        "prefill_attention": (f"minipd paged_prefill ({isa}, " + ("q.k and p.v in bfloat16 dot products (avx512_bf16), "
                              "p rounded to bfloat16, " if attention_dot else "") + "float32 sums)")
        if cpu_kernels.paged_prefill_available(torch.bfloat16, head_dim) else "PyTorch SDPA over the gathered KV",
        "decode_attention": decode_attention + (", keys' dot products in avx512_bf16" if attention_dot else "")
        + (", float32 sums" if built else ""),
        "decode_linears": f"{bf16_blocked}small_linear to {cpu_kernels.SMALL_LINEAR_MAX_ROWS} rows, then "
        f"{many_rows_bf16})" if bf16_blocks
        else f"{decode_blocks.removesuffix(', then ')}, {bf16_products}, float32 sums; then {many_rows_bf16}"
        if bf16_decode_blocks
        else f"minipd small_linear ({isa}, {bf16_products}, float32 sums) up to "
        f"{cpu_kernels.SMALL_LINEAR_MAX_ROWS} rows, then " + many_rows_bf16 if vectors else many_rows_bf16,
        "prefill_linears": f"{bf16_blocked}{many_rows_bf16})" if bf16_blocks else many_rows_bf16,
        "elementwise": f32["elementwise"],
    }
    return {
        "cpu": {"name": cpu_name(), "machine": platform.machine(), "cores": os.cpu_count(),
                "isa": kernel_build.isa_label(flags), "bfloat16_instructions": kernel_build.bfloat16_instructions(flags),
                "torch_capability": torch.backends.cpu.get_cpu_capability()},  # fmt: skip
        "kernels": {"built": built, "isa": isa, "vector_kernels": vectors, "note": build_line.removeprefix("minipd: "),
                    "error": cpu_kernels.error() or None, "forced_isa": os.environ.get(kernel_build.ISA_ENV) or None,
                    "disabled": bool(os.environ.get("MINIPD_NO_KERNEL")),
                    "blocked_linear": _blocked_source(isa, blocked_rows > 0)},  # fmt: skip
        "paths": {"float32": f32, "bfloat16": bf16},
        "default_dtype": "float32",
        "threads": torch.get_num_threads(),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "onednn": onednn_version(torch.__config__.show()) if onednn else None,
                     "mkl": torch.backends.mkl.is_available()},  # fmt: skip
    }


def render(info: dict) -> str:
    cpu, k, v = info["cpu"], info["kernels"], info["versions"]
    lines = [
        f"cpu        {cpu['name']} ({cpu['machine']}, {cpu['cores']} cores)",
        f"isa        {cpu['isa']}; torch uses {cpu['torch_capability']}; bfloat16 instructions: "
        + (", ".join(cpu["bfloat16_instructions"]) or "none"),
        f"kernels    {k['note']}" + (f" [{k['error']}]" if k["error"] else ""),
        f"           built for {k['isa'] or '-'}; vector kernels (small_linear, paged_prefill) "
        + ("in use" if k["vector_kernels"] else "not in use"),
        f"           blocked_linear (float32 products on column-blocked weights): {k['blocked_linear']}",
        f"threads    {info['threads']} (torch)",
        f"versions   python {v['python']}, torch {v['torch']}, oneDNN {v['onednn'] or '-'}, "
        f"MKL {'yes' if v['mkl'] else 'no'}",
    ]
    for dtype, paths in info["paths"].items():
        default = " (default)" if dtype == info["default_dtype"] else ""
        lines.append(f"{dtype}{default}")
        lines += [f"  {part.replace('_', ' '):18} {path}" for part, path in paths.items()]
    return "\n".join(lines)


def run(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m minipd info", description=__doc__.split("\n\n")[0],
                                 formatter_class=DefaultsFormatter)  # fmt: skip
    ap.add_argument("--json", action="store_true", help="print the same as JSON")
    ap.add_argument("--head-dim", type=positive_int, default=64, help="the model's head_dim (the default model's: 64)")
    args = ap.parse_args(argv)
    info = describe(args.head_dim)
    print(json.dumps(info, indent=2) if args.json else render(info))
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
