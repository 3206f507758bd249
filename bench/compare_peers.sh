#!/bin/sh
# ddpdiag side by side with torch.distributed and bare Gloo on this machine:
# all_reduce (2 and 4 ranks, 4 B to 256 MiB), the DDP reducer against PyTorch
# DDP, rendezvous of 256 and 1024 clients against torch's TCPStore, and store
# throughput. Prints tables with ratio columns and a verdict per target, and
# writes a JSON report (default compare-peers.json) for `ddpdiag report render`.
#
#   bench/compare_peers.sh [--build-dir build] [--json FILE] [--quick]
#                          [--ranks 2,4] [--max-bytes 256M] [--repeats 3] ...
#   bench/compare_peers.sh --help
#
# PYTHON selects the interpreter with torch 1.13 (default: Debian's
# /usr/bin/python3). Exit 77 when it has no torch 1.13.
PYTHON=${PYTHON:-/usr/bin/python3}
if ! [ -x "$PYTHON" ]; then
  echo "SKIP: no Python at $PYTHON (install python3-torch, or set PYTHON)"
  exit 77
fi
exec "$PYTHON" "$(dirname "$0")/compare_peers.py" --python "$PYTHON" "$@"
