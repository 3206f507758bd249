#!/usr/bin/env bash
# The GPU check: on a machine with (at least) one NVIDIA GPU, builds ddpdiag
# with CUDA and NCCL and runs, on one GPU: the GPU-tagged unit tests (NCCL
# collectives, the reducer's device kernels against the host reference bit
# for bit, the reducer on the GPU against Gloo), allreduce-test over every
# dtype and op, the device benchmarks (NCCL world-size-1 all_reduce latency
# per size, host-timed and CUDA-graph replay; bucket flatten/unflatten as a
# fraction of a device-to-device copy, target >= 0.9), the reducer's GPU path
# with a simulated backward (ddp-step), and `ddpdiag memory` on the GPU;
# writing logs, tables and JSON into OUT_DIR. Bounded: every step has a
# timeout, the whole script fits in 8 minutes. BUILD_DIR may name a build
# made beforehand (then configure and build only refresh it).
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
step build 240 cmake --build "$build" -j"$(nproc)" --target ddpdiag ddpdiag_tests ddpdiag_bench_device
bin="$build/diag/ddpdiag"
step unit_gpu 60 "$build/tests/ddpdiag_tests" "[nccl]" --reporter junit --out "$out/unit_gpu.xml"
step allreduce_nccl 120 "$bin" allreduce-test --backend nccl --nproc 1 -b 8 -e 256M -f 4 \
  -n 20 -w 5 --json "$out/allreduce_nccl.json"
cp "$out/allreduce_nccl.log" "$out/allreduce_nccl_table.txt" 2>/dev/null
step allreduce_nccl_all_types 120 "$bin" allreduce-test --backend nccl --nproc 1 -b 8 -e 1M \
  -f 32 -n 5 -w 2 -d all -o all --json "$out/allreduce_nccl_all_types.json"
step bench_device 120 "$build/bench/ddpdiag_bench_device" --json "$out/bench_device.json"
cp "$out/bench_device.log" "$out/bench_device_tables.txt" 2>/dev/null
for views in views no-views; do
  flag=""; [ "$views" = no-views ] && flag="--no-views"
  step "ddp_step_nccl_$views" 90 "$bin" ddp-step --backend nccl --nproc 1 --model resnet50 \
    --bucket-cap-mb 25 -n 20 --compute-gbps 200 $flag --json "$out/ddp_step_nccl_$views.json"
done
step ddp_step_nccl_bf16 90 "$bin" ddp-step --backend nccl --nproc 1 --model gpt2 --hook bf16 \
  -n 10 --json "$out/ddp_step_nccl_bf16.json"
step memory_nccl 90 "$bin" memory --backend nccl --nproc 1 --model gpt2 --bucket-cap-mb 25 \
  --json "$out/memory_nccl.json"
echo "gpu-check: $( [ $status -eq 0 ] && echo PASS || echo FAIL ) (details in $out)" | tee -a "$out/summary.txt"
exit $status
