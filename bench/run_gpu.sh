#!/usr/bin/env bash
# On the GPU machine: build zerofuse with CUDA, run the doctor, the GPU tests, the GPU benchmark
# suites, a host-overhead profile of small ops and a GPT-2 124M training run, and write everything
# to one folder (at most 8 files, so the device tool brings them all back):
#   env.txt (+ the doctor) build.log tests.txt bench.txt bench.json summary.md profile.txt train.txt
#
# Usage: bash bench/run_gpu.sh [OUT_DIR] [PHASES]
#   OUT_DIR  default: $OUT, else bench/out
#   PHASES   comma-separated, a subset of build,doctor,tests,train,profile,bench (default: all);
#            they always run in that order, whatever order PHASES lists them in. A lease's device
#            time is 15 minutes (machine start included: ~2-4 min), a call at most 10, and the
#            machine stays warm only 30 s after one. Estimates (an H200 on 2026-11-26 and
#            2026-11-27): build+doctor ~2-4 min (the doctor's first attention call autotuned:
#            44-78 s; it runs one pinned tile config since 2026-11-27, unmeasured), tests ~3.5-5 min
#            (correctness first: much GPU code has never run), train ~3.5 min (the step graphed and
#            eager, the torch-native peer eager and compiled; PEER_COMPILE=0 saves ~1.5 min, a
#            single TRAIN_MODES ~1 min), profile ~2 min, the bench suites ~8-10 min in all (attention
#            ~2.5, norms ~1.5, llama_ops ~2, optimizers ~1.5, hf ~1.5, the rest under 1).
#            One lease fits a start, call 1 and ~2-6 min of call 2: not train, profile and bench
#            (a review added it up, 2026-12-06: bench got 0-55 s). Plan two calls, the second at once
#            so the machine stays warm, with ONE goal for the second:
#              1. PHASES=build,doctor,tests (timeout_s 590)
#              2. with D = min(status's budget_left_s - 45, 570): ZEROFUSE_GPU_DEADLINE_S=D, timeout_s
#                 D + 30, and either PHASES=train TRAIN_MODES=--cuda-graphs PEER_COMPILE=0 (issue 23's
#                 tokens/s) or PHASES=bench BENCH_SUITES="<the suites least measured>" (bench_llama_ops,
#                 bench_moe, bench_offload and bench_hf have no GPU results yet); it keeps to the
#                 JIT if the first call's doctor failed the handles.
#            Each finished benchmark is kept; suites not started for lack of time are listed in
#            bench.txt.
#            Without `build` the extension built by an earlier call is used; when there is none
#            (the machine went back in between) or it is stale (sources or build files changed),
#            it is built first anyway.
# Environment:
#   ZEROFUSE_GPU_DEADLINE_S  seconds the whole script may take (default 560); every phase runs
#                            under `timeout` with what is left, so a slow phase is cut and the
#                            files of the phases before it still come back (a phase cut at
#                            it gets 30 s more to end: give the device call's timeout that margin)
#   BENCH_SUITES             bench files to run (default: the GPU suites below, default_suites:
#                            attention, norms, llama ops, moe, offload, optimizers, flatten,
#                            comm_gpu, hf; not collectives, pipeline, tp, zero: CPU/gloo suites)
#   TRAIN_ARGS               extra zerofuse-train flags (default: 60 steps of gpt2-124m, bf16)
#   TRAIN_MODES              the step's modes to train (default: "--cuda-graphs --no-cuda-graphs")
#   PEER_ARGS                flags for bench/peer_step.py, the torch-native peer (default: GPT-2 small, batch 16)
#   PYTHON                   interpreter (default python3: the GPU image has no plain `python`)
# Ways back for code first run on a GPU there (each recorded in env.txt when set):
#   ZEROFUSE_TRITON_LAUNCH=jit        Triton launches through the JIT, not launch handles (set by this
#                                     script when the doctor's handle check fails)
#   ZEROFUSE_ONE_LAUNCH_FLOATS=0      the norms'/bias-GELU's column sums in a second launch
#   ZEROFUSE_OPTIM_GRID, ZEROFUSE_LAMB_ONE_LAUNCH  the optimizer kernels' grid and LAMB's form
# A dry run of the flow on a CPU machine (smoke sizes, no CUDA build, a tiny model):
#   PYTHON=python ZEROFUSE_CUDA=0 BENCH_DEVICE=cpu ZEROFUSE_BENCH_SMOKE=1 TRAIN_DEVICE=cpu \
#     TRAIN_ARGS="--model tiny --steps 5 --nproc 1" PEER_ARGS="--dim 64 --layers 2 --heads 2 --seq 32 \
#     --vocab 128 --batch 2 --steps 3 --warmup 1" bash bench/run_gpu.sh /tmp/x
# Peers the GPU image lacks (Liger-Kernel) travel as wheels: run bench/fetch_gpu_wheels.sh here first
# and name ".whl" in the device call's carry; this script installs them into /tmp/site.
# Copy the folder to bench/results/<device>-<date>/ and commit it. Never write results by hand.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-bench/out}}
phases=",${2:-build,doctor,tests,train,profile,bench},"
default_suites="bench/bench_attention.py bench/bench_norms.py bench/bench_llama_ops.py bench/bench_moe.py
  bench/bench_offload.py bench/bench_optimizers.py bench/bench_flatten.py bench/bench_comm_gpu.py bench/bench_hf.py"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 ZEROFUSE_TRITON_ON_CPU=0
