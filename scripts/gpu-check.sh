#!/usr/bin/env bash
# The GPU check: on a machine with (at least) one NVIDIA GPU, builds ddpdiag
# with CUDA and NCCL and runs the NCCL backend at world size 1 — the GPU-tagged
# unit tests and allreduce-test over every dtype and op — writing logs, tables
# and JSON reports into OUT_DIR. Bounded: every step has a timeout, the whole
# script fits in 8 minutes.
# Usage: scripts/gpu-check.sh OUT_DIR
set -uo pipefail
out="${1:?usage: scripts/gpu-check.sh OUT_DIR}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
build="${BUILD_DIR:-build-gpu}"
status=0
step() {  # step NAME TIMEOUT_S CMD...
  local name=$1 t=$2; shift 2
  echo "== $name: $*" | tee -a "$out/summary.txt"
  local t0=$SECONDS
  timeout --kill-after=10 "$t" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "   rc=$rc in $((SECONDS - t0)) s" | tee -a "$out/summary.txt"
  [ $rc -eq 0 ] || status=1
  return $rc
}

{ nvidia-smi || true; nvcc --version || true; } >"$out/machine.txt" 2>&1
step configure 120 cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DDDPDIAG_WITH_CUDA=ON \
  -DDDPDIAG_BUILD_BENCH=OFF
step build 240 cmake --build "$build" -j"$(nproc)" --target ddpdiag ddpdiag_tests
bin="$build/diag/ddpdiag"
step unit_gpu 60 "$build/tests/ddpdiag_tests" "[nccl]" --reporter junit --out "$out/unit_gpu.xml"
step allreduce_nccl 120 "$bin" allreduce-test --backend nccl --nproc 1 -b 8 -e 256M -f 4 \
  -n 20 -w 5 --json "$out/allreduce_nccl.json"
cp "$out/allreduce_nccl.log" "$out/allreduce_nccl_table.txt" 2>/dev/null
step allreduce_nccl_all_types 120 "$bin" allreduce-test --backend nccl --nproc 1 -b 8 -e 1M \
  -f 32 -n 5 -w 2 -d all -o all --json "$out/allreduce_nccl_all_types.json"
echo "gpu-check: $( [ $status -eq 0 ] && echo PASS || echo FAIL ) (details in $out)" | tee -a "$out/summary.txt"
exit $status
