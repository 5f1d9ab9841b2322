"""`python -m minipd info` says which paths run on this machine, in agreement with the dispatch."""

import json
import subprocess
import sys

import torch

from minipd import info
from minipd.models import cpu_kernels, kernel_build


def test_info_agrees_with_what_the_dispatch_chooses():
    got = info.describe(head_dim=64)
    assert got["cpu"]["isa"] == kernel_build.isa_label(kernel_build.cpu_flags())
    assert got["cpu"]["torch_capability"] == torch.backends.cpu.get_cpu_capability()
    assert got["kernels"]["built"] == cpu_kernels.available()
    assert got["kernels"]["vector_kernels"] == cpu_kernels.small_linear_available()
    prefill = got["paths"]["float32"]["prefill_attention"]
    assert prefill.startswith("minipd paged_prefill") == cpu_kernels.paged_prefill_available(torch.float32, 64)
    f32_linears = got["paths"]["float32"]["decode_linears"]
    f32_prefill = got["paths"]["float32"]["prefill_linears"]
    if cpu_kernels.blocked_linear_rows() == sys.maxsize:
        assert f32_linears.startswith("minipd blocked_linear") and f32_prefill.startswith("minipd blocked_linear")
    elif cpu_kernels.blocked_linear_in_use():  # a decode step's rows alone (blocked_choice.py)
        assert f32_linears.startswith("minipd blocked_linear") and f"up to {cpu_kernels.blocked_linear_rows()} rows" in f32_linears
        assert f32_prefill.startswith("oneDNN")
    else:
        assert f32_linears.startswith("minipd small_linear") == cpu_kernels.small_linear_available()
    bf16_linears = got["paths"]["bfloat16"]["decode_linears"]
    bf16_blocked = cpu_kernels.blocked_linear_in_use() and cpu_kernels.blocked_bfloat16()
    assert bf16_linears.startswith("minipd blocked_linear") == bf16_blocked
    assert ("bfloat16 dot products" in bf16_linears) == (cpu_kernels.bfloat16_dot() and cpu_kernels.small_linear_available())
    bf16_prefill = got["paths"]["bfloat16"]["prefill_attention"]
    assert ("dot products" in bf16_prefill) == (cpu_kernels.available() and cpu_kernels.prefill_bfloat16_dot())
    assert got["threads"] == torch.get_num_threads() and got["versions"]["torch"] == torch.__version__
    text = info.render(got)
    assert got["cpu"]["name"] in text and "float32 (default)" in text and "bfloat16" in text


def test_info_runs_from_the_command_line_as_json():
    out = subprocess.run([sys.executable, "-m", "minipd", "info", "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert set(got) >= {"cpu", "kernels", "paths", "threads", "versions"}
    assert got["versions"]["onednn"] is None or got["versions"]["onednn"][0].isdigit()
