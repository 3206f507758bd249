"""ddpdiag side by side with its peers on this machine, in one go.

1. all_reduce: `ddpdiag allreduce-test` (in-place block), torch.distributed's
   Gloo all_reduce (bench/torch_allreduce.py) and a bare gloo::allreduce loop
   (ddpdiag_bare_gloo_allreduce), one process per rank, at each world size,
   the same sizes, float32 sum in place, the same iteration and warm-up
   counts, timed the same way (warm-up, barrier, a timed run of back-to-back
   calls; mean over ranks). Sizes run in groups of equal counts, each group
   in fresh processes for all three, back to back in an order that rotates;
   every full sweep runs --repeats times. The median time per size gives the
   bandwidth columns; the ratio columns are the median of the per-repeat
   ratios. busbw = algbw * 2(n-1)/n. World sizes above this machine's CPU
   count are shown but not judged: there every implementation waits for the
   scheduler at each message.
2. DDP reducer: bench/ddp_vs_torch.py (ddpdiag ddp-step against PyTorch DDP,
   resnet50 layout, each bucket cap), like against like: DDP's default
   against ddp-step --no-views, and gradient_as_bucket_view=True against
   ddp-step --gradient-as-bucket-view; each pair judged on its own.
3. Rendezvous: N local clients meet (connect, SET own key, ADD a counter,
   WAIT for "done") against `ddpdiag store serve` and against torch's
   TCPStore(is_master=True) server, with the same client (our C++ client,
   speaking that torch's protocol; a thread per client, and again with every
   client on one epoll thread), and natively with torch's client on
   torch's server; for torch 1.13 and, when a torch 2.x is at hand
   (--torch2-python), for torch 2.x's server (libuv) too.
4. Store throughput: ddpdiag_bench_store with 64 clients.

Prints tables with ratio columns and a verdict per target, and writes one
JSON report (command "compare-peers") that `ddpdiag report validate` accepts
and `ddpdiag report render` draws.

Exit codes: 0 every target met, 1 a target missed, 2 usage, 3 a measurement
failed to run, 77 torch 1.13 is not available.
"""
import argparse
import datetime
import json
import os
import platform
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MiB = 1 << 20

# Targets (what the verdicts compare against).
TARGET_BARE_RATIO = 0.97       # busbw >= 0.97 x bare Gloo at >= 1 MiB
TARGET_BARE_MIN_BYTES = MiB
TARGET_TORCH_RATIO = 1.0       # busbw >= torch.distributed at every size
TARGET_REDUCER_RATIO = 0.8     # iteration time <= 0.8 x torch DDP
TARGET_RDZV_RATIO = 0.5        # 1024 clients: <= 0.5 x torch TCPStore's time
TARGET_RDZV_CLIENTS = 1024
TARGET_STORE_OPS = 100e3       # >= 100k ops/s, small keys, 64 clients
STORE_CLIENTS = 64


class RunFailed(Exception):
    pass


