"""The CPU kernels' build: keyed by the CPU it targets, run once in a child with a timeout, and never
stuck behind the lock of a build that was killed."""

import copy
import os
import subprocess
import sys
import time

import pytest

from minipd.models import cpu_kernels, kernel_build

AVX2 = frozenset("fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma f16c bmi1 bmi2 hypervisor".split())
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}


@pytest.fixture
def extensions_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("MINIPD_NO_KERNEL", "")  # unset, restored after the test: build_in_child may set it
    return tmp_path


def fake_build(monkeypatch, code: str) -> None:
    monkeypatch.setattr(kernel_build, "BUILD_COMMAND", [sys.executable, "-c", code])


def test_the_build_helper_does_not_import_torch():
    code = (
        "import sys, minipd.models.kernel_build as k; k.extension_name(); k.build_directory(); "
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_cpu_flags_are_read_from_x86_and_arm_cpuinfo():
    x86 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f\n\nprocessor\t: 1\nflags\t\t: fpu sse2 avx2 avx512f\n"
    assert kernel_build.parse_cpu_flags(x86) == {"fpu", "sse2", "avx2", "avx512f"}
    arm = "processor\t: 0\nFeatures\t: fp asimd sve bf16\nCPU implementer\t: 0x41\n"
    assert kernel_build.parse_cpu_flags(arm) == {"fp", "asimd", "sve", "bf16"}
    assert kernel_build.parse_cpu_flags("") == frozenset()


def test_the_extension_name_changes_with_the_instruction_sets_of_the_cpu(monkeypatch):
    names = {}
    for label, flags in {"avx2": AVX2, "avx512": AVX512, "avx2 on another host": AVX2 - {"hypervisor"}}.items():
        monkeypatch.setattr(kernel_build, "cpu_flags", lambda flags=flags: flags)
        names[label] = kernel_build.extension_name()
    assert names["avx2"] != names["avx512"]  # a shared cache never hands an AVX-512 build to an AVX2 CPU
    assert names["avx2"] == names["avx2 on another host"]  # flags that are no instruction set do not split it
    assert "avx512" in names["avx512"] and "avx512" not in names["avx2"]


def test_the_vector_kernels_run_only_where_the_cpu_reports_the_isa_they_were_built_for():
    assert kernel_build.vector_kernels_usable("avx512", AVX512)
    assert not kernel_build.vector_kernels_usable("avx512", AVX2)
    assert kernel_build.vector_kernels_usable("avx2", AVX2) and kernel_build.vector_kernels_usable("avx2", AVX512)
    assert kernel_build.vector_kernels_usable("neon", frozenset({"fp", "asimd"}))
    assert not kernel_build.vector_kernels_usable("scalar", AVX512)  # slower than the portable paths
    assert not kernel_build.vector_kernels_usable(None, AVX512)  # not built


def test_a_forced_isa_is_built_under_its_own_name_and_a_wrong_one_is_refused(monkeypatch):
    monkeypatch.setattr(kernel_build, "cpu_flags", lambda: AVX512)
    monkeypatch.delenv(kernel_build.ISA_ENV, raising=False)
    native = kernel_build.extension_name()
    monkeypatch.setenv(kernel_build.ISA_ENV, "avx2")
    assert "-mno-avx512f" in kernel_build.cflags()
    forced = kernel_build.extension_name()
    assert forced != native and "_avx2_" in forced
    monkeypatch.setenv(kernel_build.ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="MINIPD_KERNEL_ISA"):
        kernel_build.cflags()


def test_small_linear_and_paged_prefill_ask_the_cpu_not_only_the_compiler(monkeypatch):
    import torch

    monkeypatch.setattr(cpu_kernels, "kernel_isa", lambda: "avx512")
    for flags, want in ((AVX2, False), (AVX512, True)):
        monkeypatch.setattr(cpu_kernels, "_state", {"ok": True})
        monkeypatch.setattr(kernel_build, "cpu_flags", lambda flags=flags: flags)
        assert cpu_kernels.small_linear_available() == want
        assert cpu_kernels.paged_prefill_available(torch.float32, 64) == want


def test_an_old_lock_is_a_killed_build_and_is_removed_with_one_line_naming_it(extensions_dir):
    lock = kernel_build.build_directory() / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    assert kernel_build.remove_stale_lock(lock, older_than=60) == ""  # young: a build may be running
    assert lock.exists()
    os.utime(lock, (time.time() - 3600, time.time() - 3600))
    note = kernel_build.remove_stale_lock(lock, older_than=60)
    assert str(lock) in note and "\n" not in note
    assert not lock.exists()


def test_waiting_on_a_young_lock_ends_when_it_goes_stale(extensions_dir):
    lock = kernel_build.build_directory() / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    start = time.monotonic()
    note = kernel_build.wait_for_lock(lock, stale_after=0.5)
    assert time.monotonic() - start < 5 and str(lock) in note and not lock.exists()
    assert kernel_build.wait_for_lock(lock, stale_after=0.5) == ""  # no lock: no wait, nothing to say


def test_the_first_start_prints_one_progress_line_and_a_cached_start_none(extensions_dir, monkeypatch, capsys):
    monkeypatch.setenv(kernel_build.BLOCKED_ENV, "1")  # nothing to measure after the build (the test below)
    library = kernel_build.library_path()
    fake_build(
        monkeypatch, f"import pathlib; p = pathlib.Path({str(library)!r}); p.parent.mkdir(parents=True); p.touch()"
    )
    outcome = kernel_build.build_in_child(timeout=30)
    assert "built" in outcome and "\n" not in outcome
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "building the CPU kernels" in err and "first start only" in err
    fake_build(monkeypatch, "raise SystemExit('must not run: the build is cached')")
    assert "cached" in kernel_build.build_in_child(timeout=30)
    assert capsys.readouterr().err == ""
    assert not os.environ["MINIPD_NO_KERNEL"]


def test_a_build_that_fails_says_why_in_one_line_and_the_workers_skip_the_kernels(extensions_dir, monkeypatch):
    fake_build(monkeypatch, "print('some noise'); print('c++: command not found'); raise SystemExit(1)")
    outcome = kernel_build.build_in_child(timeout=30)
    assert "c++: command not found" in outcome and "portable" in outcome and "\n" not in outcome
    assert os.environ["MINIPD_NO_KERNEL"] == "1"  # the workers spawned next do not try again


def test_a_build_past_its_timeout_is_killed_with_its_compilers_and_leaves_no_lock(
    extensions_dir, monkeypatch, tmp_path
):
    lock, pid_file = kernel_build.build_directory() / "lock", tmp_path / "compiler.pid"
    fake_build(
        monkeypatch,
        "import pathlib, subprocess, sys, time\n"
        f"compiler = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"pathlib.Path({str(pid_file)!r}).write_text(str(compiler.pid))\n"
        f"pathlib.Path({str(lock)!r}).parent.mkdir(parents=True, exist_ok=True)\n"
        f"open({str(lock)!r}, 'x'); print('building', flush=True); time.sleep(60)",
    )
    start = time.monotonic()
    outcome = kernel_build.build_in_child(timeout=3)
    assert time.monotonic() - start < 10
    assert "timed out" in outcome and str(lock) in outcome and "\n" not in outcome
    assert not lock.exists() and os.environ["MINIPD_NO_KERNEL"] == "1"
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid)


