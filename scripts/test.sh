#!/usr/bin/env bash
# Builds ddpdiag (build/) and runs the whole test suite: Catch2 unit tests,
# multi-process tests through the launcher, and the PyTorch compatibility
# tests (1.13 from Debian; 2.x from .venv-torch2 when installed).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
build="${BUILD_DIR:-build}"
# Ninja when it is installed (a build directory made with another generator
# keeps it) and the default unity build (CMakeLists.txt): on 2 cores this
# halves the build (~150 s instead of ~260 s with make and one unit per
# source). DDPDIAG_UNITY=0 builds every source on its own.
gen=()
if [ ! -f "$build/CMakeCache.txt" ] && command -v ninja >/dev/null; then gen=(-G Ninja); fi
unity=(-DCMAKE_UNITY_BUILD=ON)
[ "${DDPDIAG_UNITY:-1}" != 0 ] || unity=(-DCMAKE_UNITY_BUILD=OFF)
cmake "${gen[@]}" -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo "${unity[@]}" >/dev/null
cmake --build "$build" -j"$(nproc)"
built=$SECONDS
# Twice as many tests at a time as cores: most multi-process tests spend
# their time waiting on deadlines, not on the CPU (on 2 cores: ~220 s at 4,
# ~400 s at 2). The entries that compare timings run alone (RUN_SERIAL in
# tests/CMakeLists.txt). At most 8: more multi-process tests at once would
# only make their deadlines tight. CTEST_JOBS=1 runs them one by one.
jobs=$((2 * $(nproc)))
((jobs <= 8)) || jobs=8
rc=0
ctest --test-dir "$build" --output-on-failure -j"${CTEST_JOBS:-$jobs}" "$@" || rc=$?
echo "test.sh: configure and build ${built} s, tests $((SECONDS - built)) s"
exit "$rc"
