"""Side by side on this machine: ddpdiag's bucketed reducer (ddp-step) against
PyTorch DDP, same ranks, Gloo, same layout (resnet50's parameter shapes), same
bucket caps.

Torch's side is a module whose parameters have the layout's shapes and whose
forward is trivial (loss = sum of (p * x).sum(), x = 1), so backward produces
every gradient at once and the time per iteration is DDP's communication plus
its framework cost. Ours is `ddpdiag ddp-step --compute-gbps 0`: the same
gradients written by the backward simulator and reduced by the reducer.
Time per iteration = median over timed iterations (after warm-up) of the
slowest rank, barrier before each iteration, outside the timing, on both sides.
With --repeats R every cap is measured R times, the repeats interleaved (all
caps, then all caps again), and each figure is the median of the repeats: the
times, and each ratio the median of the repeats' own ratios (a run here moves
by 10-15 % from one to the next).

Like is compared with like: DDP's default (gradient_as_bucket_view=False)
against ddp-step --no-views, the judged pair (ratio); and
gradient_as_bucket_view=True against ddp-step --gradient-as-bucket-view
(ratio_views).

Usage: /usr/bin/python3 bench/ddp_vs_torch.py [--bin build/diag/ddpdiag]
       [--caps 1,5,10,25,50,100] [--iters 10] [--warmup 3] [--model resnet50] [--repeats 1]
Also runs with torch 2.x (.venv-torch2/bin/python). Goal: ours <= 0.8 x torch,
each pair (views and no views) on its own.
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torch_worker(rank, world, port, shapes, cap_mb, views, iters, warmup, out_path):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=rank,
                            world_size=world)

    class Shapes(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ps = torch.nn.ParameterList(
                [torch.nn.Parameter(torch.zeros(s)) for s in shapes])

        def forward(self, x):
            loss = x.sum() * 0
            for p in self.ps:
                loss = loss + (p * x).sum()
            return loss

    model = DDP(Shapes(), bucket_cap_mb=cap_mb, gradient_as_bucket_view=views)
    x = torch.ones(())
    times = []
    for it in range(warmup + iters):
        model.zero_grad()
        dist.barrier()
        t0 = time.perf_counter()
        model(x).backward()
        t1 = time.perf_counter()
        if it >= warmup:
            times.append((t1 - t0) * 1e6)
    with open("%s.%d" % (out_path, rank), "w") as f:
        json.dump(statistics.median(times), f)
    dist.destroy_process_group()


def run_torch(shapes, cap_mb, views, iters, warmup, nproc):
    import torch.multiprocessing as mp

    fd, path = tempfile.mkstemp(prefix="ddp-vs-torch-")
    os.close(fd)
    mp.spawn(torch_worker, args=(nproc, free_port(), shapes, cap_mb, views, iters, warmup, path),
             nprocs=nproc, join=True)
    meds = []
    for r in range(nproc):
        with open("%s.%d" % (path, r)) as f:
            meds.append(json.load(f))
        os.unlink("%s.%d" % (path, r))
    os.unlink(path)
    return max(meds)


def run_ours(binary, model, cap_mb, views, iters, warmup, nproc):
    fd, path = tempfile.mkstemp(prefix="ddp-vs-torch-", suffix=".json")
    os.close(fd)
    os.unlink(path)
    cmd = [binary, "ddp-step", "--model", model, "--bucket-cap-mb", str(cap_mb),
           "--compute-gbps", "0", "--nproc", str(nproc), "--backend", "gloo", "--json", path,
           "--iters", str(iters), "--warmup-iters", str(warmup)]
    cmd.append("--gradient-as-bucket-view" if views else "--no-views")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        raise SystemExit("ddpdiag failed (%d): %s\n%s" % (p.returncode, " ".join(cmd), p.stderr))
    with open(path) as f:
        rep = json.load(f)
    os.unlink(path)
    res = rep["results"]
    if res["wrong"] != 0:
        raise SystemExit("ddpdiag reported %d wrong gradient elements" % res["wrong"])
    return res["time_per_iter_us"], res["exposed_comm_us"]


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", default=os.environ.get("DDPDIAG_BIN",
                                                   os.path.join(here, "..", "build", "diag",
                                                                "ddpdiag")))
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--caps", default="1,5,10,25,50,100")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--json", help="write the figures to this file")
    a = ap.parse_args()

    import torch

    layout = json.loads(subprocess.run([a.bin, "buckets", "--model", a.model, "--dump-layout"],
                                       capture_output=True, text=True, check=True).stdout)
    shapes = [t["shape"] for t in layout["tensors"]]
    print("# %s (%d tensors), %d ranks, Gloo, torch %s, ddpdiag %s" %
          (a.model, len(shapes), a.nproc, torch.__version__, a.bin))
    if a.repeats < 1:
        ap.error("--repeats must be at least 1")
    print("# time per iteration (us), median of %d after %d warm-up, slowest rank; median of %d "
          "repeat(s)" % (a.iters, a.warmup, a.repeats))
    print("# %8s %14s %14s %14s %14s %10s %12s" %
          ("cap(MiB)", "torch", "ours", "torch views", "ours views", "ours/torch",
           "views o/t"))
    caps = [float(c) for c in a.caps.split(",")]
    runs = {cap: [] for cap in caps}
    for rep in range(a.repeats):
        for cap in caps:
            t_default = run_torch(shapes, cap, False, a.iters, a.warmup, a.nproc)
            t_views = run_torch(shapes, cap, True, a.iters, a.warmup, a.nproc)
            ours, exposed = run_ours(a.bin, a.model, cap, False, a.iters, a.warmup, a.nproc)
            ours_views, exposed_views = run_ours(a.bin, a.model, cap, True, a.iters, a.warmup, a.nproc)
            runs[cap].append({"torch_us": t_default, "torch_views_us": t_views, "ours_us": ours,
                              "ours_views_us": ours_views, "ours_exposed_us": exposed,
                              "ours_views_exposed_us": exposed_views,
                              "ratio": ours / t_default, "ratio_views": ours_views / t_views})
            if a.repeats > 1:
                print("  (repeat %d/%d, cap %g: ratio %.3f, views %.3f)" %
                      (rep + 1, a.repeats, cap, runs[cap][-1]["ratio"], runs[cap][-1]["ratio_views"]),
                      file=sys.stderr)
    rows = []
    for cap in caps:
        row = {"cap_mb": cap, "repeats": len(runs[cap])}
        for key in runs[cap][0]:
            row[key] = statistics.median(r[key] for r in runs[cap])
        row["repeat_ratios"] = [r["ratio"] for r in runs[cap]]
        row["repeat_ratios_views"] = [r["ratio_views"] for r in runs[cap]]
        rows.append(row)
        print("  %8g %14.0f %14.0f %14.0f %14.0f %10.2f %12.2f" %
              (cap, row["torch_us"], row["ours_us"], row["torch_views_us"], row["ours_views_us"],
               row["ratio"], row["ratio_views"]))
        sys.stdout.flush()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "nproc": a.nproc, "torch": torch.__version__,
                       "rows": rows}, f, indent=1)
    goal = [r for r in rows if r["cap_mb"] == 25]
    for key, what in (("ratio", "default (no views)"), ("ratio_views", "gradient_as_bucket_view")):
        if goal:
            print("# goal at 25 MiB, %s: ours <= 0.8 x torch: %.2f x (%s)" %
                  (what, goal[0][key], "met" if goal[0][key] <= 0.8 else "NOT met"))


if __name__ == "__main__":
    main()
