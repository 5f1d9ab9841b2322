"""The kernels of another git revision, built beside the working tree's in one process, for the
benchmarks' `--against REV` (a kernel change timed side by side with what it changes). Run alone,
it builds them and lists their operators (a check that a revision's kernels still build here).

    python scripts/revision_kernels.py HEAD~3
"""

from __future__ import annotations

import argparse


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rev", help="a git revision")
    args = ap.parse_args()
    import torch

    kernels_of_revision(args.rev)
    ops = sorted(name.split("::")[1] for name in torch._C._dispatch_get_all_op_names() if name.startswith("minipd_then::"))
    print(f"built the kernels of {args.rev}: torch.ops.minipd_then.{{{', '.join(ops)}}}")


def kernels_side_by_side(against: str | None, threads: int) -> dict:
    """{"minipd": the working tree's kernels, and "minipd@REV": git revision REV's where asked}, after
    checking that the kernels are built here and setting torch's threads: a benchmark's set-up."""
    import torch

    from minipd.models import cpu_kernels

    if not cpu_kernels.available():
        raise SystemExit(f"the CPU kernels are not built: {cpu_kernels.error()}")
    torch.set_num_threads(threads)
    kernels = {"minipd": torch.ops.minipd}
    if against:
        kernels[f"minipd@{against}"] = kernels_of_revision(against)
    return kernels


def kernels_of_revision(rev: str):
    """torch.ops.minipd_then: the kernels as built from the sources of git revision `rev`, renamed so
    that they load beside the working tree's (same flags)."""
    import re
    import shutil
    import subprocess
    import tempfile
    from pathlib import Path

    import torch
    from torch.utils.cpp_extension import load

    from minipd.models import kernel_build

    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True).stdout.strip()
    csrc = kernel_build.CSRC.relative_to(root).as_posix()
    names = subprocess.run(["git", "ls-tree", "--name-only", rev, csrc + "/"], capture_output=True, text=True,
                           check=True, cwd=root).stdout.split()  # fmt: skip
    folder = Path(tempfile.mkdtemp(prefix="minipd-kernels-"))
    for name in names:
        text = subprocess.run(["git", "show", f"{rev}:{name}"], capture_output=True, text=True, check=True, cwd=root).stdout
        text = re.sub(r"\b(minipd_ops|minipd_vec|minipd_elements)\b", r"\1_then", text)
        text = re.sub(r"TORCH_LIBRARY(_FRAGMENT|_IMPL)?\(minipd,", r"TORCH_LIBRARY\1(minipd_then,", text)
        (folder / Path(name).name).write_text(text)
    try:
        load(name="minipd_kernels_then", sources=[str(p) for p in sorted(folder.glob("*.cpp"))],
             extra_cflags=kernel_build.cflags(), build_directory=str(folder), is_python_module=False)  # fmt: skip
    finally:
        shutil.rmtree(folder)  # once loaded, the library needs no file
    return torch.ops.minipd_then


if __name__ == "__main__":
    main()
