#!/usr/bin/env bash
# Install a PyTorch 2.x into <repo>/.venv-torch2 for tests (no GPU needed).
#
# PyPI's default Linux torch wheel is a CUDA build whose dependencies pull
# several GB of nvidia-* wheels. This machine already has CUDA 13.0 and
# NCCL 2.28.9 in /usr/local/cuda/lib (listed in ld.so.conf), so we install
# torch with --no-deps and add only:
#   - the pure-Python deps (pinned), plus numpy (silences a warning);
#   - the three nvidia wheels whose libraries /usr/local/cuda lacks and that
#     libtorch_cuda.so links against: cuSPARSELt, NVSHMEM, cuFile
#     (torch finds them through its RPATH, no env var needed).
# torch 2.11.0 is the PyPI build for CUDA 13.0.2 + NCCL 2.28.9, i.e. exactly
# the toolkit installed here. Newer wheels link NCCL symbols that 2.28.9
# lacks (2.15.0: ncclCommResume), so they also need the nvidia-nccl wheel.
#
# Usage: scripts/install-torch2.sh            (torch 2.11.0, ~760 MB download)
#        TORCH2_VERSION=2.15.0 scripts/install-torch2.sh   (~1.1 GB)
# Idempotent: a second run with the same version only checks a stamp file.
# Env: PIP_CACHE_DIR is honoured (pip's default cache otherwise).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$REPO/.venv-torch2"
STAMP="$VENV/.ddpdiag-torch2-installed"
BASE_PYTHON="${BASE_PYTHON:-/usr/bin/python3}"
TORCH2_VERSION="${TORCH2_VERSION:-2.11.0}"

case "$TORCH2_VERSION" in
  2.11.0)
    NVIDIA_PKGS=(nvidia-cusparselt-cu13==0.8.0 nvidia-nvshmem-cu13==3.4.5
                 nvidia-cufile==1.15.1.6) ;;
  2.15.0)
    NVIDIA_PKGS=(nvidia-cusparselt-cu13==0.8.1 nvidia-nvshmem-cu13==3.7.2
                 nvidia-cufile==1.17.1.22 nvidia-nccl-cu13==2.30.7) ;;
  *)
    echo "install-torch2: no pinned nvidia wheel set for torch $TORCH2_VERSION" >&2
    echo "  (supported: 2.11.0, 2.15.0)" >&2
    exit 2 ;;
esac

# Pure-Python runtime deps of torch, pinned (all are py3 wheels or cp311
# manylinux wheels on PyPI), installed with --no-deps in the same pip call.
PY_PKGS=(typing_extensions==4.16.0 sympy==1.14.0 mpmath==1.3.0
         networkx==3.6.1 jinja2==3.1.6 markupsafe==3.0.4 filelock==4.3.1
         fsspec==2026.9.0 numpy==2.4.6)

SPEC="torch==$TORCH2_VERSION ${NVIDIA_PKGS[*]} ${PY_PKGS[*]}"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$SPEC" && -x "$VENV/bin/python" ]]; then
  echo "install-torch2: $VENV already has torch $TORCH2_VERSION; nothing to do"
  exit 0
fi

start=$(date +%s)

if [[ -e "$VENV" ]]; then
  echo "install-torch2: removing incomplete or different venv $VENV"
  rm -rf "$VENV"
fi

if ! "$BASE_PYTHON" -c 'import ensurepip, venv' 2>/dev/null; then
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
    echo "install-torch2: installing python3-venv with apt-get"
    apt-get install -y -q python3-venv || { apt-get update -q && apt-get install -y -q python3-venv; }
  else
    echo "install-torch2: $BASE_PYTHON lacks venv/ensurepip; apt-get install python3-venv as root" >&2
    exit 1
  fi
fi

echo "install-torch2: creating $VENV with $BASE_PYTHON ($("$BASE_PYTHON" --version 2>&1))"
"$BASE_PYTHON" -m venv "$VENV"

echo "install-torch2: pip install --no-deps $SPEC"
# A download cut short shows up as a hash mismatch (PyPI's index gives each
# file's sha256), which pip does not retry by itself; try up to three times,
# bypassing pip's cache after a failure so a bad copy is not reused.
attempt=1
cache_opt=()
until "$VENV/bin/python" -m pip install --disable-pip-version-check --no-input \
    --progress-bar off --only-binary=:all: --no-deps "${cache_opt[@]}" \
    "torch==$TORCH2_VERSION" "${NVIDIA_PKGS[@]}" "${PY_PKGS[@]}"; do
  if (( attempt >= 3 )); then
    echo "install-torch2: pip install failed $attempt times; check the network or PyPI" >&2
    exit 1
  fi
  attempt=$((attempt + 1))
  cache_opt=(--no-cache-dir)
  echo "install-torch2: pip install failed; trying again without pip's cache (attempt $attempt of 3)" >&2
  sleep 5
done

# Optional wrapper: not needed on this machine (ld.so.conf lists
# /usr/local/cuda-13.0/lib), but makes the venv work where the CUDA lib dir
# is not in the loader cache. torch's RPATH still wins for the nvidia wheels.
CUDA_LIB_DIR="${CUDA_LIB_DIR:-/usr/local/cuda/lib}"
cat > "$VENV/bin/ddpdiag-python" <<EOF
#!/bin/sh
# Written by scripts/install-torch2.sh: run the torch2 venv's python with the
# CUDA library dir on LD_LIBRARY_PATH.
if [ -d "$CUDA_LIB_DIR" ]; then
  LD_LIBRARY_PATH="$CUDA_LIB_DIR\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
  export LD_LIBRARY_PATH
fi
exec "$VENV/bin/python" "\$@"
EOF
chmod +x "$VENV/bin/ddpdiag-python"

echo "install-torch2: checking import"
"$VENV/bin/python" -c 'import torch, torch.distributed as dist; print("install-torch2: torch", torch.__version__, "cuda", torch.version.cuda, "distributed", dist.is_available())'

printf '%s' "$SPEC" > "$STAMP"
echo "install-torch2: done in $(( $(date +%s) - start )) s; venv size $(du -sh "$VENV" | cut -f1)"