def log(msg):
    sys.stderr.write("[compare-peers] %s\n" % msg)
    sys.stderr.flush()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def human(b):
    for unit, f in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", 1024)):
        if b >= f and b % f == 0:
            return "%d %s" % (b // f, unit)
    return "%d B" % b


def parse_size(s):
    s = s.strip()
    mult = {"K": 1024, "M": MiB, "G": 1 << 30}
    if s and s[-1].upper() in mult:
        return int(float(s[:-1]) * mult[s[-1].upper()])
    return int(s)


def last_json_line(text, what):
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
    raise RunFailed("%s printed no JSON result" % what)


def run_ranks(cmds, envs, timeout, what):
    """Starts one process per rank and waits for all with a deadline; returns
    rank 0's stdout."""
    procs = [subprocess.Popen(c, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for c, e in zip(cmds, envs)]
    deadline = time.monotonic() + timeout
    outs = []
    try:
        for p in procs:
            so, se = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outs.append((p.returncode, so, se))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
            p.wait()
        raise RunFailed("%s did not finish within %d s" % (what, timeout))
    for r, (rc, so, se) in enumerate(outs):
        if rc != 0:
            raise RunFailed("%s: rank %d exited with %d: %s" % (what, r, rc, se.strip()[-2000:]))
    return outs[0][1]


def clean_env(**extra):
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update({k: str(v) for k, v in extra.items()})
    return env


# --------------------------------------------------------------------------
# all_reduce


class Plan:
    """Sizes and the iteration/warm-up counts of each (the same for all three)."""

    def __init__(self, a):
        self.sizes = []
        b = a.min_bytes
        while b <= a.max_bytes:
            self.sizes.append(b)
            b *= a.factor
        # Short timed runs are decided by chance here: 20 calls of a size up to
        # ~1 MiB span a few scheduler ticks (4 ms) or less, so one preemption,
        # or where the kernel happened to place the ranks' threads, sets the
        # figure. More calls average over many ticks (the spread between
        # placements remains; the repeats' median is for that). Counts per
        # size range: --small-iters up to --small-bytes, --iters up to
        # --large-bytes, --large-iters above.
        def pick(s, small, normal, large):
            return small if s <= a.small_bytes else normal if s <= a.large_bytes else large
        self.iters = [pick(s, a.small_iters, a.iters, a.large_iters) for s in self.sizes]
        self.warmup = [pick(s, a.small_warmup, a.warmup, a.large_warmup) for s in self.sizes]

    def groups(self):
        """Runs of consecutive sizes with the same counts (one allreduce-test call each)."""
        out = []
        for s, i, w in zip(self.sizes, self.iters, self.warmup):
            if out and out[-1][1:] == (i, w):
                out[-1][0].append(s)
            else:
                out.append(([s], i, w))
        return out


def run_ddpdiag_allreduce(a, group, n):
    """One `ddpdiag allreduce-test` run over a group of sizes (one -n, one -w)."""
    sizes, iters, warmup = group
    rows = []
    fd, path = tempfile.mkstemp(prefix="compare-peers-", suffix=".json")
    os.close(fd)
    os.unlink(path)
    cmd = [a.ddpdiag, "allreduce-test", "--nproc", str(n), "--backend", "gloo",
           "-b", str(sizes[0]), "-e", str(sizes[-1]), "-f", str(a.factor),
           "-n", str(iters), "-w", str(warmup), "-c", "0", "--no-out-of-place",
           "-d", "float", "-o", "sum", "--timeout", str(a.timeout), "--json", path]
    try:
        p = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True,
                           timeout=a.timeout * 4)
    except subprocess.TimeoutExpired:
        raise RunFailed("ddpdiag allreduce-test did not finish: %s" % " ".join(cmd))
    if p.returncode != 0 or not os.path.exists(path):
        raise RunFailed("ddpdiag allreduce-test exited with %d: %s\n%s" %
                        (p.returncode, " ".join(cmd), p.stderr.strip()[-2000:]))
    with open(path) as f:
        rep = json.load(f)
    os.unlink(path)
    tool = rep["tool"]
    libs = rep["world"]["library_versions"]
    for r in rep["results"]["sizes"]:
        b = r["in_place"]
        rows.append({"bytes": r["bytes"], "time_us": b["time_us"],
                     "min_rank_time_us": b["min_rank_time_us"],
                     "max_rank_time_us": b["max_rank_time_us"],
                     "iters": iters, "warmup_iters": warmup})
    return rows, tool, libs


def run_peer_allreduce(a, group, n, impl):
    port = free_port()
    gsizes, giters, gwarmup = group
    sizes = ",".join(str(s) for s in gsizes)
    iters = ",".join(str(giters) for _ in gsizes)
    warmup = ",".join(str(gwarmup) for _ in gsizes)
    cmds, envs = [], []
    for r in range(n):
        common = ["--rank", str(r), "--world-size", str(n), "--master-addr", "127.0.0.1",
                  "--master-port", str(port), "--sizes", sizes, "--iters", iters,
                  "--warmup-iters", warmup, "--timeout", str(a.timeout)]
        if impl == "torch":
            cmds.append([a.python, os.path.join(HERE, "torch_allreduce.py")] + common)
            envs.append(clean_env(OMP_NUM_THREADS=1))
        else:
            cmds.append([a.bare_gloo] + common)
            envs.append(clean_env())
    out = last_json_line(run_ranks(cmds, envs, a.timeout * 4, "%s all_reduce at %d ranks" %
                                   (impl, n)), impl)
    return out["sizes"], out.get("torch_version")


def busbw(bytes_, time_us, n):
    algbw = bytes_ / (time_us * 1e3) if time_us > 0 else 0.0
    return algbw, algbw * 2.0 * (n - 1) / n


def measure_allreduce(a, plan, state):
    impls = ["ddpdiag", "torch", "bare_gloo"]
    times = {}  # (impl, n, bytes) -> [time_us per repeat]
    groups = plan.groups()
    for rep in range(a.repeats):
        for n in a.ranks:
            for gi, group in enumerate(groups):
                # Each implementation runs each group of sizes in fresh
                # processes (ddpdiag's one -n per run makes it so for
                # ddpdiag), so none has warmer sockets or pages than the
                # others at a group's first size. The order rotates per
                # repeat and group, so none of the three always goes first.
                k = (rep + gi) % 3
                for impl in impls[k:] + impls[:k]:
                    log("all_reduce: repeat %d/%d, %d ranks, %s to %s, %s" %
                        (rep + 1, a.repeats, n, human(group[0][0]), human(group[0][-1]), impl))
                    if impl == "ddpdiag":
                        rows, tool, libs = run_ddpdiag_allreduce(a, group, n)
                        state["tool"], state["libs"] = tool, libs
                    else:
                        rows, tv = run_peer_allreduce(a, group, n, impl)
                        if tv:
                            state["torch_version"] = tv
                    for r in rows:
                        times.setdefault((impl, n, r["bytes"]), []).append(r["time_us"])
    sizes_rows, ratio_rows = [], []
    for n in a.ranks:
        for b in plan.sizes:
            med = {}
            for impl in impls:
                ts = times[(impl, n, b)]
                med[impl] = statistics.median(ts)
                algbw, bw = busbw(b, med[impl], n)
                sizes_rows.append({"collective": "all_reduce", "algorithm": impl, "world_size": n,
                                   "bytes": b, "count": b // 4, "dtype": "float", "op": "sum",
                                   "iters": plan.iters[plan.sizes.index(b)],
                                   "time_us": med[impl], "algbw_gbps": algbw, "busbw_gbps": bw,
                                   "repeat_time_us": ts})
            # busbw ratios = inverse time ratios (same bytes, same n). Each
            # repeat's three runs are back to back, so their ratio is taken
            # per repeat and the median kept: a drift of the machine's speed
            # between repeats (other tenants, clock) cancels out of it.
            def paired(peer):
                return statistics.median(p / d for p, d in zip(times[(peer, n, b)],
                                                                times[("ddpdiag", n, b)]))
            ratio_rows.append({
                "world_size": n, "bytes": b,
                "ddpdiag_busbw_gbps": busbw(b, med["ddpdiag"], n)[1],
                "torch_busbw_gbps": busbw(b, med["torch"], n)[1],
                "bare_gloo_busbw_gbps": busbw(b, med["bare_gloo"], n)[1],
                "ddpdiag_time_us": med["ddpdiag"],
                "ddpdiag_over_torch": paired("torch"),
                "ddpdiag_over_bare_gloo": paired("bare_gloo"),
            })
    return sizes_rows, ratio_rows


def print_allreduce(ratio_rows, repeats):
    print("# all_reduce, float32 sum in place, bus bandwidth (GB/s) from the median time of "
          "%d repeat(s); ratios: median of the repeats' own ratios" % repeats)
    print("# %5s %10s %12s %12s %12s %14s %14s %12s" % ("ranks", "size", "ddpdiag", "torch",
                                                         "bare gloo", "ddpdiag/torch",
                                                         "ddpdiag/bare", "ddpdiag(us)"))
    for r in ratio_rows:
        print("  %5d %10s %12.4g %12.4g %12.4g %14.3f %14.3f %12.1f" % (
            r["world_size"], human(r["bytes"]), r["ddpdiag_busbw_gbps"], r["torch_busbw_gbps"],
            r["bare_gloo_busbw_gbps"], r["ddpdiag_over_torch"], r["ddpdiag_over_bare_gloo"],
            r.get("ddpdiag_time_us", float("nan"))))
    print()
    sys.stdout.flush()


def usable_cpus():
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def allreduce_checks(ratio_rows, ranks):
    checks = []
    cpus = usable_cpus()
    for n in ranks:
        rows = [r for r in ratio_rows if r["world_size"] == n]
        if rows and n > cpus:
            # More ranks than CPUs: every implementation's Gloo threads wait
            # for a scheduler tick per message (milliseconds a call whatever
            # the size), so the ratios compare the scheduler with itself.
            # The figures stay in the table and the report.
            for what in ("bare_gloo", "torch"):
                checks.append({"name": "allreduce_vs_%s_%dranks" % (what, n), "status": "skip",
                               "detail": "not judged: %d ranks on %d CPU(s) are oversubscribed "
                                         "(every implementation waits for the scheduler); "
                                         "judge on a machine with at least %d CPUs" %
                                         (n, cpus, n)})
            continue
        big = [r for r in rows if r["bytes"] >= TARGET_BARE_MIN_BYTES]
        if big:
            worst = min(big, key=lambda r: r["ddpdiag_over_bare_gloo"])
            ok = worst["ddpdiag_over_bare_gloo"] >= TARGET_BARE_RATIO
            checks.append({"name": "allreduce_vs_bare_gloo_%dranks" % n,
                           "status": "pass" if ok else "fail",
                           "detail": "busbw ddpdiag / bare Gloo at >= 1 MiB: lowest %.3f at %s "
                                     "(target >= %.2f; %d of %d sizes meet it)" % (
                                         worst["ddpdiag_over_bare_gloo"], human(worst["bytes"]),
                                         TARGET_BARE_RATIO,
                                         sum(r["ddpdiag_over_bare_gloo"] >= TARGET_BARE_RATIO
                                             for r in big), len(big))})
        else:
            checks.append({"name": "allreduce_vs_bare_gloo_%dranks" % n, "status": "skip",
                           "detail": "no size of 1 MiB or more was measured"})
        if rows:
            worst = min(rows, key=lambda r: r["ddpdiag_over_torch"])
            ok = worst["ddpdiag_over_torch"] >= TARGET_TORCH_RATIO
            checks.append({"name": "allreduce_vs_torch_%dranks" % n,
                           "status": "pass" if ok else "fail",
                           "detail": "busbw ddpdiag / torch.distributed at every size: lowest "
                                     "%.3f at %s (target >= %.2f; %d of %d sizes meet it)" % (
                                         worst["ddpdiag_over_torch"], human(worst["bytes"]),
                                         TARGET_TORCH_RATIO,
                                         sum(r["ddpdiag_over_torch"] >= TARGET_TORCH_RATIO
                                             for r in rows), len(rows))})
    return checks


# --------------------------------------------------------------------------
# DDP reducer


def measure_reducer(a):
    fd, path = tempfile.mkstemp(prefix="compare-peers-ddp-", suffix=".json")
    os.close(fd)
    cmd = [a.python, os.path.join(HERE, "ddp_vs_torch.py"), "--bin", a.ddpdiag, "--model",
           a.model, "--caps", a.caps, "--iters", str(a.ddp_iters), "--warmup", str(a.ddp_warmup),
           "--nproc", str(a.ddp_ranks), "--repeats", str(a.ddp_repeats), "--json", path]
    log("reducer: %s" % " ".join(cmd[1:]))
    try:
        p = subprocess.run(cmd, env=clean_env(OMP_NUM_THREADS=1), capture_output=True, text=True,
                           timeout=a.timeout * 10)
    except subprocess.TimeoutExpired:
        raise RunFailed("ddp_vs_torch.py did not finish")
    if p.returncode != 0:
        raise RunFailed("ddp_vs_torch.py exited with %d:\n%s" % (p.returncode,
                                                                p.stderr.strip()[-2000:]))
    with open(path) as f:
        doc = json.load(f)
    os.unlink(path)
    rows = []
    for r in doc["rows"]:
        rows.append({"model": doc["model"], "world_size": doc["nproc"], "cap_mb": r["cap_mb"],
                     "torch_us": r["torch_us"], "ddpdiag_us": r["ours_us"],
                     "ddpdiag_exposed_comm_us": r["ours_exposed_us"],
                     "ddpdiag_over_torch": r["ratio"],
                     "torch_views_us": r["torch_views_us"], "ddpdiag_views_us": r["ours_views_us"],
                     "ddpdiag_views_exposed_comm_us": r["ours_views_exposed_us"],
                     "ddpdiag_views_over_torch_views": r["ratio_views"],
                     "repeats": r.get("repeats", 1),
                     "repeat_ratios": r.get("repeat_ratios", [r["ratio"]]),
                     "repeat_ratios_views": r.get("repeat_ratios_views", [r["ratio_views"]])})
    return rows


# The reducer's judged pairs: (check name, ratio key, what is compared).
REDUCER_PAIRS = (("reducer_vs_torch_ddp", "ddpdiag_over_torch",
                  "ddp-step --no-views / torch DDP (gradient_as_bucket_view=False)"),
                 ("reducer_vs_torch_ddp_views", "ddpdiag_views_over_torch_views",
                  "ddp-step --gradient-as-bucket-view / torch DDP (gradient_as_bucket_view=True)"))


def like_for_like(row):
    """A reducer row of a report from before the pairs were like for like
    (ddpdiag_us with views against torch_us without; ddpdiag_no_views_us),
    in today's layout."""
    if "ddpdiag_views_us" in row or "ddpdiag_no_views_us" not in row:
        return row
    r = dict(row)
    r["ddpdiag_views_us"] = r["ddpdiag_us"]
    r["ddpdiag_us"] = r.pop("ddpdiag_no_views_us")
    r["ddpdiag_over_torch"] = r["ddpdiag_us"] / r["torch_us"]
    r["ddpdiag_views_over_torch_views"] = r["ddpdiag_views_us"] / r["torch_views_us"]
    return r


def print_reducer(rows):
    if not rows:
        return
    print("# DDP reducer vs PyTorch DDP: %s layout, %d ranks, time per iteration (us), median of "
          "%d repeat(s); no views: DDP's default, views: gradient_as_bucket_view" %
          (rows[0]["model"], rows[0]["world_size"], rows[0].get("repeats", 1)))
    print("# %8s %12s %12s %14s %14s %14s %14s" % ("cap(MiB)", "ddpdiag", "torch", "ddpdiag/torch",
                                                  "ddpdiag views", "torch views", "views d/t"))
    for r in rows:
        print("  %8g %12.0f %12.0f %14.3f %14.0f %14.0f %14.3f" % (
            r["cap_mb"], r["ddpdiag_us"], r["torch_us"], r["ddpdiag_over_torch"],
            r["ddpdiag_views_us"], r["torch_views_us"], r["ddpdiag_views_over_torch_views"]))
    print()
    sys.stdout.flush()


def reducer_checks(rows):
    if not rows:
        return [{"name": name, "status": "skip", "detail": "the reducer comparison was not run"}
                for name, _, _ in REDUCER_PAIRS]
    checks = []
    for name, key, what in REDUCER_PAIRS:
        worst = max(rows, key=lambda r: r[key])
        ok = worst[key] <= TARGET_REDUCER_RATIO
        checks.append({"name": name, "status": "pass" if ok else "fail",
                       "detail": "iteration time %s (%s, %d ranks): highest %.3f at cap %g MiB "
                                 "(target <= %.2f; %d of %d caps meet it)" % (
                                     what, worst["model"], worst["world_size"], worst[key],
                                     worst["cap_mb"], TARGET_REDUCER_RATIO,
                                     sum(r[key] <= TARGET_REDUCER_RATIO for r in rows), len(rows))})
    return checks


# --------------------------------------------------------------------------
# Rendezvous


def wait_port(port, proc, what, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RunFailed("%s exited with %d before serving" % (what, proc.returncode))
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.05)
    raise RunFailed("%s did not listen on port %d within %d s" % (what, port, timeout))


class Servers:
    """`ddpdiag store serve` and torch's TCPStore server, for the whole run."""

    def __init__(self, a):
        self.procs = []
        self.tmp = None
        # How torch 2.x's server and clients resolve names: see start_torch2.
        self.torch2_resolver = None
        # Per torch generation ("1.13", "2.x"): its python, the command prefix
        # its processes run under, and its server's port.
        self.torch = {}
        try:
            self.ours_port = free_port()
            ours = subprocess.Popen([a.ddpdiag, "store", "serve", "--host", "127.0.0.1",
                                     "--port", str(self.ours_port)], stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, text=True)
            self.procs.append(ours)
            self.ours_pid = ours.pid
            self.start_torch(a.python, "1.13")
            if a.torch2_python:
                self.start_torch2(a.torch2_python)
            wait_port(self.ours_port, ours, "ddpdiag store serve", 30)
        except BaseException:
            self.close()
            raise

    def start_torch(self, python, gen, wrap=()):
        port = free_port()
        srv = subprocess.Popen(list(wrap) + [python, os.path.join(HERE, "rendezvous_torch.py"),
                                             "serve", "--port", str(port)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
        self.procs.append(srv)
        line = srv.stdout.readline()
        if not line.startswith("ready"):
            raise RunFailed("torch %s's TCPStore server did not start: %s" %
                            (gen, srv.stderr.read()[-2000:]))
        self.torch[gen] = {"python": python, "wrap": list(wrap), "port": port, "pid": srv.pid}

    def start_torch2(self, python):
        """torch 2.x's server (libuv) looks up the host name of every client it
        accepts (reverse DNS), on its one event-loop thread, and its client
        looks up the names of its connection's ends. Where the resolver drops
        a query, every client waits for the resolver's timeout (5 s), and the
        rendezvous measures the resolver, not the server. So, as root, torch
        2.x's server and clients run in a mount namespace of their own whose
        nsswitch.conf says "hosts: files": the lookup fails at once, as with an
        instant resolver, the best case for torch. Otherwise they resolve as
        this machine does."""
        if os.geteuid() == 0 and shutil.which("unshare"):
            self.tmp = tempfile.mkdtemp(prefix="compare-peers-nss-")
            nss = os.path.join(self.tmp, "nsswitch.conf")
            with open(nss, "w") as f:
                f.write("hosts: files\n")
            wrap = ["unshare", "--mount", "sh", "-c",
                    'mount --bind "$0" /etc/nsswitch.conf && exec "$@"', nss]
            try:
                self.start_torch(python, "2.x", wrap)
                self.torch2_resolver = "files only (no DNS)"
                return
            except RunFailed as e:
                log("could not give torch 2.x's server a resolver of files only (%s); it "
                    "resolves as this machine does" % str(e).strip()[-300:])
        else:
            log("torch 2.x's server resolves each client's name as this machine does (not "
                "root: cannot give it a resolver of files only); a slow resolver slows it")
        self.torch2_resolver = "this machine's (DNS)"
        self.start_torch(python, "2.x")

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                if p.stdin:
                    p.stdin.close()
                else:
                    p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)


def process_cpu_s(pid):
    """CPU time of a process, all its threads, in seconds (nanosecond clock:
    /proc/PID/task/*/schedstat); None where it cannot be read. The torch
    servers run under `unshare ... exec`, so their pid is the server's."""
    total = 0
    try:
        for t in os.listdir("/proc/%d/task" % pid):
            try:
                with open("/proc/%d/task/%s/schedstat" % (pid, t)) as f:
                    total += int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                pass  # a thread that ended meanwhile
    except OSError:
        return None
    return total / 1e9


def children_cpu_s():
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run_rdzv(cmd, what, timeout):
    """The client program's JSON line, and the CPU time (user + system) the
    client process used over its whole run."""
    cpu0 = children_cpu_s()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RunFailed("%s did not finish within %d s" % (what, timeout))
    if p.returncode != 0:
        raise RunFailed("%s exited with %d: %s" % (what, p.returncode, p.stderr.strip()[-2000:]))
    return last_json_line(p.stdout, what), children_cpu_s() - cpu0


# Drivers of ddpdiag's rendezvous client (ddpdiag_rendezvous_bench --driver):
# one thread per client, or every connection on one epoll thread.
RDZV_DRIVERS = ("threads", "epoll")


def measure_rendezvous(a):
    rows = []
    servers = Servers(a)
    try:
        for n in a.rdzv_clients:
            # Per torch generation: ddpdiag's client speaks that torch's protocol
            # to both servers (ddpdiag's serves both on one port).
            for gen, torch in servers.torch.items():
                pairs = [("ddpdiag", driver, server, port) for driver in RDZV_DRIVERS
                         for server, port in (("ddpdiag", servers.ours_port),
                                              ("torch", torch["port"]))]
                if not a.no_native:
                    pairs.append(("torch", "threads", "torch", torch["port"]))
                for client, driver, server, port in pairs:
                    log("rendezvous: %d clients, %s client (%s), %s server (torch %s protocol)" %
                        (n, client, driver, server, gen))
                    prefix = "rdzv_%s_%s_%s_%s_%d" % (gen, client, driver, server, n)
                    if client == "ddpdiag":
                        cmd = [a.rendezvous_bench, "--port", str(port), "--clients", str(n),
                               "--repeats", str(a.repeats), "--protocol", gen, "--prefix",
                               prefix, "--timeout", str(a.timeout), "--driver", driver]
                    else:
                        cmd = torch["wrap"] + [
                            torch["python"], os.path.join(HERE, "rendezvous_torch.py"), "clients",
                            "--port", str(port), "--clients", str(n), "--repeats", str(a.repeats),
                            "--prefix", prefix, "--timeout", str(a.timeout)]
                    # The server's own CPU time over the run, per rendezvous:
                    # the clients' threads share this machine's cores with
                    # the server and dominate the wall time on a small
                    # machine, so this is the direct measure of the server.
                    server_pid = servers.ours_pid if server == "ddpdiag" else torch["pid"]
                    cpu0 = process_cpu_s(server_pid)
                    out, client_cpu = run_rdzv(cmd, "%s clients (%s) on the %s server (torch %s)" %
                                               (client, driver, server, gen),
                                               a.timeout * (a.repeats + 1))
                    cpu1 = process_cpu_s(server_pid)
                    row = {"clients": n, "torch": gen, "client": client, "driver": driver,
                           "server": server,
                           "time_s": statistics.median(out["times_s"]),
                           "connect_s": statistics.median(out["connect_s"]),
                           "repeat_time_s": out["times_s"],
                           # the client program's CPU per rendezvous (start-up
                           # and closing the connections included)
                           "client_cpu_s": client_cpu / len(out["times_s"])}
                    if cpu0 is not None and cpu1 is not None:
                        row["server_cpu_s"] = (cpu1 - cpu0) / len(out["times_s"])
                    if gen == "2.x" and (server == "torch" or client == "torch"):
                        row["torch_resolver"] = servers.torch2_resolver
                    rows.append(row)
    finally:
        servers.close()
    return rows


def ratio(x, y):
    """x / y, or None where either is missing (or y is 0)."""
    return x / y if x and y else None


def rendezvous_ratios(rows):
    # Reports from before the torch 2.x rows have no "torch" field: 1.13;
    # from before the epoll driver, no "driver": threads.
    gen_of = lambda r: r.get("torch", "1.13")  # noqa: E731
    driver_of = lambda r: r.get("driver", "threads")  # noqa: E731

    def t(n, gen, client, driver, server, field="time_s"):
        for r in rows:
            if (r["clients"], gen_of(r), r["client"], driver_of(r), r["server"]) == \
                    (n, gen, client, driver, server):
                return r.get(field)
        return None

    out = []
    for n in sorted({r["clients"] for r in rows}):
        for gen in sorted({gen_of(r) for r in rows if r["clients"] == n}):
            for d in [x for x in RDZV_DRIVERS
                      if any(driver_of(r) == x and r["client"] == "ddpdiag" for r in rows)]:
                ours, theirs = t(n, gen, "ddpdiag", d, "ddpdiag"), t(n, gen, "ddpdiag", d, "torch")
                # torch's own client is threads (Python's, behind one GIL)
                native = t(n, gen, "torch", "threads", "torch") if d == "threads" else None
                ours_cpu = t(n, gen, "ddpdiag", d, "ddpdiag", "server_cpu_s")
                theirs_cpu = t(n, gen, "ddpdiag", d, "torch", "server_cpu_s")
                out.append({"clients": n, "torch": gen, "driver": d,
                            "ddpdiag_server_s": ours, "torch_server_s": theirs,
                            "ddpdiag_server_cpu_s": ours_cpu, "torch_server_cpu_s": theirs_cpu,
                            "ddpdiag_over_torch_server_cpu": ratio(ours_cpu, theirs_cpu),
                            "client_cpu_s": t(n, gen, "ddpdiag", d, "ddpdiag", "client_cpu_s"),
                            "torch_native_s": native,
                            "ddpdiag_over_torch_server": ratio(ours, theirs),
                            "ddpdiag_over_torch_native": ratio(ours, native)})
    return out


def print_rendezvous(rows, ratios):
    if not rows:
        return
    print("# rendezvous of N local clients (connect, set, add, wait), median time (s)")
    print("# driver: how ddpdiag's client runs them: threads (one per client) or epoll "
          "(all on one thread)")
    print("# %7s %6s %7s %18s %18s %18s %16s %16s" % ("clients", "torch", "driver",
                                                      "ddpdiag server", "torch server",
                                                      "torch native", "ddpdiag/torch srv",
                                                      "ddpdiag/t.native"))
    print("# %7s %6s %7s %18s %18s %18s" % ("", "", "", "(ddpdiag client)", "(ddpdiag client)",
                                            "(torch client)"))
    f = lambda v, fmt: fmt % v if v is not None else "-"  # noqa: E731
    for r in ratios:
        print("  %7d %6s %7s %18s %18s %18s %16s %16s" % (
            r["clients"], r.get("torch", "1.13"), r.get("driver", "threads"),
            f(r["ddpdiag_server_s"], "%.4f"),
            f(r["torch_server_s"], "%.4f"),
            f(r["torch_native_s"], "%.4f"), f(r["ddpdiag_over_torch_server"], "%.3f"),
            f(r["ddpdiag_over_torch_native"], "%.3f")))
    if any(r.get("ddpdiag_over_torch_server_cpu") is not None for r in ratios):
        print("# CPU time per rendezvous (ms): the servers' own, same client; and the client "
              "program's (on ddpdiag's server)")
        print("# %7s %6s %7s %18s %18s %16s %14s" % ("clients", "torch", "driver",
                                                     "ddpdiag server", "torch server",
                                                     "ddpdiag/torch", "client"))
        for r in ratios:
            print("  %7d %6s %7s %18s %18s %16s %14s" % (
                r["clients"], r.get("torch", "1.13"), r.get("driver", "threads"),
                f(r.get("ddpdiag_server_cpu_s") and r["ddpdiag_server_cpu_s"] * 1e3, "%.1f"),
                f(r.get("torch_server_cpu_s") and r["torch_server_cpu_s"] * 1e3, "%.1f"),
                f(r.get("ddpdiag_over_torch_server_cpu"), "%.3f"),
                f(r.get("client_cpu_s") and r["client_cpu_s"] * 1e3, "%.1f")))
    resolvers = {r["torch_resolver"] for r in rows if r.get("torch_resolver")}
    for res in sorted(resolvers):
        print("# torch 2.x's server and client looked up names with: %s" % res)
    print()
    sys.stdout.flush()


def rendezvous_checks(ratios):
    """One check per torch generation and client driver measured:
    rendezvous_1024_vs_torch_tcpstore (torch 1.13's server) and
    rendezvous_1024_vs_torch2_tcpstore (2.x's) with a thread per client, and
    the same names ending in _epoll_clients with every client on one epoll
    thread."""
    checks = []
    for gen, driver in sorted({(x.get("torch", "1.13"), x.get("driver", "threads"))
                               for x in ratios}, key=lambda k: (k[0], RDZV_DRIVERS.index(k[1]))):
        name = "rendezvous_1024_vs_torch%s_tcpstore%s" % (
            "" if gen == "1.13" else "2", "" if driver == "threads" else "_" + driver + "_clients")
        r = [x for x in ratios if x["clients"] == TARGET_RDZV_CLIENTS and
             x.get("torch", "1.13") == gen and x.get("driver", "threads") == driver]
        if not r or r[0]["ddpdiag_over_torch_server"] is None:
            checks.append({"name": name, "status": "skip",
                           "detail": "1024 clients were not measured"})
            continue
        r = r[0]
        ok = r["ddpdiag_over_torch_server"] <= TARGET_RDZV_RATIO
        native = ("; natively (torch client and server) %.4f s, ratio %.3f" %
                  (r["torch_native_s"], r["ddpdiag_over_torch_native"])
                  if r["torch_native_s"] else "")
        checks.append({"name": name, "status": "pass" if ok else "fail",
                       "detail": "1024 clients, same client (torch %s protocol, %s): ddpdiag "
                                 "server %.4f s / torch %s TCPStore %.4f s = %.3f (target <= %.2f)%s" % (
                                     gen, "a thread per client" if driver == "threads" else
                                     "every client on one epoll thread",
                                     r["ddpdiag_server_s"], gen, r["torch_server_s"],
                                     r["ddpdiag_over_torch_server"], TARGET_RDZV_RATIO,
                                     native)})
    return checks


# --------------------------------------------------------------------------
# Store throughput


def measure_store(a):
    # Single runs of these ops swing by +-25% here (64 client threads on a
    # few cores); --repeats runs of each, and their median is judged.
    cmd = [a.store_bench, "--benchmark_filter=/threads:%d$" % STORE_CLIENTS,
           "--benchmark_format=json", "--benchmark_repetitions=%d" % max(1, a.repeats),
           "--benchmark_report_aggregates_only=true"]
    if a.store_min_time:
        cmd.append("--benchmark_min_time=%g" % a.store_min_time)
    log("store: %s" % " ".join(cmd))
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout * 4)
    except subprocess.TimeoutExpired:
        raise RunFailed("ddpdiag_bench_store did not finish")
    if p.returncode != 0:
        raise RunFailed("ddpdiag_bench_store exited with %d: %s" % (p.returncode,
                                                                   p.stderr.strip()[-2000:]))
    doc = json.loads(p.stdout)
    rows = []
    runs = {}
    for b in doc["benchmarks"]:
        # e.g. store_get/protocol:2/real_time/threads:64_median (aggregates),
        # or the plain name for a single repetition.
        if b.get("run_type") == "aggregate":
            if b.get("aggregate_name") != "median":
                continue
        runs[b.get("run_name", b["name"])] = b
    for name, b in runs.items():
        parts = name.split("/")
        proto = next((x.split(":")[1] for x in parts if x.startswith("protocol:")), "?")
        rows.append({"op": parts[0].replace("store_", ""),
                     "protocol": b.get("label") or proto,
                     "clients": b.get("threads", STORE_CLIENTS),
                     "ops_per_second": b["items_per_second"],
                     "repetitions": b.get("repetitions", 1)})
    if not rows:
        raise RunFailed("ddpdiag_bench_store ran no benchmark with %d clients" % STORE_CLIENTS)
    return rows


def judged(r):
    """The rows the store target judges: ddpdiag's ranks against ddpdiag's
    server, i.e. the 2.x protocol, with get in one round trip. The 1.13 rows
    and get_c10d (c10d's WAIT + GET, two round trips) are shown beside them."""
    return r["protocol"] == "torch-2.x" and r["op"] != "get_c10d"


def print_store(rows):
    if not rows:
        return
    print("# store throughput, %d clients, small keys (ops/s summed over clients; median of "
          "%d run(s))" % (STORE_CLIENTS, rows[0].get("repetitions", 1)))
    print("# %8s %12s %14s %8s" % ("op", "protocol", "ops/s", "target"))
    for r in rows:
        verdict = ("met" if r["ops_per_second"] >= TARGET_STORE_OPS else "MISSED") \
            if judged(r) else "(shown)"
        print("  %8s %12s %14.0f %8s" % (r["op"], r["protocol"], r["ops_per_second"], verdict))
    print()
    sys.stdout.flush()


def store_checks(rows):
    rows = [r for r in rows if judged(r)]
    if not rows:
        return [{"name": "store_64_clients", "status": "skip",
                 "detail": "the store benchmark was not run"}]
    worst = min(rows, key=lambda r: r["ops_per_second"])
    ok = worst["ops_per_second"] >= TARGET_STORE_OPS
    return [{"name": "store_64_clients", "status": "pass" if ok else "fail",
             "detail": "lowest of the 2.x protocol's ops: %s %.0f ops/s (target >= %.0f; "
                       "%d of %d meet it)" % (
                           worst["op"], worst["ops_per_second"], TARGET_STORE_OPS,
                           sum(r["ops_per_second"] >= TARGET_STORE_OPS for r in rows),
                           len(rows))}]


# --------------------------------------------------------------------------
# Report


def utc_now():
    t = datetime.datetime.now(datetime.timezone.utc)
    return t.strftime("%Y-%m-%dT%H:%M:%S.") + "%03dZ" % (t.microsecond // 1000)


def environment():
    prefixes = ("NCCL_", "GLOO_", "MASTER_", "TORCHELASTIC_", "SLURM_", "OMPI_COMM_WORLD_")
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS")
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(prefixes) or k in names}


def write_report(path, a, state, started_at, t0, results, checks, error):
    failed = any(c["status"] == "fail" for c in checks)
    verdict = "ERROR" if error else ("FAIL" if failed else "PASS")
    libs = dict(state.get("libs") or {})
    if state.get("torch_version"):
        libs["torch"] = state["torch_version"]
    doc = {
        "schema": "ddpdiag.report/1",
        "tool": state.get("tool") or tool_block(a),
        "command": "compare-peers",
        "argv": [os.path.join(HERE, "compare_peers.sh")] + sys.argv[1:],
        "started_at": started_at,
        "duration_s": time.monotonic() - t0,
        "world": {"size": max(a.ranks), "backend": "gloo", "launcher": "none",
                  "hosts": [platform.node() or "localhost"], "ranks": [],
                  "library_versions": libs},
        "environment": environment(),
        "results": results,
        "checks": checks,
        "verdict": verdict,
        "error": error,
    }
    tmp = "%s.tmp.%d" % (path, os.getpid())
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return verdict


def tool_block(a):
    """name/version/git revision from `ddpdiag --version`, e.g.
    "ddpdiag 0.1.0 (abc1234)"."""
    try:
        out = subprocess.run([a.ddpdiag, "--version"], capture_output=True, text=True,
                             timeout=30).stdout.split()
        return {"name": "ddpdiag", "version": out[1], "git_revision": out[2].strip("()")}
    except (OSError, IndexError, subprocess.TimeoutExpired):
        return {"name": "ddpdiag", "version": "0.0.0", "git_revision": "unknown"}


# --------------------------------------------------------------------------


def parse_args():
    repo = os.path.dirname(HERE)
    ap = argparse.ArgumentParser(
        prog="compare_peers.sh",
        description="ddpdiag side by side with torch.distributed and bare Gloo")
    ap.add_argument("--build-dir", default=os.environ.get("DDPDIAG_BUILD_DIR",
                                                          os.path.join(repo, "build")),
                    help="where ddpdiag and the bench programs were built (default: build/)")
    ap.add_argument("--ddpdiag", help="the ddpdiag binary (default: BUILD/diag/ddpdiag)")
    ap.add_argument("--bare-gloo", help="default: BUILD/bench/ddpdiag_bare_gloo_allreduce")
    ap.add_argument("--rendezvous-bench", help="default: BUILD/bench/ddpdiag_rendezvous_bench")
    ap.add_argument("--store-bench", help="default: BUILD/bench/ddpdiag_bench_store")
    ap.add_argument("--python", default=sys.executable, help="Python with torch 1.13")
    ap.add_argument("--torch2-python",
                    help="Python with torch 2.x: the rendezvous is also measured against torch "
                         "2.x's TCPStore server (default: .venv-torch2/bin/ddpdiag-python when "
                         "scripts/install-torch2.sh made it; 'none': torch 1.13 only)")
    ap.add_argument("--json", default="compare-peers.json", help="report file")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: 2 ranks, 3 sizes, 1 repeat, the mlp layout at one cap, "
                         "64 rendezvous clients, short store runs")
    ap.add_argument("--ranks", default="2,4", help="world sizes for all_reduce")
    ap.add_argument("--min-bytes", default="4")
    ap.add_argument("--max-bytes", default="256M")
    ap.add_argument("--factor", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5, help="full sweeps; medians are reported")
    ap.add_argument("--iters", type=int, default=50,
                    help="timed iterations per size above --small-bytes")
    ap.add_argument("--warmup", type=int, default=5, help="warm-up iterations per size")
    ap.add_argument("--small-bytes", default="1M",
                    help="sizes up to this use --small-iters/--small-warmup")
    ap.add_argument("--small-iters", type=int, default=200)
    ap.add_argument("--small-warmup", type=int, default=20)
    ap.add_argument("--large-bytes", default="16M",
                    help="sizes above this use --large-iters/--large-warmup")
    ap.add_argument("--large-iters", type=int, default=5)
    ap.add_argument("--large-warmup", type=int, default=2)
    ap.add_argument("--caps", default="1,5,10,25,50,100", help="bucket caps (MiB) for the reducer")
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--ddp-ranks", type=int, default=2)
    ap.add_argument("--ddp-iters", type=int, default=10)
    ap.add_argument("--ddp-warmup", type=int, default=3)
    ap.add_argument("--ddp-repeats", type=int, default=3,
                    help="measurements of each cap (interleaved); the median ratio is judged")
    ap.add_argument("--rdzv-clients", default="256,1024")
    ap.add_argument("--no-native", action="store_true",
                    help="skip torch's own client on torch's server")
    ap.add_argument("--store-min-time", type=float, default=0.0,
                    help="--benchmark_min_time for the store benchmark (0: its default)")
    ap.add_argument("--skip", default="",
                    help="comma list of parts to leave out: allreduce, reducer, rendezvous, store")
    ap.add_argument("--timeout", type=int, default=300, help="seconds for any one run")
    ap.add_argument("--from-report", metavar="FILE",
                    help="print the tables and verdicts of an earlier report; measure nothing")
    ap.add_argument("--self-test", action="store_true",
                    help="run --quick into a temporary report and check it (the ctest entry)")
    a = ap.parse_args()
    if a.from_report:
        return a
    if a.self_test:
        a.quick = True
        a.json = os.path.join(tempfile.mkdtemp(prefix="compare-peers-"), "report.json")
    if a.quick:
        a.ranks, a.min_bytes, a.max_bytes, a.repeats = "2", "4", "1M", 1
        a.factor, a.iters, a.warmup = 512, 5, 1
        a.small_iters, a.small_warmup = 5, 1
        # The mlp layout: the same reducer path, a fraction of resnet50's time.
        a.caps, a.model, a.ddp_iters, a.ddp_warmup, a.ddp_repeats = "25", "mlp", 2, 1, 1
        a.rdzv_clients, a.store_min_time, a.timeout = "64", 0.05, 60
    try:
        a.ranks = [int(x) for x in a.ranks.split(",")]
        a.rdzv_clients = [int(x) for x in a.rdzv_clients.split(",")]
        a.min_bytes, a.max_bytes = parse_size(a.min_bytes), parse_size(a.max_bytes)
        a.large_bytes = parse_size(a.large_bytes)
        a.small_bytes = parse_size(a.small_bytes)
        [float(c) for c in a.caps.split(",")]
    except ValueError as e:
        ap.error(str(e))
    if min(a.iters, a.small_iters, a.large_iters) < 1 or \
            min(a.warmup, a.small_warmup, a.large_warmup) < 0:
        ap.error("--iters, --small-iters and --large-iters must be >= 1, the warm-ups >= 0")
    a.skip = {s for s in a.skip.split(",") if s}
    if a.skip - {"allreduce", "reducer", "rendezvous", "store"}:
        ap.error("--skip takes allreduce, reducer, rendezvous, store")
    if any(n < 2 for n in a.ranks) or a.repeats < 1 or a.factor < 2 or a.min_bytes < 4 or \
            a.min_bytes % 4 or a.max_bytes < a.min_bytes:
        ap.error("need ranks >= 2, repeats >= 1, factor >= 2, 4 <= min-bytes <= max-bytes, "
                 "min-bytes a multiple of 4")
    if a.torch2_python is None:
        venv = os.path.join(repo, ".venv-torch2", "bin", "ddpdiag-python")
        a.torch2_python = venv if os.access(venv, os.X_OK) else ""
    elif a.torch2_python == "none":
        a.torch2_python = ""
    b = a.build_dir
    a.ddpdiag = a.ddpdiag or os.path.join(b, "diag", "ddpdiag")
    a.bare_gloo = a.bare_gloo or os.path.join(b, "bench", "ddpdiag_bare_gloo_allreduce")
    a.rendezvous_bench = a.rendezvous_bench or os.path.join(b, "bench", "ddpdiag_rendezvous_bench")
    a.store_bench = a.store_bench or os.path.join(b, "bench", "ddpdiag_bench_store")
    for p in (a.ddpdiag, a.bare_gloo, a.rendezvous_bench, a.store_bench):
        if not os.access(p, os.X_OK):
            ap.error("%s is not built (build the ddpdiag and bench targets, or pass "
                     "--build-dir)" % p)
    return a