def test_a_lock_held_before_the_build_started_is_named_not_removed(extensions_dir, monkeypatch):
    lock = kernel_build.build_directory() / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()  # another server building into the same cache right now
    fake_build(monkeypatch, "import time; time.sleep(60)")
    outcome = kernel_build.build_in_child(timeout=1)
    assert "timed out" in outcome and str(lock) in outcome and lock.exists()


def test_a_missing_ninja_is_said_not_silently_skipped(extensions_dir, monkeypatch):
    monkeypatch.setattr(kernel_build, "ninja_path", lambda: None)
    fake_build(monkeypatch, "raise SystemExit('must not run without ninja')")
    outcome = kernel_build.build_in_child(timeout=30)
    assert "ninja" in outcome and "pip install ninja" in outcome and "\n" not in outcome
    monkeypatch.setenv("MINIPD_NO_KERNEL", "")  # set by the build above; a process building for itself also says so
    monkeypatch.setattr(cpu_kernels, "_state", {})
    assert not cpu_kernels.available() and "pip install ninja" in cpu_kernels.error()


def test_a_failed_compile_is_told_by_the_compilers_line_not_by_the_command():
    command = "c++ -MMD -MF elementwise.o.d -O3 -march=native -c /x/elementwise.cpp -o elementwise.o"
    ninja = (
        "Error building extension 'minipd': [1/2] {c}\nFAILED: [code=1] elementwise.o\n{c}\nIn file included from "
        "/x/elementwise.cpp:1:\n/x/exp16.h:3:1: error: 'x' does not name a type\nninja: build stopped: subcommand failed."
    )
    assert (
        cpu_kernels._one_line(RuntimeError(ninja.format(c=command)))
        == "/x/exp16.h:3:1: error: 'x' does not name a type"
    )
    missing = ninja.format(c=command).replace(
        "/x/exp16.h:3:1: error: 'x' does not name a type", "/bin/sh: 1: c++: not found"
    )
    assert cpu_kernels._one_line(RuntimeError(missing)) == "In file included from /x/elementwise.cpp:1:"


