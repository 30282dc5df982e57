#!/usr/bin/env bash
# On the GPU machine: build zerofuse with CUDA, run the doctor, the GPU tests and the GPU benchmark
# suites, and write everything to one folder (at most 8 files, so the device tool brings it back):
#   env.txt build.log doctor.txt tests.txt bench.txt bench.json summary.md
# Usage: bash bench/run_gpu.sh [OUT_DIR]   (default: $OUT, else bench/out)
# A dry run of the script's flow on a CPU machine: ZEROFUSE_CUDA=0 BENCH_DEVICE=cpu ZEROFUSE_BENCH_SMOKE=1 bash bench/run_gpu.sh /tmp/x
# Copy the folder to bench/results/<device>-<date>/ and commit it. Never write results by hand.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-bench/out}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 ZEROFUSE_TRITON_ON_CPU=0
status=0

{
  date -u +"%Y-%m-%dT%H:%M:%SZ"
  git rev-parse HEAD 2>/dev/null || true
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv || true
  python -c "import torch, triton, sys; print('python', sys.version.split()[0]); print('torch', torch.__version__, 'cuda', torch.version.cuda); print('triton', triton.__version__)"
  nvcc --version | tail -1
} > "$out/env.txt" 2>&1

echo "== build (CUDA)"
if ! MAX_JOBS=${MAX_JOBS:-16} ZEROFUSE_CUDA=${ZEROFUSE_CUDA:-1} python -m pip install --no-build-isolation --no-deps -v -e . > "$out/build.log" 2>&1; then
  tail -50 "$out/build.log"
  echo "build failed"
  exit 1
fi
grep -E "zerofuse: building|real|error" "$out/build.log" | head -5

echo "== doctor"
python -m zerofuse.doctor 2>&1 | tee "$out/doctor.txt" || status=1

echo "== GPU tests"
python -m pytest tests -m gpu -q -p no:cacheprovider 2>&1 | tee "$out/tests.txt"
rc=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] || [ "$rc" -eq 5 ] || status=1  # 5: nothing selected (a CPU dry run)

echo "== GPU benchmarks"
python -m pytest bench -q -p no:cacheprovider --bench-device "${BENCH_DEVICE:-cuda}" --benchmark-json "$out/bench.json" \
  --benchmark-columns=median,iqr,rounds --benchmark-sort=name 2>&1 | tee "$out/bench.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
[ -f "$out/bench.json" ] && python bench/summarize.py "$out/bench.json" --title "zerofuse GPU benchmarks" > "$out/summary.md"

exit $status
