#!/usr/bin/env bash
# Builds ddpdiag (build/) and runs the whole test suite: Catch2 unit tests,
# multi-process tests through the launcher, and the PyTorch compatibility
# tests (1.13 from Debian; 2.x from .venv-torch2 when installed).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
build="${BUILD_DIR:-build}"
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$build" -j"$(nproc)"
ctest --test-dir "$build" --output-on-failure -j"${CTEST_JOBS:-1}" "$@"
