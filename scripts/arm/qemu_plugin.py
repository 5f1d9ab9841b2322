"""pytest plugin for scripts/arm/check.sh, loaded into an aarch64 Python under qemu-user: qemu shows
the host's /proc/cpuinfo (an x86 CPU's flags), so minipd is told the emulated CPU's features from
the ELF auxiliary vector (AT_HWCAP, AT_HWCAP2), which qemu does emulate; and the kernels, built by
the cross compiler, are put where minipd loads a prebuilt library (building under qemu would take
an hour)."""

import os
import shutil
import struct
from pathlib import Path

from minipd.models import kernel_build

AT_HWCAP, AT_HWCAP2 = 16, 26
HWCAP = {0: "fp", 1: "asimd", 20: "asimddp", 22: "sve"}  # arch/arm64/include/uapi/asm/hwcap.h
HWCAP2 = {1: "sve2", 13: "i8mm", 14: "bf16"}


def auxv_features() -> frozenset[str]:
    data = Path("/proc/self/auxv").read_bytes()
    entries = dict(struct.iter_unpack("<QQ", data[: len(data) // 16 * 16]))
    names = {n for bit, n in HWCAP.items() if entries.get(AT_HWCAP, 0) >> bit & 1}
    names |= {n for bit, n in HWCAP2.items() if entries.get(AT_HWCAP2, 0) >> bit & 1}
    return frozenset(names)


def pytest_configure(config):
    assert os.uname().machine == "aarch64", "run under an aarch64 Python (scripts/arm/check.sh)"
    features = auxv_features()  # qemu's CPU has them all: MINIPD_ARM_FEATURES says which the target has
    if wanted := os.environ.get("MINIPD_ARM_FEATURES"):
        features &= frozenset(wanted.split())
    assert "asimd" in features, f"the emulated CPU reports no NEON: {sorted(features)}"
    kernel_build.cpu_flags.cache_clear()
    kernel_build.cpu_flags = lambda: features
    target = kernel_build.library_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(os.environ["MINIPD_ARM_LIBRARY"], target)
    print(f"aarch64 under qemu; CPU features {sorted(features)}; kernels {target}")