def test_minipd_no_kernel_still_turns_them_off(extensions_dir, monkeypatch):
    monkeypatch.setenv("MINIPD_NO_KERNEL", "1")
    fake_build(monkeypatch, "raise SystemExit('must not run: the kernels are off')")
    assert "MINIPD_NO_KERNEL" in kernel_build.build_in_child(timeout=30)
    monkeypatch.setattr(cpu_kernels, "_state", {})
    assert not cpu_kernels.available()


@pytest.mark.slow
def test_a_real_build_in_a_fresh_cache_with_a_stale_lock_left_in_it(extensions_dir, capsys):
    lock = kernel_build.build_directory() / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    os.utime(lock, (time.time() - 3600, time.time() - 3600))
    outcome = kernel_build.build_in_child(timeout=600)
    assert "built" in outcome and str(lock) in outcome, outcome
    assert kernel_build.library_path().is_file() and not lock.exists()
    assert "building the CPU kernels" in capsys.readouterr().err
    assert "cached" in kernel_build.build_in_child(timeout=600)
    code = (
        "import sys; from minipd.models import cpu_kernels; "
        "sys.exit(not cpu_kernels.available() or 'torch.utils.cpp_extension' in sys.modules)"
    )
    worker = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)  # loads the file, no build
    assert worker.returncode == 0, worker.stderr


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("isa,rows", [("avx2", 8)])
def test_decode_rows_go_to_the_small_row_kernel_as_far_as_it_beats_onednn_on_this_isa(monkeypatch, tiny_model, isa, rows):
    """Defect (scripts/bench_small_linear.py on the AVX2 EPYC): beside prepacked weights the small-row
    kernel stopped at 2 rows, measured on the AVX-512 machine, while on AVX2 it reads the weights
    faster than oneDNN's packed product at every row count to 8 (9.2 against 5.5 GB/s at 8 rows)."""
    import torch

    from minipd.models.linear import Linear, use_cpu_kernels

    monkeypatch.setattr(cpu_kernels, "kernel_isa", lambda: isa)
    monkeypatch.setattr(cpu_kernels, "small_linear_available", lambda: True)
    monkeypatch.setenv(cpu_kernels.BLOCKED_ENV, "0")  # the paths without blocked_linear (measured per CPU)
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN: nothing is prepacked")
    try:
        use_cpu_kernels(tiny_model, prepack=True)
        layers = [m for m in tiny_model.modules() if isinstance(m, Linear) and m.packed is not None]
        assert layers and all(m.small_rows == rows for m in layers)
    finally:
        monkeypatch.undo()
        use_cpu_kernels(tiny_model)


