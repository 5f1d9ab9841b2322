"""Where minipd's CPU kernels are built and under which name, without importing torch: the name
holds the instruction sets of the CPU the build targets (-march=native), so a cache shared between
machines never hands one CPU a build for another. build_in_child() builds them once, before the
workers spawn, in a child process with a timeout, and never leaves a worker waiting on the lock of
a build that was killed."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

CSRC = Path(__file__).parent / "csrc"
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-funroll-loops"]
ISA_ENV = "MINIPD_KERNEL_ISA"  # build for less than the CPU has: to test that build where a better one runs
FORCED_ISA_CFLAGS = {"avx2": ["-mno-avx512f"], "scalar": ["-mno-avx512f", "-mno-avx2", "-mno-fma"]}  # x86
VECTOR_ISAS = ("avx512", "avx2", "neon")  # vec.h's; "scalar" (any other CPU) is slower than the portable paths
MEASURED_BLOCKED_ISAS = ("avx2", "neon")  # where blocked_linear runs only if it measured faster (blocked_choice.py)
BLOCKED_CHOICE_FILE = "blocked_choice.json"
BLOCKED_ENV = "MINIPD_BLOCKED_LINEAR"
BUILD_COMMAND = [sys.executable, "-m", "minipd.models.cpu_kernels"]
BUILD_TIMEOUT_S = 240.0
STALE_LOCK_S = 300.0  # older than any build the timeout allows: the lock of a killed build
X86_ISA_PREFIXES = ("sse", "ssse", "avx", "amx", "fma", "f16c", "bmi", "popcnt", "movbe", "gfni", "vaes", "vpclmul")
NINJA_MISSING = "ninja is missing (pip install ninja)"
PORTABLE = "using the portable PyTorch paths"


def parse_cpu_flags(cpuinfo: str) -> frozenset[str]:
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):  # x86, arm
            return frozenset(value.split())
    return frozenset()


BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # x86 AVX512-BF16 and AMX, arm BF16


def bfloat16_instructions(flags: frozenset[str]) -> list[str]:
    """The CPU's bfloat16 product instructions: where there are none, oneDNN's bfloat16 GEMM is
    several times slower than float32 (or refuses), so minipd widens bfloat16 weights to float32
    for products of many rows."""
    return [f for f in BF16_FLAGS if f in flags]


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        return parse_cpu_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        return frozenset()


def forced_isa() -> str | None:
    """MINIPD_KERNEL_ISA=avx2 or scalar builds the kernels for that instruction set on an x86 CPU
    that has more (each build under its own name)."""
    isa = os.environ.get(ISA_ENV, "").strip().lower()
    if isa and isa not in FORCED_ISA_CFLAGS:
        raise ValueError(f"{ISA_ENV}={isa!r}: expected one of {', '.join(FORCED_ISA_CFLAGS)} (or unset: the CPU's best)")
    return isa or None


def cflags() -> list[str]:
    return CFLAGS + FORCED_ISA_CFLAGS.get(forced_isa() or "", [])


def vector_kernels_usable(built: str | None, flags: frozenset[str]) -> bool:
    """The kernels that beat the portable paths only with vectors (small_linear, paged_prefill) run
    when they were built for a vector ISA that this CPU reports, not only the compiler."""
    needs = {"avx512": {"avx512f"}, "avx2": {"avx2", "fma"}, "neon": {"asimd"}}.get(built or "")
    return needs is not None and needs <= flags


def isa_label(flags: frozenset[str]) -> str:
    for isa in ("avx512", "avx2", "sve", "asimd"):
        if any(f.startswith(isa) for f in flags):
            return "neon" if isa == "asimd" else isa
    return os.uname().machine


def isa_flags(flags: frozenset[str]) -> list[str]:
    x86 = [f for f in flags if f.startswith(X86_ISA_PREFIXES)]
    return sorted(x86 or flags)  # arm: its features are instruction sets


def extension_name() -> str:
    key = hashlib.sha1(b"".join(p.read_bytes() for p in sorted(CSRC.iterdir())))  # headers too
    key.update(" ".join([*cflags(), *isa_flags(cpu_flags()), _torch_version()]).encode())
    return f"minipd_cpu_kernels_{forced_isa() or isa_label(cpu_flags())}_{key.hexdigest()[:10]}"


def _torch_version() -> str:
    try:
        return importlib.metadata.version("torch")  # 2.13.0+cpu: a CUDA build links other libraries
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def build_directory() -> Path:
    if root := os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(root) / extension_name()  # as torch does: no subfolder
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return cache.resolve() / "torch_extensions" / f"{python}_cpu" / extension_name()


def library_path() -> Path:
    return build_directory() / f"{extension_name()}.so"


def ninja_path() -> str | None:
    return shutil.which("ninja", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))


def lock_age(lock: Path) -> float | None:
    try:
        return time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return None


def remove_stale_lock(lock: Path, older_than: float = STALE_LOCK_S) -> str:
    """torch's build lock is a bare file that a killed build leaves behind, after which every
    build waits on it forever; one older than any build can take is removed."""
    age = lock_age(lock)
    if age is None or age < older_than:
        return ""
    lock.unlink(missing_ok=True)
    return f"removed the lock of a killed kernel build, {age / 60:.0f} min old: {lock}"


def wait_for_lock(lock: Path, stale_after: float = STALE_LOCK_S) -> str:
    while (age := lock_age(lock)) is not None and age < stale_after:
        time.sleep(0.1)  # another process builds, as torch's own wait; unlike it, bounded
    return remove_stale_lock(lock, stale_after)


def build_in_child(timeout: float = BUILD_TIMEOUT_S) -> str:
    """Build the kernels in a child process, once, before the workers spawn: the workers then load
    the built file without building or waiting. If the build fails or times out, MINIPD_NO_KERNEL
    is set so that the workers spawned next use the portable paths at once. Returns one line."""
    if os.environ.get("MINIPD_NO_KERNEL"):
        return "minipd: CPU kernels off (MINIPD_NO_KERNEL)"
    isa, folder = forced_isa() or isa_label(cpu_flags()), build_directory()
    built = library_path().is_file()
    if built and not blocked_choice_due(isa):
        return f"minipd: CPU kernels for {isa}, cached in {folder}"
    if not built and ninja_path() is None:  # (a measurement needs no ninja)
        return _give_up(f"the CPU kernels cannot be built: {NINJA_MISSING}")
    note = remove_stale_lock(folder / "lock", max(timeout, STALE_LOCK_S))
    doing = "measuring blocked_linear" if built else "building the CPU kernels"
    took = "a few seconds" if built else "about a minute"
    print(f"minipd: {doing} for {isa} (first start only, {took})...", file=sys.stderr, flush=True)
    start = time.monotonic()
    if failure := _run_child(timeout, folder / "lock"):
        outcome = _give_up(failure)
    else:
        outcome = f"minipd: CPU kernels {'measured' if built else 'built'} for {isa} in {time.monotonic() - start:.0f} s ({folder})"
    return f"{outcome}; {note}" if note else outcome


def read_blocked_choice(path: Path) -> dict | None:
    """blocked_choice.json as blocked_choice.py keeps it, or None (absent, unreadable, or not one)."""
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(found, dict) and isinstance(found.get("use"), bool) and isinstance(found.get("speedup"), dict)
    ok = ok and "rows" in found and (found["rows"] is None or isinstance(found["rows"], int))  # (kept since 2026-12-07)
    return found if ok else None


def blocked_choice_due(isa: str | None) -> bool:
    """Whether blocked_linear still has to be measured against the other paths for this build."""
    isa = "neon" if isa == "sve" else isa  # vec.h builds NEON for an SVE CPU
    if isa not in MEASURED_BLOCKED_ISAS or os.environ.get(BLOCKED_ENV, "").strip():
        return False
    return vector_kernels_usable(isa, cpu_flags()) and read_blocked_choice(build_directory() / BLOCKED_CHOICE_FILE) is None


def _run_child(timeout: float, lock: Path) -> str:
    """Why the build failed, or "" once it built."""
    locked_before = lock.exists()
    child = subprocess.Popen(
        BUILD_COMMAND, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )  # the compilers are in its group
    try:
        output, _ = child.communicate(timeout=timeout)
    except BaseException as stop:  # the timeout, or ctrl-C: the compilers go too, and the lock they held
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        failure = _timed_out(lock, timeout, locked_before)
        if not isinstance(stop, subprocess.TimeoutExpired):
            raise
        return failure
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    if child.returncode != 0:
        return f"the CPU kernels could not be built ({lines[-1] if lines else f'exit status {child.returncode}'})"
    if not library_path().is_file():
        return f"the CPU kernel build left no {library_path()}"
    return ""


def _timed_out(lock: Path, timeout: float, locked_before: bool) -> str:
    age = lock_age(lock)
    if age is None:
        return f"the CPU kernel build timed out after {timeout:.0f} s"
    if not locked_before:  # the lock of the build just killed
        lock.unlink(missing_ok=True)
        return f"the CPU kernel build timed out after {timeout:.0f} s (removed its lock {lock})"
    return (
        f"the CPU kernel build timed out after {timeout:.0f} s waiting on {lock}, held {age:.0f} s by another "
        f"build (if none runs, remove it)"
    )


def _give_up(reason: str) -> str:
    os.environ["MINIPD_NO_KERNEL"] = "1"  # inherited by the workers spawned next
    return f"minipd: {reason}; {PORTABLE}"
