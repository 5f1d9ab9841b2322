#!/usr/bin/env bash
# Build minipd's CPU kernels for ARM (aarch64) with a cross compiler and run the kernel tests
# (tests/test_cpu_kernels.py, unchanged) in an aarch64 Python under qemu-user, on an x86 Debian 12
# machine (root: it installs packages with apt). Two targets: plain NEON (armv8-a, told the CPU
# has only fp and asimd: Cortex-A72, Graviton 1), and Armv8.6 with BF16 (Neoverse V1/V2, Apple M2:
# small_linear's BFDOT path). No ARM machine needed; emulated, so it checks results, not speed
# (about 15 min on 2 cores).
#
# What comes from where: qemu-user-static and g++-aarch64-linux-gnu from Debian; an aarch64
# Python 3.11 unpacked from Debian's arm64 packages (nothing installed for arm64); aarch64 wheels
# from PyPI: torch 2.7.1, whose aarch64 wheel is a CPU build (2.13.0's needs CUDA libraries; the
# versions between were not tried), and the packages the tests import, at this machine's versions.
#
#   scripts/arm/check.sh [pytest args...]     (default: tests/test_cpu_kernels.py)
# Environment: MINIPD_ARM_DIR (default /tmp/minipd-arm) keeps the downloads between runs;
# MINIPD_ARM_TARGETS (default "armv8-a armv8.6-a"): the -march values to build and test.
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR=${MINIPD_ARM_DIR:-/tmp/minipd-arm}
TARGETS=${MINIPD_ARM_TARGETS:-armv8-a armv8.6-a}
TORCH_ARM=2.7.1
ROOT=$DIR/root SITE=$DIR/site BUILD=$DIR/build
mkdir -p "$DIR" "$BUILD"

if ! command -v qemu-aarch64-static >/dev/null || ! command -v aarch64-linux-gnu-g++ >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q qemu-user-static g++-aarch64-linux-gnu >/dev/null
fi
if [ ! -x "$ROOT/usr/bin/python3.11" ]; then
  dpkg --print-foreign-architectures | grep -qx arm64 || { dpkg --add-architecture arm64 && apt-get update -q >/dev/null; }
  mkdir -p "$DIR/debs" && (cd "$DIR/debs" && for p in python3.11 python3.11-minimal libpython3.11-minimal \
      libpython3.11-stdlib libc6 zlib1g libexpat1 libffi8 libssl3 libbz2-1.0 liblzma5 libcrypt1 libstdc++6 \
      libgcc-s1 libgomp1 libsqlite3-0 libuuid1 libncursesw6 libtinfo6 libreadline8; do
    apt-get download -q "$p:arm64" >/dev/null 2>&1; done)
  for d in "$DIR"/debs/*.deb; do dpkg -x "$d" "$ROOT"; done
fi
if [ ! -d "$SITE/torch" ]; then
  pip freeze 2>/dev/null | grep "==" | grep -viE "^(torch|nvidia|minipd|triton)" >"$DIR/requirements.txt"
  pip install -q --no-deps --target "$SITE" --implementation cp --python-version 3.11 --only-binary=:all: \
    --platform manylinux_2_28_aarch64 --platform manylinux_2_17_aarch64 --platform manylinux2014_aarch64 \
    --platform linux_aarch64 "torch==$TORCH_ARM" -r "$DIR/requirements.txt" 2>&1 | { grep -v WARNING || true; }  # pip's failure still stops the script
fi
arm_python() {
  PYTHONPATH="$SITE:$PWD:$PWD/scripts/arm" qemu-aarch64-static -L "$ROOT" "$ROOT/usr/bin/python3.11" "$@"
}

# The kernels, with kernel_build's flags (its -march=native names this machine's CPU, not the target)
read -r -a BASE_CFLAGS < <(python -c "from minipd.models.kernel_build import CFLAGS; print(*CFLAGS)")
[ $# -gt 0 ] || set -- tests/test_cpu_kernels.py
T=$SITE/torch
for march in $TARGETS; do
  CFLAGS=("${BASE_CFLAGS[@]/-march=native/-march=$march}") jobs=() out=$BUILD/$march
  mkdir -p "$out"
  echo "== $march: cross-compiling minipd/models/csrc for aarch64 (${CFLAGS[*]})"
  for src in minipd/models/csrc/*.cpp; do
    aarch64-linux-gnu-g++ -c "${CFLAGS[@]}" -fPIC -std=c++17 -D_GLIBCXX_USE_CXX11_ABI=1 -Werror=div-by-zero \
      -isystem "$T/include" -isystem "$T/include/torch/csrc/api/include" "$src" -o "$out/$(basename "$src" .cpp).o" &
    jobs+=($!)
  done
  for job in "${jobs[@]}"; do wait "$job"; done
  aarch64-linux-gnu-g++ -shared "$out"/*.o -L"$T/lib" -lc10 -ltorch_cpu -ltorch -Wl,--allow-shlib-undefined \
    -o "$out/minipd_cpu_kernels.so"
  features=""  # the emulated CPU's own (all of them)
  [ "$march" = armv8-a ] && features="fp asimd"
  echo "== $march: pytest $* under qemu-aarch64"
  MINIPD_ARM_LIBRARY=$out/minipd_cpu_kernels.so MINIPD_ARM_FEATURES=$features TORCH_EXTENSIONS_DIR=$DIR/extensions/$march \
    arm_python -m pytest -p qemu_plugin -p no:cacheprovider -q "$@"
done