py=${PYTHON:-python3}
deadline=$(( $(date +%s) + ${ZEROFUSE_GPU_DEADLINE_S:-560} ))
status=0

want() { [[ "$phases" == *",$1,"* ]]; }
# Seconds left before the deadline, less a margin for writing the summary.
left() { echo $(( deadline - $(date +%s) - 15 )); }
# run_phase NAME CMD...: the command under `timeout` with the time left. Returns 124 when it was
# cut at the deadline (also when the INT did not end it and the KILL did: timeout's 137),
# SKIPPED when there was no time to start it.
SKIPPED=125
run_phase() {
  local name=$1 t
  shift
  t=$(left)
  if [ "$t" -le 10 ]; then
    echo "== $name: skipped, no time left before the deadline"
    status=1
    return $SKIPPED
  fi
  echo "== $name (at most ${t}s)"
  timeout --signal=INT --kill-after=30 "$t" "$@"  # (30 s for pytest to print its summary after the INT)
  local rc=$?
  # 137 at the deadline: the INT did not end it within 30 s and the KILL did (2026-11-27's tests
  # and bench); 137 before it is a kill from elsewhere (out of memory), reported as it is
  if [ "$rc" -eq 124 ] || { [ "$rc" -eq 137 ] && [ "$(left)" -le 0 ]; }; then
    echo "== $name: cut at the deadline$([ "$rc" -eq 137 ] && echo ' (killed: the INT did not end it)')"
    rc=124
  fi
  return $rc
}