def test_with_avx512_every_float32_product_runs_on_column_blocked_weights_and_nothing_is_packed_for_onednn(
        monkeypatch, tiny_model):  # fmt: skip
    """blocked_linear beat small_linear and oneDNN's packed product at every row count measured on the
    AVX-512 EPYC (scripts/bench_small_linear.py): there each Linear, the LM head too, holds its
    weights in column blocks instead of oneDNN's layout (one copy beside the plain weights, not two),
    the one-call decode takes any batch, and the products equal F.linear's."""
    import torch
    import torch.nn.functional as F

    from minipd.models.linear import Linear, use_cpu_kernels

    cpu_kernels.small_linear_available()  # built and decided for this CPU before its ISA is faked
    if not cpu_kernels.available():
        pytest.skip("no kernels built")
    monkeypatch.setattr(cpu_kernels, "kernel_isa", lambda: "avx512")
    monkeypatch.setattr(cpu_kernels.kernel_build, "cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f"}))
    try:
        use_cpu_kernels(tiny_model, prepack=True)
        linears = [m for m in tiny_model.modules() if isinstance(m, Linear)]
        assert all(m.out_features % cpu_kernels.block_columns() == 0 for m in linears)  # the tiny model's shapes
        assert all(m.blocked is not None and m.packed is None for m in linears)
        assert tiny_model.decode_rows > 1024
        for m in (linears[0], tiny_model.lm_head):
            for rows in (1, 8, 33):
                x = torch.randn(rows, m.in_features)
                torch.testing.assert_close(m.forward(x), F.linear(x, m.weight, m.bias), rtol=1e-5, atol=1e-5)
        use_cpu_kernels(tiny_model, prepack=False)  # no second copy: no blocks
        assert all(m.blocked is None for m in linears)
    finally:
        monkeypatch.undo()
        use_cpu_kernels(tiny_model)


def test_where_the_blocks_win_only_a_decode_steps_rows_they_take_those_and_onednn_keeps_its_packed_copy(
        monkeypatch, tiny_model):  # fmt: skip
    """Defect (the Zen 3 AVX2 EPYC): blocked_linear measured faster up to 16 rows and slower from 32
    was off for every product. Now up to its rows each Linear multiplies on the column blocks (the
    one-call decode takes batches that large), and beyond them on oneDNN's prepacked copy (both
    copies kept, the LM head's blocks alone), with products equal to F.linear's on either side."""
    import torch
    import torch.nn.functional as F

    from minipd.models.linear import Linear, use_cpu_kernels

    cpu_kernels.small_linear_available()
    if not (cpu_kernels.available() and torch.backends.mkldnn.is_available()):
        pytest.skip("no kernels built, or no oneDNN")
    monkeypatch.setattr(cpu_kernels, "blocked_linear_rows", lambda: 16)
    try:
        use_cpu_kernels(tiny_model, prepack=True)
        linears = [m for m in tiny_model.modules() if isinstance(m, Linear)]
        assert all(m.blocked is not None and m.blocked_rows == 16 for m in linears)
        assert all((m.packed is None) == (m is tiny_model.lm_head) for m in linears)
        assert tiny_model.decode_rows == 16
        for m in (linears[0], tiny_model.lm_head):
            for rows in (1, 8, 16, 17, 64):
                x = torch.randn(rows, m.in_features)
                torch.testing.assert_close(m.forward(x), F.linear(x, m.weight, m.bias), rtol=1e-5, atol=1e-5)
        monkeypatch.setattr(cpu_kernels, "blocked_linear_rows", lambda: 0)
        use_cpu_kernels(tiny_model, prepack=True)
        assert all(m.blocked is None for m in linears) and tiny_model.decode_rows <= cpu_kernels.SMALL_LINEAR_MAX_ROWS
    finally:
        monkeypatch.undo()
        use_cpu_kernels(tiny_model)


