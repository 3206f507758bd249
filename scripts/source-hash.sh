#!/usr/bin/env bash
# Prints one sha256 over the sources the programs are built from (C++, CUDA,
# CMake and the data files beside them, under comm/ ddp_core/ reports/ diag/
# tests/ bench/ cmake/ and the top CMakeLists.txt), with or without git:
# scripts/gpu-bundle.sh records it, scripts/gpu-check.sh compares it with the
# tree it runs in, so a bundle built from other sources is flagged.
# Usage: scripts/source-hash.sh   (from anywhere)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
find CMakeLists.txt comm ddp_core reports diag tests bench cmake -type f \
  \( -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' -o -name '*.in' \
     -o -name '*.txt' -o -name '*.json' -o -name '*.html' -o -name '*.cmake' \) -not -path '*/__pycache__/*' |
  LC_ALL=C sort | while IFS= read -r f; do printf '%s %s\n' "$(sha256sum <"$f" | cut -d' ' -f1)" "$f"; done |
  sha256sum | cut -d' ' -f1