# peers carried as wheels (bench/fetch_gpu_wheels.sh: Liger-Kernel), installed where nothing else looks
if ls .whl/*.whl > /dev/null 2>&1; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >> "$out/env.txt" 2>&1 && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi

{
  date -u +"%Y-%m-%dT%H:%M:%SZ"
  git rev-parse HEAD 2>/dev/null || true
  git status --short 2>/dev/null | head -20
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv || true
  "$py" -c "import torch, triton, sys; print('python', sys.version.split()[0]); print('torch', torch.__version__, 'cuda', torch.version.cuda); print('triton', triton.__version__)"
  nvcc --version | tail -1
  echo "phases: $phases"
  env | grep '^ZEROFUSE_' | sort  # the switches a run was measured under (launch path, optimizer grid, ...)
  echo "carried wheels: $(ls .whl/*.whl 2>/dev/null | xargs -r -n1 basename | tr '\n' ' ')"
  "$py" -c "import liger_kernel, importlib.metadata as m; print('liger-kernel', m.version('liger-kernel'))" 2>/dev/null \
    || echo "liger-kernel: not installed (bench/fetch_gpu_wheels.sh, carry .whl)"
} >> "$out/env.txt" 2>&1

# (a stale extension imports too, with a warning: a second call's train or bench measured the old
# kernels under the new commit's env.txt; a review's reproduction, 2026-12-07)
if ! want build && ! "$py" -W ignore -c "import sys, zerofuse; from zerofuse import _loader; sys.exit(1 if _loader.warn_if_stale() else 0)" 2>/dev/null; then
  echo "== no built extension here (a fresh machine?), or a stale one: building first"
  phases="$phases,build,"
fi

if want build; then
  # pip -e rebuilds only what changed when the build tree from an earlier call is still there
  if ! MAX_JOBS=${MAX_JOBS:-16} ZEROFUSE_CUDA=${ZEROFUSE_CUDA:-1} run_phase build \
      "$py" -m pip install --no-build-isolation --no-deps -v -e . >> "$out/build.log" 2>&1; then
    tail -50 "$out/build.log"
    echo "build failed"
    exit 1
  fi
  grep -E "zerofuse: building|error" "$out/build.log" | tail -5
fi

if want doctor; then
  # (its log in a temporary folder, not in $out: appended to env.txt, and a ninth file there was more
  # than the device tool brings back)
  doctor_log="$(mktemp -d)/doctor.log"
  run_phase doctor "$py" -m zerofuse.doctor 2>&1 | tee "$doctor_log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  cat "$doctor_log" >> "$out/env.txt"
  # the doctor runs every op again through Triton launch handles (kernels/launch.py, on by default,
  # first run on a GPU here): if they fail only that way, the rest of the run uses the JIT. This
  # run's doctor only (env.txt is appended to: a reused out dir's earlier FAILED line switched a
  # passing run to the JIT; a review's reproduction, 2026-12-07)
  if grep -q "^launch handles: FAILED" "$doctor_log"; then
    export ZEROFUSE_TRITON_LAUNCH=jit
    mkdir -p build && touch build/zerofuse-handles-failed  # (ignored; kept for the next call on this machine)
    echo "== launch handles failed the doctor: the rest of this run launches through the JIT (ZEROFUSE_TRITON_LAUNCH=jit)" \
      | tee -a "$out/env.txt"
  else
    rm -f build/zerofuse-handles-failed
  fi
elif [ -e build/zerofuse-handles-failed ]; then  # an earlier call's doctor on this machine
  export ZEROFUSE_TRITON_LAUNCH=jit
  echo "== launch handles failed an earlier call's doctor here: launching through the JIT" | tee -a "$out/env.txt"
fi

if want tests; then
  # under xdist a test that crashes its process (a segfault in native code) fails alone
  # (loadgroup: the tests of one xdist_group run one after another, e.g. test_large_offsets' ~30 GB ones)
  # -v: each test's outcome by name as it ends (-q names them only in the final summary, which a
  # run cut at the deadline never writes: 2026-11-27's two failures were left unnamed)
  xdist=$("$py" -c "import xdist" 2>/dev/null && echo "-n ${TEST_WORKERS:-6} --dist loadgroup")
  # shellcheck disable=SC2086
  run_phase tests "$py" -m pytest tests -m gpu $xdist -v -p no:cacheprovider --timeout 300 -rfEs \
    -W ignore::pytest_benchmark.logger.PytestBenchmarkWarning 2>&1 | tee -a "$out/tests.txt"
  rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || [ "$rc" -eq 5 ] || status=1  # 5: nothing selected (a CPU dry run)
fi

if want train; then
  # the step eager and as a CUDA graph (--cuda-graphs is the default where the step can be captured)
  for mode in ${TRAIN_MODES:---cuda-graphs --no-cuda-graphs}; do
    tdir=$(mktemp -d)
    echo "== train $mode" >> "$out/train.txt"
    # shellcheck disable=SC2086
    run_phase "train $mode" "$py" -m zerofuse.train --device "${TRAIN_DEVICE:-cuda}" --out "$tdir" --sample-tokens 0 \
      ${TRAIN_ARGS:---model gpt2-124m --batch 16 --steps 60 --warmup 10 --eval-every 0 --eval-batches 2 --log-every 10} \
      $mode 2>&1 | tee -a "$out/train.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    { echo "== summary.json ($mode)"; cat "$tdir/summary.json" 2>/dev/null || echo "(none)"; } >> "$out/train.txt"
  done
  # the torch-native peer of the same step (nn modules, SDPA, fused AdamW), eager and compiled
  compiled=$([ "${PEER_COMPILE:-1}" = 1 ] && echo --compile)  # the issue's peer; ~1.5 min (PEER_COMPILE=0: not)
  for peer in "" $compiled; do
    echo "== peer_step $peer" >> "$out/train.txt"
    # shellcheck disable=SC2086
    run_phase "peer $peer" "$py" bench/peer_step.py --device "${TRAIN_DEVICE:-cuda}" $peer ${PEER_ARGS:-} \
      2>&1 | tee -a "$out/train.txt" | tail -1
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  done
fi

if want profile; then
  run_phase profile "$py" bench/profile_host.py --device "${BENCH_DEVICE:-cuda}" 2>&1 | tee -a "$out/profile.txt" | grep "^==="
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  if [ "${BENCH_DEVICE:-cuda}" = cuda ]; then  # the training step under torch.profiler (headline figures last)
    for mode in --cuda-graphs --no-cuda-graphs; do
      echo "== profile_step $mode" >> "$out/profile.txt"
      run_phase profile_step "$py" bench/profile_gpu_step.py ${PROFILE_STEP_ARGS:-} -- $mode 2>&1 | tee -a "$out/profile.txt" | tail -12
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    done
  fi
fi

if want bench; then
  # one suite at a time, the finished ones merged into bench.json as they end; each benchmark's
  # result is also written the moment it ends (--bench-jsonl), so a suite cut at the deadline
  # loses only the benchmark it was in
  jdir=$(mktemp -d)
  # shellcheck disable=SC2206
  suites=(${BENCH_SUITES:-$default_suites})
  for i in "${!suites[@]}"; do
    suite=${suites[$i]}
    name=$(basename "$suite" .py)
    # shellcheck disable=SC2086
    run_phase "bench $name" "$py" -m pytest "$suite" -q -p no:cacheprovider --timeout 300 \
      --bench-device "${BENCH_DEVICE:-cuda}" --benchmark-json "$jdir/$name.json" --bench-jsonl "$jdir/$name.jsonl" \
      --benchmark-columns=median,iqr,rounds --benchmark-sort=name 2>&1 | tee -a "$out/bench.txt"
    rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || [ "$rc" -eq 5 ] || status=1
    # a cut suite is marked (pytest-benchmark may still write a .json of its finished benchmarks,
    # which read as the whole suite before); one cut before its .json still has its lines
    [ "$rc" -eq 124 ] && : > "$jdir/$name.cut"  # (a suite that ran and was cut; not one skipped)
    "$py" bench/summarize.py "$out/bench.json" --merge "$jdir"/*.json "$jdir"/*.jsonl "$jdir"/*.cut 2>/dev/null && \
      "$py" bench/summarize.py "$out/bench.json" --title "zerofuse GPU benchmarks" > "$out/summary.md"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq "$SKIPPED" ]; then  # the deadline: the suites after (or from) this one never start
      first=$(( i + (rc == 124 ? 1 : 0) ))
      [ "$first" -lt "${#suites[@]}" ] && echo "== bench: not run for lack of time: ${suites[*]:$first}" | tee -a "$out/bench.txt"
      break
    fi
  done
fi

exit $status