def self_test(a, rc):
    """The smoke test's assertions on a --quick run's report: every part ran,
    figures are positive and consistent, and ddpdiag validates and renders
    the report. Returns a list of failures."""
    bad = []

    def expect(cond, what):
        if not cond:
            bad.append(what)

    expect(rc in (0, 1), "compare_peers exited with %d" % rc)
    try:
        with open(a.json) as f:
            rep = json.load(f)
    except (OSError, ValueError) as e:
        return bad + ["no readable report at %s: %s" % (a.json, e)]
    p = subprocess.run([a.ddpdiag, "report", "validate", a.json], capture_output=True, text=True)
    expect(p.returncode == 0, "report validate: %s%s" % (p.stdout, p.stderr))
    html, md = a.json + ".html", a.json + ".md"
    p = subprocess.run([a.ddpdiag, "report", "render", a.json, "--html", html, "--markdown", md],
                       capture_output=True, text=True)
    expect(p.returncode == 0 and not p.stderr, "report render: %d %s" % (p.returncode, p.stderr))
    if p.returncode == 0:
        with open(html) as f:
            page = f.read()
        with open(md) as f:
            text = f.read()
        expect(page.count("<svg") >= 1, "the HTML has no bandwidth chart")
        for name in ("all_reduce_ratios", "reducer", "rendezvous_ratios", "store"):
            expect(("#### %s" % name) in text, "the Markdown has no %s table" % name)
    expect(rep.get("command") == "compare-peers" and rep.get("error") is None,
           "command/error: %s %s" % (rep.get("command"), rep.get("error")))
    res = rep.get("results", {})
    rows = res.get("sizes", [])
    want = {(i, 2, b) for i in ("ddpdiag", "torch", "bare_gloo") for b in (4, 2048, MiB)}
    expect({(r["algorithm"], r["world_size"], r["bytes"]) for r in rows} == want,
           "all_reduce rows: %s" % sorted((r["algorithm"], r["bytes"]) for r in rows))
    times = {}
    for r in rows:
        times[(r["algorithm"], r["bytes"])] = r["time_us"]
        expect(r["time_us"] > 0 and r["iters"] == 5, "row %s" % r)
        bw = r["bytes"] / (r["time_us"] * 1e3) * 2 * (2 - 1) / 2
        expect(abs(r["busbw_gbps"] - bw) <= 1e-9 * max(1.0, bw), "busbw of %s" % r)
    for r in res.get("all_reduce_ratios", []):
        b = r["bytes"]
        if ("ddpdiag", b) in times and ("torch", b) in times and ("bare_gloo", b) in times:
            expect(abs(r["ddpdiag_over_torch"] - times[("torch", b)] / times[("ddpdiag", b)])
                   < 1e-9, "ratio to torch at %d" % b)
            expect(abs(r["ddpdiag_over_bare_gloo"] -
                       times[("bare_gloo", b)] / times[("ddpdiag", b)]) < 1e-9,
                   "ratio to bare Gloo at %d" % b)
    expect(len(res.get("all_reduce_ratios", [])) == 3, "3 ratio rows")
    red = res.get("reducer", [])
    # An iteration of the mlp layout's gradients takes well under a minute here.
    expect(len(red) == 1 and red[0]["cap_mb"] == 25 and
           all(0 < red[0][k] < 60e6 for k in ("ddpdiag_us", "torch_us", "ddpdiag_views_us",
                                              "torch_views_us")), "reducer rows: %s" % red)
    # Like against like: each ratio is of the pair with the same settings.
    for r in red:
        expect(abs(r["ddpdiag_over_torch"] - r["ddpdiag_us"] / r["torch_us"]) < 1e-9 and
               abs(r["ddpdiag_views_over_torch_views"] - r["ddpdiag_views_us"] / r["torch_views_us"])
               < 1e-9, "reducer ratios: %s" % r)
    rz = res.get("rendezvous", [])
    gens = ["1.13"] + (["2.x"] if a.torch2_python else [])
    expect(sorted((r["torch"], r["client"], r["driver"], r["server"]) for r in rz) ==
           sorted((g, c, d, s) for g in gens
                  for c, d, s in (("ddpdiag", "threads", "ddpdiag"), ("ddpdiag", "threads", "torch"),
                                  ("ddpdiag", "epoll", "ddpdiag"), ("ddpdiag", "epoll", "torch"),
                                  ("torch", "threads", "torch"))),
           "rendezvous pairs: %s" % rz)
    for r in rz:
        expect(r["clients"] == 64 and 0 < r["connect_s"] <= r["time_s"] < 60 and
               0 < r["client_cpu_s"] < 60, "rendezvous %s" % r)
    rr = res.get("rendezvous_ratios", [])
    expect(sorted((r["torch"], r["driver"]) for r in rr) ==
           sorted((g, d) for g in gens for d in RDZV_DRIVERS), "rendezvous ratio rows: %s" % rr)
    st = res.get("store", [])
    expect({(r["op"], r["clients"]) for r in st} ==
           {(op, STORE_CLIENTS) for op in ("set", "get", "get_c10d", "add", "wait")} and
           len(st) == 10 and
           all(r["ops_per_second"] > 0 for r in st), "store rows: %s" % st)
    names = {c["name"] for c in rep.get("checks", [])}
    expect(names == {"allreduce_vs_bare_gloo_2ranks", "allreduce_vs_torch_2ranks",
                     "reducer_vs_torch_ddp", "reducer_vs_torch_ddp_views",
                     "rendezvous_1024_vs_torch_tcpstore",
                     "rendezvous_1024_vs_torch_tcpstore_epoll_clients", "store_64_clients"} |
           ({"rendezvous_1024_vs_torch2_tcpstore",
             "rendezvous_1024_vs_torch2_tcpstore_epoll_clients"} if a.torch2_python else set()),
           "checks: %s" % sorted(names))
    return bad


