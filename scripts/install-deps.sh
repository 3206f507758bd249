#!/usr/bin/env bash
# Installs what ddpdiag needs to build and test on Debian 12, idempotently:
# the Debian packages (compilers, CMake and Ninja, libraries, PyTorch 1.13 for the
# compatibility tests, iproute2 for multi-host tests, clang for the fuzzers),
# and with --torch2 a PyTorch 2.x in .venv-torch2 for the 2.x compat tests.
# Usage: scripts/install-deps.sh [--torch2]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
want_torch2=0
for a in "$@"; do
  case "$a" in
    --torch2) want_torch2=1 ;;
    -h|--help) sed -n '2,6p' "$0"; exit 0 ;;
    *) echo "install-deps: unknown argument '$a'" >&2; exit 2 ;;
  esac
done

packages=(build-essential cmake ninja-build git pkg-config libfmt-dev nlohmann-json3-dev catch2
          libbenchmark-dev libgloo-dev libcli11-dev python3 python3-venv python3-torch
          iproute2 chromium
          strace  # tests/mp/test_bench_programs.py: which rank opens --benchmark_out's file
          openmpi-bin mpich slurm-wlm  # tests/mp/test_launchers_live.py: real mpirun (Open MPI, MPICH) and srun
          clang libclang-rt-14-dev)  # scripts/test-sanitizers.sh: clang and its libFuzzer
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "install-deps: installing ${missing[*]}"
  sudo_cmd=()
  [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "install-deps: Debian packages already installed"
fi

if ((want_torch2)); then
  "$here/install-torch2.sh"
fi
