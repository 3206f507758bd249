"""torch.distributed's Gloo all_reduce in a timed loop, one process per rank:
the peer bench/compare_peers.sh sets ddpdiag against.

float32, sum, in place (dist.all_reduce on a view of one buffer), called
back to back as users call it (each call returns when the op is done).
Each size is timed as `ddpdiag allreduce-test` times it: warm-up calls, a
barrier, then `iters` calls between two clock reads; a rank's time per op is
that span / iters; the reported time is the mean over ranks, with the
fastest and slowest rank's time. Rank 0 prints one JSON object on stdout in
the same layout as ddpdiag_bare_gloo_allreduce.

Usage: /usr/bin/python3 bench/torch_allreduce.py --rank R --world-size N
         --master-addr A --master-port P --sizes 4,1024,... --iters 20[,5,...]
         --warmup-iters 5[,2,...]
RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are read when flags are absent.
--iters and --warmup-iters take one value or one per size.
"""
import argparse
import datetime
import json
import os
import sys
import time


def per_size(values, n, flag):
    vals = [int(v) for v in values.split(",")]
    if len(vals) == 1:
        return vals * n
    if len(vals) != n:
        raise SystemExit("%s: %d values for %d sizes" % (flag, len(vals), n))
    return vals


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rank", type=int, default=int(os.environ.get("RANK", "-1")))
    ap.add_argument("--world-size", type=int, default=int(os.environ.get("WORLD_SIZE", "-1")))
    ap.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR", "127.0.0.1"))
    ap.add_argument("--master-port", type=int, default=int(os.environ.get("MASTER_PORT", "-1")))
    ap.add_argument("--sizes", default=",".join(str(4 << (2 * i)) for i in range(13)))
    ap.add_argument("--iters", default="20")
    ap.add_argument("--warmup-iters", default="5")
    ap.add_argument("--timeout", type=int, default=120, help="seconds for rendezvous and each op")
    a = ap.parse_args()
    if a.world_size < 1 or not 0 <= a.rank < a.world_size or a.master_port <= 0:
        ap.error("need --rank in [0, --world-size) and --master-port (or RANK, WORLD_SIZE, "
                 "MASTER_PORT)")
    sizes = [int(s) for s in a.sizes.split(",")]
    if any(s < 4 or s % 4 for s in sizes):
        ap.error("--sizes are positive multiples of 4 bytes")
    iters = per_size(a.iters, len(sizes), "--iters")
    warmup = per_size(a.warmup_iters, len(sizes), "--warmup-iters")

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="tcp://%s:%d" % (a.master_addr, a.master_port),
                            rank=a.rank, world_size=a.world_size,
                            timeout=datetime.timedelta(seconds=a.timeout))
    # Small integers, as allreduce-test starts from: no NaNs or denormals.
    buf = ((torch.arange(max(sizes) // 4, dtype=torch.int64) + a.rank) % 3).to(torch.float32)
    mine = []
    for size, it, wu in zip(sizes, iters, warmup):
        t = buf[:size // 4]
        for _ in range(wu):
            dist.all_reduce(t)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(it):
            dist.all_reduce(t)
        t1 = time.perf_counter()
        mine.append((t1 - t0) * 1e6 / it)
    gathered = [torch.zeros(len(sizes), dtype=torch.float64) for _ in range(a.world_size)]
    dist.all_gather(gathered, torch.tensor(mine, dtype=torch.float64))
    if a.rank == 0:
        rows = []
        for i, size in enumerate(sizes):
            ts = [g[i].item() for g in gathered]
            rows.append({"bytes": size, "count": size // 4, "time_us": sum(ts) / len(ts),
                         "min_rank_time_us": min(ts), "max_rank_time_us": max(ts),
                         "iters": iters[i], "warmup_iters": warmup[i]})
        print(json.dumps({"impl": "torch", "torch_version": torch.__version__,
                          "world_size": a.world_size, "dtype": "float", "op": "sum",
                          "sizes": rows}))
        sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
