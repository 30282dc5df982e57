#!/usr/bin/env bash
# Fetch, on a machine with a package index, the peers' wheels the GPU machine lacks (it has no
# index; /work/.library/device/README.md): Liger-Kernel (pure Python, needs only torch and
# triton, both there). flash-attn publishes no binary wheel on the index (checked 2026-11-26:
# "no matching distribution"), so its benchmark rows are skipped and listed as absent.
# The wheels land in .whl/ (git-ignored); a device call carries them with carry=[".whl"], and
# bench/run_gpu.sh installs whatever .whl/ holds into /tmp/site before its phases.
#   bash bench/fetch_gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "liger-kernel==${LIGER_VERSION:-0.8.5}"
ls -la .whl
