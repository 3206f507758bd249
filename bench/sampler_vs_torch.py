#!/usr/bin/env python3
"""DistributedSampler speed: torch against `ddpdiag sampler`, same indices.

torch: list(iter(DistributedSampler(range(N), R, rank, seed=s))) with
set_epoch(e), as a training loop consumes it. ddpdiag: `ddpdiag sampler ...
--benchmark` (generates the same list in memory, prints indices/s), timed
inside the process and, for fairness, also as the whole process wall time.
Both produce one rank's indices; the checksums (sum of indices) must agree.

Usage: bench/sampler_vs_torch.py [--bin build/diag/ddpdiag] [--n 100000000]
         [--world-size 8] [--rank 0] [--seed 0] [--epoch 0] [--repeat 3]
Run with the interpreter that has torch (/usr/bin/python3 for 1.13).
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=os.environ.get("DDPDIAG_BIN", "build/diag/ddpdiag"))
    ap.add_argument("--n", type=int, default=100_000_000)
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--epoch", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--torch-threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    args = ap.parse_args()

    import torch
    from torch.utils.data.distributed import DistributedSampler

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    version = "2.x" if int(torch.__version__.split(".")[0]) >= 2 else "1.13"
    count = None

    torch_times, torch_sum = [], None
    for _ in range(args.repeat):
        s = DistributedSampler(range(args.n), num_replicas=args.world_size, rank=args.rank, seed=args.seed)
        s.set_epoch(args.epoch)
        t0 = time.perf_counter()
        idx = list(iter(s))
        torch_times.append(time.perf_counter() - t0)
        count = len(idx)
        torch_sum = sum(idx)
        del idx

    ours_inner, ours_wall, ours_sum = [], [], None
    cmd = [args.bin, "sampler", "--dataset-size", str(args.n), "--world-size", str(args.world_size),
           "--rank", str(args.rank), f"--seed={args.seed}", "--epoch", str(args.epoch),
           "--torch-version", version, "--benchmark"]
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True, check=True)
        ours_wall.append(time.perf_counter() - t0)
        m = re.search(r"in ([0-9.]+) s, .* \(checksum (\d+)\)", p.stdout)
        if not m:
            sys.exit(f"unexpected output from ddpdiag: {p.stdout!r} {p.stderr!r}")
        ours_inner.append(float(m.group(1)))
        ours_sum = int(m.group(2))

    if ours_sum != torch_sum % 2 ** 64:
        sys.exit(f"MISMATCH: checksum torch {torch_sum} vs ddpdiag {ours_sum}")
    t, oi, ow = statistics.median(torch_times), statistics.median(ours_inner), statistics.median(ours_wall)
    print(f"N={args.n} R={args.world_size} rank={args.rank}: {count} indices per rank, torch {torch.__version__}")
    print(f"torch DistributedSampler : {t:8.3f} s  {count / t:12.4g} indices/s")
    print(f"ddpdiag (in process)     : {oi:8.3f} s  {count / oi:12.4g} indices/s")
    print(f"ddpdiag (whole process)  : {ow:8.3f} s  {count / ow:12.4g} indices/s")
    print(f"speed-up: {t / oi:.2f}x (in process), {t / ow:.2f}x (whole process); checksums agree")


if __name__ == "__main__":
    main()
