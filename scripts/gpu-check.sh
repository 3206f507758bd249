#!/usr/bin/env bash
# The GPU check: on a machine with (at least) one NVIDIA GPU, runs on one GPU:
# the GPU-tagged unit tests (NCCL collectives, the reducer's device kernels
# against the host reference bit for bit, the reducer on the GPU against
# Gloo), allreduce-test over every dtype and op, the device benchmarks (NCCL
# world-size-1 all_reduce per size, host-timed and CUDA-graph replay;
# bucket flatten/unflatten as a fraction of a device-to-device copy, target
# >= 0.9), the reducer's GPU path with a simulated backward (ddp-step),
# `ddpdiag memory` on the GPU, and two ranks given the same GPU (refused with
# exit 2 naming both; skipped on a GPU in Exclusive_Process compute mode);
# writing logs, tables and JSON into OUT_DIR. The unit step sets
# DDPDIAG_REQUIRE_GPU=1: a GPU case that finds no GPU fails, not skips.
# machine.txt and the summary give the driver (a note where it is older than
# CUDA 13's 580) and the compute mode.
#
# What the figures are: everything runs at one rank, where NCCL runs no
# all_reduce kernel (out of place it copies send to receive, in place it does
# nothing; busbw is 0 by definition). The allreduce-test steps therefore check
# correctness and NCCL's code path, not bandwidth: the size sweep is out of
# place only (--no-in-place), its algbw that of a device-to-device copy; the
# all-dtype/op step keeps in place for correctness (allreduce-test warns
# in_place_no_work there). bench_device's NCCL table times out of place (a
# copy per op) and shows in place as launch overhead only. Its flatten and
# unflatten GB/s count the bucket's bytes once (as its memcpy GB/s do, though
# a device-to-device copy reads and writes them); every ratio to the copy
# must be >= 0.9, else that step fails (bench exit 1) and the summary says
# "flatten/unflatten target NOT met" with the worst ratio and its bucket; the
# worst ratio is in the summary either way.
#
# The programs come from one of:
# - a prebuilt bundle (scripts/gpu-bundle.sh): BUNDLE_DIR, or .gpu-bundle at
#   the repository root when it holds one. A bundle built from other sources
#   than this tree's (scripts/source-hash.sh) is reported as STALE and the
#   check FAILs (after running). Nothing is compiled; the programs
#   run with the bundle's libraries first on LD_LIBRARY_PATH (lib/, then its
#   C++ runtime cxxrt/), then the folder holding libnccl.so.2, taken from
#   NCCL_LIB_DIR, else the Python package nvidia-nccl (nvidia/nccl/lib), else
#   /usr/local/cuda/lib64, else ldconfig. `ldd -r` of each program goes to
#   ldd.txt first; where the bundle's C++ runtime cannot load (a glibc older
#   than it needs) the machine's own is tried instead; a library still not
#   found, a glibc too old or a symbol missing (an NCCL older than the build's)
#   stops the check there.
# - otherwise a build from source with CUDA and NCCL into BUILD_DIR (default
#   build-gpu; a build made beforehand is only refreshed). That needs cmake
#   and ddpdiag's dependencies (Gloo, fmt, CLI11, nlohmann-json), which a GPU
#   machine lent for a few minutes usually lacks: without them (and without
#   a configured BUILD_DIR) the check stops at once, saying so in one line of
#   the summary ("no prebuilt bundle and no gloo/fmt on this machine: ..."),
#   rather than fail a configure step. Make the bundle on a machine that has
#   them (scripts/gpu-bundle.sh writes .gpu-bundle/), then copy it with the
#   tree: it is git-ignored, so a copy of the tracked files leaves it behind.
# machine.txt records the GPU, the toolkit, glibc and the libnccl used.
#
# Bounded: every step has a timeout and the whole script ends within 8
# minutes (GPU_CHECK_BUDGET_S, default 450 s; steps that would start too late
# are skipped and count as failures). At the end everything in OUT_DIR but
# summary.txt is packed into results.tar.gz, and only summary.txt,
# results.tar.gz, machine.txt, ldd.txt, unit_gpu.xml, allreduce_nccl_table.txt
# and bench_device_tables.txt are left beside it. OUT_DIR must be new, empty
# or an earlier gpu-check's output (which is replaced).
# Usage: [BUNDLE_DIR=DIR] scripts/gpu-check.sh OUT_DIR
set -uo pipefail
t_end=$((SECONDS + ${GPU_CHECK_BUDGET_S:-450}))
out="${1:?usage: scripts/gpu-check.sh OUT_DIR}"
mkdir -p "$out" || exit 2
out="$(cd "$out" && pwd)"
if [ -n "$(ls -A "$out")" ] && [ ! -f "$out/summary.txt" ]; then
  echo "gpu-check: $out holds other files; give a new or empty OUT_DIR (it is packed and pruned at the end)" >&2
  exit 2