def torch_version(python):
    p = subprocess.run([python, "-c", "import torch; print(torch.__version__)"],
                       capture_output=True, text=True, timeout=120)
    return p.stdout.strip() if p.returncode == 0 else None


def print_report(path):
    with open(path) as f:
        rep = json.load(f)
    res = rep.get("results", {})
    if res.get("all_reduce_ratios"):
        print_allreduce(res["all_reduce_ratios"], res.get("repeats", 0))
    print_reducer([like_for_like(r) for r in res.get("reducer", [])])
    print_rendezvous(res.get("rendezvous", []), res.get("rendezvous_ratios", []))
    print_store(res.get("store", []))
    print("# targets (measured vs target)")
    for c in rep.get("checks", []):
        print("  %-48s %-5s %s" % (c["name"], c["status"].upper(), c["detail"]))
    print("# verdict: %s" % rep.get("verdict"))
    return 0


def main():
    a = parse_args()
    if a.from_report:
        return print_report(a.from_report)
    tv = torch_version(a.python)
    if not tv or not tv.startswith("1.13"):
        print("SKIP: torch 1.13 is not importable from %s (found: %s); install python3-torch" %
              (a.python, tv or "none"))
        return 77
    started_at, t0 = utc_now(), time.monotonic()
    state = {"torch_version": tv}
    results = {"repeats": a.repeats, "ranks": a.ranks, "torch_version": tv}
    if a.torch2_python and "rendezvous" not in a.skip:
        tv2 = torch_version(a.torch2_python)
        if tv2 and tv2.startswith("2."):
            results["torch2_version"] = tv2
        else:
            log("no torch 2.x from %s (found: %s): the rendezvous is measured against torch "
                "1.13's server only" % (a.torch2_python, tv2 or "none"))
            a.torch2_python = ""
    checks, error = [], None
    seconds = results["part_seconds"] = {}
    try:
        if "allreduce" not in a.skip:
            t = time.monotonic()
            plan = Plan(a)
            results["sizes"], results["all_reduce_ratios"] = measure_allreduce(a, plan, state)
            seconds["allreduce"] = time.monotonic() - t
            print_allreduce(results["all_reduce_ratios"], a.repeats)
            checks += allreduce_checks(results["all_reduce_ratios"], a.ranks)
        if "reducer" not in a.skip:
            t = time.monotonic()
            results["reducer"] = measure_reducer(a)
            seconds["reducer"] = time.monotonic() - t
            print_reducer(results["reducer"])
            checks += reducer_checks(results["reducer"])
        if "rendezvous" not in a.skip:
            t = time.monotonic()
            results["rendezvous"] = measure_rendezvous(a)
            seconds["rendezvous"] = time.monotonic() - t
            results["rendezvous_ratios"] = rendezvous_ratios(results["rendezvous"])
            print_rendezvous(results["rendezvous"], results["rendezvous_ratios"])
            checks += rendezvous_checks(results["rendezvous_ratios"])
        if "store" not in a.skip:
            t = time.monotonic()
            results["store"] = measure_store(a)
            seconds["store"] = time.monotonic() - t
            print_store(results["store"])
            checks += store_checks(results["store"])
    except RunFailed as e:
        error = {"kind": "internal", "message": str(e), "phase": "measure", "rank": None,
                 "peer": None, "hint": "run the failing command by hand to see its output",
                 "exit_code": 3}
        sys.stderr.write("compare-peers: %s\n" % e)
    verdict = write_report(a.json, a, state, started_at, t0, results, checks, error)
    print("# targets (measured vs target)")
    for c in checks:
        print("  %-48s %-5s %s" % (c["name"], c["status"].upper(), c["detail"]))
    print("# verdict: %s; report: %s" % (verdict, a.json))
    rc = 3 if error else (1 if verdict == "FAIL" else 0)
    if a.self_test:
        bad = self_test(a, rc)
        for b in bad:
            print("SELF-TEST FAILED: %s" % b)
        print("# self-test: %s (%.1f s)" % ("FAILED" if bad else "passed", time.monotonic() - t0))
        return 1 if bad else 0
    return rc


if __name__ == "__main__":
    sys.exit(main())
