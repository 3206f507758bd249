"""Helpers for the multi-process tests: find the binary, free ports, run ranks
with a deadline, parse reports. Standard library only."""
import errno
import json
import mmap
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "reports"))
from validate_hook import validate  # noqa: E402

BIN = os.environ.get("DDPDIAG_BIN", "ddpdiag")
# Generous: Gloo spins while it waits, so with more ranks than cores small
# messages cost a scheduler tick each.
DEADLINE_S = float(os.environ.get("DDPDIAG_TEST_DEADLINE", "240"))


def sanitized(path):
    """Whether the binary is built with a sanitizer: ASan and TSan reserve
    terabytes of address space for their shadow memory, so no address-space
    limit can be set under them."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        return m.find(b"__asan_init") >= 0 or m.find(b"__tsan_init") >= 0


SANITIZED = sanitized(BIN) if os.path.exists(BIN) else False
# The world sizes the multi-rank sweeps run at. Under a sanitizer 2 and 3
# (an even and an odd world; the code paths are the same at 4): four ranks
# on two cores, each several times slower, were most of that stage's time.
WORLDS = (2, 3) if SANITIZED else (2, 3, 4)

# Variables a launcher may have left in the test's own environment; every
# test builds the rank environment it means to test from a clean base.
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID",
                "TORCHELASTIC_RESTART_COUNT", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
                "SLURM_NTASKS_PER_NODE", "SLURM_STEP_ID", "SLURM_STEPID", "SLURM_JOB_ID",
                "SLURM_NODEID", "SLURM_TASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "DDPDIAG_LAUNCHER",
                "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE",
                "DDPDIAG_LAUNCHER_ARGV", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE",
                "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE", "PMI_RANK", "PMI_SIZE",
                "MPI_LOCALRANKID", "MPI_LOCALNRANKS")


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _ephemeral_range():
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
            return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port():
    """A port that is free now, outside the kernel's ephemeral range: a port
    the kernel hands out (bind to port 0) may be handed out again at once to
    another program's socket (srun's I/O listeners, any outgoing connection)
    before the test's rank binds it. Falls back to an ephemeral one."""
    lo, hi = _ephemeral_range()
    candidates = [p for p in range(10000, 32000) if not lo <= p <= hi]
    for _ in range(200):
        port = random.choice(candidates) if candidates else 0
        try:
            with socket.socket(socket.AF_INET6 if socket.has_ipv6 else socket.AF_INET) as s6, \
                    socket.socket() as s4:
                # Free on every address, as the store binds it (:: and 0.0.0.0).
                s4.bind(("0.0.0.0", port))
                if socket.has_ipv6:
                    try:
                        s6.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                        s6.bind(("::", s4.getsockname()[1]))
                    except OSError as e:
                        if e.errno != errno.EADDRNOTAVAIL:
                            raise
                return s4.getsockname()[1]
        except OSError:
            continue
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args, env=None, timeout=DEADLINE_S):
    """Runs ddpdiag once; returns CompletedProcess (text)."""
    t0 = time.monotonic()
    p = subprocess.run([BIN] + list(args), env=env or clean_env(), capture_output=True,
                       text=True, timeout=timeout)
    p.elapsed = time.monotonic() - t0
    return p


def run_ranks(args_per_rank, env_per_rank, timeout=DEADLINE_S):
    """Starts one process per rank, waits for all with a deadline; returns a
    list of (returncode, stdout, stderr, elapsed_s)."""
    procs = []
    t0 = time.monotonic()
    for args, env in zip(args_per_rank, env_per_rank):
        procs.append(subprocess.Popen([BIN] + list(args), env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    out = []
    for p in procs:
        left = max(1.0, timeout - (time.monotonic() - t0))
        try:
            so, se = p.communicate(timeout=left)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError("ranks did not finish within %.0f s" % timeout)
        out.append((p.returncode, so, se, time.monotonic() - t0))
    return out


def readline_within(proc, seconds):
    """proc.stdout.readline(), bounded: readline() has no timeout of its own,
    so a process that prints nothing within `seconds` is killed, which ends
    the read ("" then)."""
    killer = threading.Timer(seconds, proc.kill)
    killer.start()
    try:
        return proc.stdout.readline()
    finally:
        killer.cancel()


def tmp_json():
    fd, path = tempfile.mkstemp(prefix="ddpdiag-test-", suffix=".json")
    os.close(fd)
    os.unlink(path)
    return path


def unused_layer_layout():
    """A layout file (the caller deletes it) whose recorded backward never
    reaches "aux" (tensors 2 and 3, left out of ready_order): a model that
    needs find_unused_parameters or static_graph in DDP."""
    path = tmp_json()
    with open(path, "w") as f:
        f.write('{"tensors": [{"name": "a.weight", "shape": [100, 100]}, {"name": "a.bias", "shape": [100]},'
                ' {"name": "aux.weight", "shape": [300, 100]}, {"name": "aux.bias", "shape": [300]},'
                ' {"name": "head.weight", "shape": [10, 100]}, {"name": "head.bias", "shape": [10]}],'
                ' "ready_order": [5, 4, 1, 0]}')
    return path


def load(path):
    """Reads a report; every report a test reads is first checked against the
    schema."""
    validate(path)
    with open(path) as f:
        return json.load(f)


def check_report(tc, rep, world_size, verdict="PASS"):
    """Assertions every allreduce-test report must satisfy."""
    tc.assertEqual(rep["schema"], "ddpdiag.report/1")
    tc.assertEqual(rep["command"], "allreduce-test")
    tc.assertEqual(rep["world"]["size"], world_size)
    tc.assertEqual(len(rep["world"]["ranks"]), world_size)
    tc.assertEqual(sorted(r["rank"] for r in rep["world"]["ranks"]), list(range(world_size)))
    tc.assertEqual(rep["verdict"], verdict, json.dumps(rep.get("error"), indent=1))
    sizes = rep["results"]["sizes"]
    tc.assertTrue(sizes, "no sizes measured")
    for row in sizes:
        for block in ("out_of_place", "in_place"):
            b = row[block]
            if b is None:
                continue
            tc.assertEqual(b["wrong"], 0, row)
            tc.assertGreater(b["time_us"], 0)
            tc.assertGreater(b["busbw_gbps"], 0)
            tc.assertLessEqual(b["min_rank_time_us"], b["max_rank_time_us"])


def main():
    import unittest
    unittest.main(verbosity=2)