fi
find "$out" -mindepth 1 -maxdepth 1 -exec rm -rf {} +
bundle=""
if [ -n "${BUNDLE_DIR:-}" ]; then
  bundle="$(cd "$BUNDLE_DIR" 2>/dev/null && pwd)" || bundle="$BUNDLE_DIR"
fi
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
[ -z "$bundle" ] && [ -f .gpu-bundle/MANIFEST.txt ] && bundle="$PWD/.gpu-bundle"
status=0
keep=(summary.txt results.tar.gz machine.txt ldd.txt unit_gpu.xml allreduce_nccl_table.txt
      bench_device_tables.txt)

say() { echo "$*" | tee -a "$out/summary.txt"; }
# finish: the verdict, then pack OUT_DIR into results.tar.gz and keep only
# the files in keep beside it; exits with the check's status.
finishing=0
finish() {
  [ $finishing -eq 0 ] || exit 1
  finishing=1
  say "gpu-check: $( [ $status -eq 0 ] && echo PASS || echo FAIL ) in $SECONDS s (details in $out/results.tar.gz)"
  local tmp
  if ! { tmp="$(mktemp -d)" &&
         timeout 10 tar -C "$out" --exclude=./summary.txt -czf "$tmp/results.tar.gz" . &&
         mv "$tmp/results.tar.gz" "$out/results.tar.gz"; }; then
    say "gpu-check: packing $out failed; its files are left as they are"
  else
    local prune=(find "$out" -mindepth 1 -maxdepth 1)
    for f in "${keep[@]}"; do prune+=(! -name "$f"); done
    "${prune[@]}" -exec rm -rf {} +
  fi
  [ -z "${tmp:-}" ] || rm -rf "$tmp"
  for f in "${keep[@]}"; do
    [ ! -f "$out/$f" ] || [ "$(stat -c %s "$out/$f")" -le $((16 * 1048576)) ] ||
      say "gpu-check: note: $f is over 16 MiB"
  done
  exit $status
}
# On INT or TERM: stop the running step (timeout forwards the signal to it),
# then pack what there is.
child=""
trap 'status=1; [ -z "$child" ] || kill -TERM "$child" 2>/dev/null; say "gpu-check: interrupted"; finish' INT TERM
step() {  # step NAME TIMEOUT_S CMD...
  local name=$1 t=$2; shift 2
  local left=$((t_end - SECONDS - 15))  # 10 s for --kill-after, 5 s for packing
  if [ $left -lt 5 ]; then
    say "== $name: skipped, out of time"
    status=1
    return 1
  fi
  [ "$t" -le $left ] || t=$left
  say "== $name: $*"
  local t0=$SECONDS
  # In the background, so that a signal to this script is handled at once.
  timeout --kill-after=10 "$t" "$@" >"$out/$name.log" 2>&1 </dev/null &
  child=$!
  wait "$child"
  local rc=$?
  child=""
  say "   rc=$rc in $((SECONDS - t0)) s"
  [ $rc -eq 0 ] || status=1
  return $rc
}
# nccl_version LIB: the version of a libnccl.so (ncclGetVersion, else the
# version string inside it).
nccl_version() {
  local v=""
  if command -v python3 >/dev/null; then
    v="$(timeout 20 python3 -c '
import ctypes, sys
c = ctypes.c_int()
ctypes.CDLL(sys.argv[1]).ncclGetVersion(ctypes.byref(c))
c = c.value
print("%d.%d.%d" % ((c // 10000, c % 10000 // 100, c % 100) if c >= 10000 else
                     (c // 1000, c % 1000 // 100, c % 100)))' "$1" 2>/dev/null)"
  fi
  [ -n "$v" ] || v="$(timeout 30 grep -a -o -m1 'NCCL version [0-9][0-9.]*[^ ]*' "$1" 2>/dev/null |
                      head -n1 | sed 's/^NCCL version //')"
  echo "${v:-unknown}"
}

{
  echo "== nvidia-smi"; timeout 20 nvidia-smi 2>&1 || true
  echo "== nvcc"; timeout 10 nvcc --version 2>&1 || true
  echo "== glibc"; timeout 10 ldd --version 2>&1 | head -n1 || true
} >"$out/machine.txt"

# The driver and the GPU's compute mode, said before any step: CUDA 13 needs
# a driver of branch 580 or newer (on an older one every step fails with
# "CUDA driver version is insufficient", unless the machine has CUDA's
# forward-compatibility package, so this is a note, not a stop), and a GPU in
# Exclusive_Process mode takes one process at a time (two_ranks_one_gpu
# cannot run there and is skipped).
driver="$(timeout 20 nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n1 | tr -d ' ')"
compute_mode="$(timeout 20 nvidia-smi --query-gpu=compute_mode --format=csv,noheader 2>/dev/null | head -n1 | tr -d ' ')"
echo "== driver ${driver:-unknown}, compute mode ${compute_mode:-unknown}" >>"$out/machine.txt"
if [ -z "$driver" ]; then
  say "gpu-check: nvidia-smi gives no driver version: no driver or no GPU here? (see machine.txt)"
elif [[ "$driver" =~ ^[0-9]+ ]] && [ "${BASH_REMATCH[0]}" -lt 580 ]; then
  say "gpu-check: driver $driver is older than CUDA 13 needs (580 or newer): expect every step to fail with 'CUDA driver version is insufficient' unless CUDA's forward-compatibility libraries are installed"
fi

if [ -n "$bundle" ]; then
  if [ ! -f "$bundle/MANIFEST.txt" ] || [ ! -e "$bundle/bin/ddpdiag" ]; then
    status=1
    say "gpu-check: BUNDLE_DIR=$bundle holds no bundle (make one with scripts/gpu-bundle.sh)"
    finish
  fi
  say "gpu-check: prebuilt bundle $bundle ($(sed -n 's/^commit: //p' "$bundle/MANIFEST.txt" | cut -c1-12), dirty: $(sed -n 's/^dirty: \([a-z]*\).*/\1/p' "$bundle/MANIFEST.txt"), needs $(head -n1 "$bundle/glibc-needed.txt" 2>/dev/null))"
  # A bundle built from other sources than this tree's tests other code:
  # the check still runs (its figures are worth having) but cannot PASS.
  built_from="$(sed -n 's/^sources: //p' "$bundle/MANIFEST.txt")"
  here="$(timeout 30 scripts/source-hash.sh 2>/dev/null)"
  if [ -z "$built_from" ] || [ "$built_from" != "$here" ]; then
    status=1
    say "gpu-check: STALE BUNDLE: built from sources ${built_from:-(not recorded)}, this tree's are ${here:-(unknown)}; rebuild it with scripts/gpu-bundle.sh. The check runs, but cannot pass"
  fi
  bin="$bundle/bin/ddpdiag" tests="$bundle/bin/ddpdiag_tests"
  bench_device="$bundle/bin/ddpdiag_bench_device"
  for b in "$bin" "$tests" "$bench_device"; do [ -x "$b" ] || chmod +x "$b" 2>/dev/null; done
  # The folder holding libnccl.so.2.
  nccl_dir="" nccl_from=""
  if [ -n "${NCCL_LIB_DIR:-}" ]; then
    if [ -e "$NCCL_LIB_DIR/libnccl.so.2" ]; then
      nccl_dir="$NCCL_LIB_DIR" nccl_from="NCCL_LIB_DIR"
    else
      say "gpu-check: NCCL_LIB_DIR=$NCCL_LIB_DIR has no libnccl.so.2; looking elsewhere"
    fi
  fi
  if [ -z "$nccl_dir" ] && command -v python3 >/dev/null; then
    # nvidia and nvidia.nccl may be namespace packages (no __init__.py):
    # search every folder of the package, then every site-packages.
    nccl_dir="$(timeout 30 python3 -c '
import importlib.util, os, site
dirs = []
try:
    spec = importlib.util.find_spec("nvidia.nccl")
except Exception:
    spec = None
if spec is not None:
    dirs += list(spec.submodule_search_locations or [])
    if spec.origin and os.path.isfile(spec.origin):
        dirs.append(os.path.dirname(spec.origin))
try:
    sites = site.getsitepackages() + [site.getusersitepackages()]
except Exception:
    sites = []
dirs += [os.path.join(s, "nvidia", "nccl") for s in sites]
for d in dirs:
    lib = os.path.realpath(os.path.join(d, "lib"))
    if os.path.exists(os.path.join(lib, "libnccl.so.2")):
        print(lib)
        break' 2>/dev/null)"
    [ -z "$nccl_dir" ] || nccl_from="python3 package nvidia.nccl"
  fi
  if [ -z "$nccl_dir" ] && [ -e /usr/local/cuda/lib64/libnccl.so.2 ]; then
    nccl_dir=/usr/local/cuda/lib64 nccl_from="/usr/local/cuda/lib64"
  fi
  if [ -z "$nccl_dir" ]; then
    ldconfig="$(command -v ldconfig || echo /sbin/ldconfig)"
    nccl_dir="$(timeout 10 "$ldconfig" -p 2>/dev/null |
                awk '$1 == "libnccl.so.2" && /x86-64/ {print $NF; exit}')"
    nccl_dir="${nccl_dir%/*}"
    [ -z "$nccl_dir" ] || nccl_from="ldconfig -p"
  fi
  if [ -n "$nccl_dir" ]; then
    nccl_dir="$(cd "$nccl_dir" && pwd -P)"
    nccl_line="libnccl: $nccl_dir/libnccl.so.2 (from $nccl_from), version $(nccl_version "$nccl_dir/libnccl.so.2")"
  else
    nccl_line="libnccl: no libnccl.so.2 found (NCCL_LIB_DIR, python3 nvidia.nccl, /usr/local/cuda/lib64, ldconfig -p)"
  fi
  say "gpu-check: $nccl_line"
  echo "== $nccl_line" >>"$out/machine.txt"
  # Every library must resolve before anything runs: with the bundle's C++
  # runtime, else with the machine's.
  system_path="${LD_LIBRARY_PATH:-}"
  ldd_ok=0 tries=0
  for cxx in bundle machine; do
    libs="$bundle/lib"
    [ $cxx = machine ] || libs+=":$bundle/cxxrt"
    export LD_LIBRARY_PATH="$libs${nccl_dir:+:$nccl_dir}${system_path:+:$system_path}"
    command -v ldd >/dev/null || { ldd_ok=1; echo "ldd is not available here" >"$out/ldd.txt"; break; }
    tries=$((tries + 1))
    {
      echo "=== C++ runtime: the $cxx's; LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
      for b in "$bin" "$tests" "$bench_device"; do
        echo "== $b"
        timeout 30 ldd -r "$b" 2>&1 || echo "ldd failed: rc=$?"
      done
    } >"$out/ldd.try$tries.txt"
    cat "$out/ldd.try$tries.txt" >>"$out/ldd.txt"
    if ! grep -E -q 'not found|GLIBC_|undefined symbol|ldd failed|not a dynamic' "$out/ldd.try$tries.txt"; then
      ldd_ok=1
      libstdcxx="$(awk '$1 == "libstdc++.so.6" {print $3; exit}' "$out/ldd.try$tries.txt")"
      break
    fi
    say "gpu-check: with the $cxx's C++ runtime the programs cannot load (ldd.txt):"
    grep -E 'not found|GLIBC_|undefined symbol|ldd failed|not a dynamic' "$out/ldd.try$tries.txt" | sort -u | head -n 10 |
      sed 's/^[[:space:]]*/   /' | tee -a "$out/summary.txt"
  done
  rm -f "$out"/ldd.try*.txt
  if [ $ldd_ok -eq 0 ]; then
    status=1
    say "gpu-check: the bundle's programs cannot load here; nothing was run"
    finish
  fi
  say "gpu-check: C++ runtime: the $cxx's (${libstdcxx:-libstdc++ not listed by ldd})"
  {
    echo "== C++ runtime: the $cxx's"
    echo "== LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  } >>"$out/machine.txt"
else
  build="${BUILD_DIR:-build-gpu}"
  # A build needs cmake and the dependencies; a GPU machine with neither a
  # bundle nor them cannot build: say so in one line instead of failing
  # configure. A BUILD_DIR configured before is trusted to have them.
  if [ ! -f "$build/CMakeCache.txt" ]; then
    missing=()
    command -v cmake >/dev/null || missing+=(cmake)
    inc=(/usr/include /usr/local/include)
    IFS=: read -r -a extra <<<"${CMAKE_PREFIX_PATH:-}:${CPATH:-}"
    for p in "${extra[@]}"; do [ -z "$p" ] || inc+=("$p" "$p/include"); done
    for dep in gloo:gloo/allreduce.h fmt:fmt/core.h CLI11:CLI/CLI.hpp nlohmann-json:nlohmann/json.hpp; do
      found=0
      for d in "${inc[@]}"; do [ -f "$d/${dep#*:}" ] && { found=1; break; }; done
      [ $found -eq 1 ] || missing+=("${dep%%:*}")
    done
    if [ ${#missing[@]} -gt 0 ]; then
      status=1
      say "gpu-check: no prebuilt bundle and no gloo/fmt on this machine (missing: ${missing[*]}): run scripts/gpu-bundle.sh on a machine with ddpdiag's dependencies first and carry .gpu-bundle/ with the tree (it is git-ignored), or set BUNDLE_DIR"
      finish
    fi
  fi
  bin="$build/diag/ddpdiag" tests="$build/tests/ddpdiag_tests"
  bench_device="$build/bench/ddpdiag_bench_device"
  step configure 120 cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DDDPDIAG_WITH_CUDA=ON \
    -DDDPDIAG_BUILD_BENCH=OFF
  step build 240 cmake --build "$build" -j"$(nproc)" --target ddpdiag ddpdiag_tests ddpdiag_bench_device
  if [ -x "$bin" ] && command -v ldd >/dev/null; then
    timeout 30 ldd "$bin" "$tests" "$bench_device" >"$out/ldd.txt" 2>&1
    nccl_so="$(awk '$1 ~ /^libnccl\.so/ && $3 ~ /^\// {print $3; exit}' "$out/ldd.txt")"
    [ -z "$nccl_so" ] ||
      echo "== libnccl: $nccl_so (linked at build), version $(nccl_version "$nccl_so")" >>"$out/machine.txt"
  fi
fi

# DDPDIAG_REQUIRE_GPU=1: a GPU case that finds no usable GPU fails instead of
# skipping (tests/gpu_skip.h), so this step cannot pass having tested nothing.
step unit_gpu 150 env DDPDIAG_REQUIRE_GPU=1 "$tests" "[nccl]" --reporter junit --out "$out/unit_gpu.xml"
# At one rank NCCL does no work for an in-place sum: the size sweep is out of
# place only, and what it checks is correctness and the code path.
step allreduce_nccl 120 "$bin" allreduce-test --backend nccl --nproc 1 -b 8 -e 256M -f 4 \
  -n 20 -w 5 --no-in-place --json "$out/allreduce_nccl.json"
say "   (one rank: allreduce_nccl checks correctness and NCCL's code path, not bandwidth; its algbw is a device-to-device copy's, busbw is 0)"
cp "$out/allreduce_nccl.log" "$out/allreduce_nccl_table.txt" 2>/dev/null
reported="$(grep -o '"nccl [0-9][^"]*"' "$out/allreduce_nccl.json" 2>/dev/null | head -n1)"
[ -z "$reported" ] || echo "== NCCL reported by ddpdiag: $reported" >>"$out/machine.txt"
step allreduce_nccl_all_types 120 "$bin" allreduce-test --backend nccl --nproc 1 -b 8 -e 1M \
  -f 32 -n 5 -w 2 -d all -o all --json "$out/allreduce_nccl_all_types.json"
step bench_device 120 "$bench_device" --json "$out/bench_device.json"
cp "$out/bench_device.log" "$out/bench_device_tables.txt" 2>/dev/null
# The flatten/unflatten verdict: the worst ratio to a device-to-device copy
# of the same bytes, and where it was; under 0.9 fails the step (exit 1,
# as a failed part does; the printed line tells the two apart).
line="$(grep '^# flatten/unflatten worst ratio to memcpy: ' "$out/bench_device.log" 2>/dev/null | tail -n1)"
worst="$(sed -n 's/^# flatten\/unflatten worst ratio to memcpy: \(.*\) (target >= [0-9.]*): .*/\1/p' <<<"$line")"
if [[ "$line" == *": NOT met" ]]; then
  status=1
  say "   bench_device: flatten/unflatten target NOT met (>= 0.9 of a D2D copy of the same bytes): worst ratio ${worst:-(not printed)}"
elif [ -n "$worst" ]; then
  say "   bench_device: flatten/unflatten target met (>= 0.9 of a D2D copy of the same bytes): worst ratio $worst"
else
  say "   bench_device: flatten/unflatten not measured (see bench_device_tables.txt)"
fi
for views in views no-views; do
  flag="--no-views"; [ "$views" = views ] && flag="--gradient-as-bucket-view"
  step "ddp_step_nccl_$views" 90 "$bin" ddp-step --backend nccl --nproc 1 --model resnet50 \
    --bucket-cap-mb 25 -n 20 --compute-gbps 200 $flag --json "$out/ddp_step_nccl_$views.json"
done
step ddp_step_nccl_bf16 90 "$bin" ddp-step --backend nccl --nproc 1 --model gpt2 --hook bf16 \
  -n 10 --json "$out/ddp_step_nccl_bf16.json"
step memory_nccl 90 "$bin" memory --backend nccl --nproc 1 --model gpt2 --bucket-cap-mb 25 \
  --json "$out/memory_nccl.json"
# Two ranks given the same GPU (both LOCAL_RANK 0, each claiming a host of
# its own): both must stop with exit 2 and the message naming both ranks and
# the device, before NCCL's own "Duplicate GPU detected". Passes when they do.
if [ "$compute_mode" = Exclusive_Process ]; then
  say "== two_ranks_one_gpu: skipped, the GPU is in Exclusive_Process compute mode (one process at a time): the second rank could not use it at all"
else
  step two_ranks_one_gpu 60 bash -c '
  bin=$1 out=$2 port=$((20000 + RANDOM % 20000))
  for r in 0 1; do
    RANK=$r WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 \
      MASTER_PORT=$port "$bin" allreduce-test --backend nccl -b 8 -e 8 -n 1 -w 0 \
      --timeout 30 >"$out/two_ranks_one_gpu.rank$r.txt" 2>&1 &
    pids[$r]=$!
  done
  wait "${pids[0]}"; rc0=$?; wait "${pids[1]}"; rc1=$?
  echo "rank 0 exit $rc0, rank 1 exit $rc1"
  cat "$out"/two_ranks_one_gpu.rank*.txt
  [ "$rc0" -eq 2 ] && [ "$rc1" -eq 2 ] &&
    grep -q "ranks 0 and 1 both use the same GPU" "$out"/two_ranks_one_gpu.rank*.txt
  ' _ "$bin" "$out"
fi
finish