@pytest.mark.parametrize("flags,mkl_from", [({"avx2", "fma"}, 512), ({"avx2", "fma", "avx512f"}, None)])
def test_prefill_products_go_to_mkl_from_the_rows_where_it_beats_onednn_without_avx512(monkeypatch, tiny_model, flags,
                                                                                       mkl_from):  # fmt: skip
    """Defect (scripts/bench_prefill_linear.py on the AVX2 EPYC): every float32 product of more than
    8 rows went to oneDNN, measured faster on the AVX-512 machine (where MKL on AMD takes a path
    without AVX-512); on AVX2 MKL's product is 10-12% faster from 1,024 rows (3-6% on a 512-token
    prefill). A 512-row product must run in F.linear there, a 64-row one still in oneDNN."""
    import torch
    import torch.nn.functional as F

    from minipd.models import linear as linear_mod
    from minipd.models.linear import Linear, use_cpu_kernels

    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN")
    cpu_kernels.small_linear_available()  # built and decided for this CPU before its flags are faked
    monkeypatch.setattr(cpu_kernels.kernel_build, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setenv(cpu_kernels.BLOCKED_ENV, "0")  # the paths without blocked_linear (measured per CPU)
    calls = []
    real_linear = F.linear
    monkeypatch.setattr(linear_mod.F, "linear", lambda *a, **k: calls.append(a[0].shape[0]) or real_linear(*a, **k))
    try:
        use_cpu_kernels(tiny_model, prepack=True)
        layer = next(m for m in tiny_model.modules() if isinstance(m, Linear) and m is not tiny_model.lm_head)
        for rows in (64, 512):
            x = torch.randn(rows, layer.in_features)
            torch.testing.assert_close(layer.forward(x), real_linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        assert calls == ([] if mkl_from is None else [512])
    finally:
        monkeypatch.undo()
        use_cpu_kernels(tiny_model)


def test_a_product_of_no_rows_stays_in_pytorch_when_onednn_is_off(monkeypatch, tiny_model):
    """Defect (review): with the row limit for oneDNN an int, `rows <= onednn_rows` held for a
    product of 0 rows with oneDNN off (0 <= 0), so the LM head's (0, H) input in a step where no
    sequence samples went to oneDNN: on CUDA, or with the kernels off, it must stay in F.linear."""
    import torch
    import torch.nn.functional as F

    from minipd.models import linear as linear_mod
    from minipd.models.linear import use_cpu_kernels

    calls = []
    real_linear = F.linear
    monkeypatch.setattr(linear_mod.F, "linear", lambda *a, **k: calls.append(a[0].shape[0]) or real_linear(*a, **k))
    try:
        use_cpu_kernels(tiny_model, on=False)
        head = tiny_model.lm_head
        assert head.forward(torch.randn(0, head.in_features)).shape == (0, head.out_features)
        assert calls == [0]
    finally:
        monkeypatch.undo()
        use_cpu_kernels(tiny_model)


def test_a_model_off_the_cpu_kernels_never_asks_for_them(monkeypatch, tiny_model):
    """Defect (review): use_cpu_kernels asked whether blocked_linear was in use before whether the
    model was a CPU model in float32 or bfloat16, so a CUDA model, or the kernels turned off, built
    or loaded the CPU extension (about a minute, or a warning where no compiler exists)."""
    from minipd.models.linear import use_cpu_kernels

    def built(*_):
        raise AssertionError("the CPU kernels were asked for")

    try:
        monkeypatch.setattr(cpu_kernels, "kernel_isa", built)
        monkeypatch.setattr(cpu_kernels, "available", built)
        use_cpu_kernels(tiny_model, on=False)
    finally:
        monkeypatch.undo()
        use_cpu_kernels(tiny_model)


def test_blocked_linear_is_measured_in_the_build_child_once_where_its_isa_is_not_known(extensions_dir, monkeypatch,
                                                                                       capsys):  # fmt: skip
    """On AVX2 and NEON blocked_linear runs only where it measured faster (blocked_choice.py): a cached
    build without that measurement starts the child once more to take it, before the workers spawn;
    with the measurement kept, or MINIPD_BLOCKED_LINEAR set, or on AVX-512 (known), it does not."""
    monkeypatch.setattr(kernel_build, "cpu_flags", lambda: AVX2)
    monkeypatch.delenv(kernel_build.BLOCKED_ENV, raising=False)
    library = kernel_build.library_path()
    library.parent.mkdir(parents=True)
    library.touch()
    choice = library.parent / kernel_build.BLOCKED_CHOICE_FILE
    assert kernel_build.blocked_choice_due("avx2") and not kernel_build.blocked_choice_due("avx512")
    kept = '{"use": true, "rows": null, "speedup": {"1": 1.2}}'
    choice.write_text("{}")  # not a measurement (a file left half-made by hand): taken again
    assert kernel_build.blocked_choice_due("avx2")
    fake_build(monkeypatch, f"import pathlib; pathlib.Path({str(choice)!r}).write_text({kept!r})")
    outcome = kernel_build.build_in_child(timeout=30)
    assert "measured" in outcome and choice.is_file()
    assert "measuring blocked_linear" in capsys.readouterr().err
    fake_build(monkeypatch, "raise SystemExit('must not run: measured already')")
    assert "cached" in kernel_build.build_in_child(timeout=30)
    monkeypatch.setattr(kernel_build, "ninja_path", lambda: None)  # a measurement needs no ninja
    choice.unlink()
    fake_build(monkeypatch, f"import pathlib; pathlib.Path({str(choice)!r}).write_text({kept!r})")
    assert "measured" in kernel_build.build_in_child(timeout=30) and not os.environ["MINIPD_NO_KERNEL"]
    choice.unlink()
    monkeypatch.setenv(kernel_build.BLOCKED_ENV, "0")
    assert not kernel_build.blocked_choice_due("avx2")
    assert "cached" in kernel_build.build_in_child(timeout=30)


def test_bfloat16_products_of_many_rows_leave_widened_blocks_for_mkl_where_there_is_no_vdpbf16ps(monkeypatch,
                                                                                                  tiny_model):  # fmt: skip
    """On the Zen 1 AVX2 EPYC blocked_linear on bfloat16 weights widened in registers was 1.1-2x
    faster than widening the weights to float32 for MKL up to 128 rows, and 7-9% slower at 512-1,024
    (the widening's two instructions per weight vector): from 512 rows a bfloat16 product without
    vdpbf16ps goes to MKL on widened weights; fewer rows stay in the blocks."""
    import torch
    import torch.nn.functional as F

    from minipd.models import linear as linear_mod
    from minipd.models.linear import Linear, use_cpu_kernels

    if not (cpu_kernels.small_linear_available() and cpu_kernels.blocked_bfloat16()):
        pytest.skip("no vector kernels here")
    if cpu_kernels.blocked_bfloat16_dot():
        pytest.skip("this build multiplies bfloat16 in vdpbf16ps: the blocks take every product")
    monkeypatch.setenv(cpu_kernels.BLOCKED_ENV, "1")
    calls = []
    real_linear = F.linear
    monkeypatch.setattr(linear_mod.F, "linear", lambda *a, **k: calls.append(a[0].shape[0]) or real_linear(*a, **k))
    use_cpu_kernels(tiny_model, on=False)  # no oneDNN copy left on it: an opaque tensor cannot be deep-copied
    model = copy.deepcopy(tiny_model).to(torch.bfloat16)  # the fixture's model may be shared: left as it was
    try:
        use_cpu_kernels(model, prepack=True)
        layer = next(m for m in model.modules() if isinstance(m, Linear) and m.blocked is not None)
        for rows in (64, 512):
            x = torch.randn(rows, layer.in_features).bfloat16()
            exact = real_linear(x.double(), layer.weight.double())
            assert ((layer.forward(x).double() - exact).abs() <= exact.abs() * 2**-7 + 1e-2).all()
        assert calls == [512]
    finally:
        monkeypatch.undo()
        use_cpu_kernels(tiny_model)
