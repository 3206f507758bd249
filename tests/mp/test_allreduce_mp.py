"""allreduce-test through the built-in launcher and under every launcher's
environment (torchrun agent store, rank-0 store, Slurm, Open MPI, flags), and
its failure modes: port taken, nothing listening, world size mismatch,
missing rank, duplicate rank, a killed rank."""
import json
import resource
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.dirname(__file__))
from common import (BIN, SANITIZED, check_report, clean_env, free_port, load,  # noqa: E402
                    readline_within, run, run_ranks, tmp_json, main, WORLDS)

SMALL = ["-b", "8", "-e", "64K", "-f", "8", "-n", "3", "-w", "1"]
ALL_TYPES = ["-d", "all", "-o", "all"]


def communicate_or_fail(test, p, timeout, what):
    """p's (stdout, stderr) once it ends within timeout; else kills it and
    fails the test with `what`."""
    try:
        return p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        test.fail(what)


def launched_ranks_seen(p, n, seconds=60):
    """Reads the launcher's output until its n ranks' "#  Rank" lines have
    come (they print them once the world is up); returns how many came."""
    seen = 0
    deadline = time.monotonic() + seconds
    while seen < n:
        line = readline_within(p, max(0.1, deadline - time.monotonic()))
        if not line:
            break
        if line.startswith("#  Rank"):
            seen += 1
    return seen


class LauncherSweeps(unittest.TestCase):
    def test_every_dtype_and_op_at_2_3_4_ranks(self):
        for n in WORLDS:
            with self.subTest(ranks=n):
                path = tmp_json()
                p = run(["allreduce-test", "--nproc", str(n), "--json", path, "-b", "8", "-e",
                         "4K", "-f", "8", "-n", "2", "-w", "1"] + ALL_TYPES)
                self.assertEqual(p.returncode, 0, p.stderr)
                rep = load(path)
                check_report(self, rep, n)
                self.assertEqual(rep["world"]["launcher"], "ddpdiag")
                seen = {(r["dtype"], r["op"]) for r in rep["results"]["sizes"]}
                self.assertEqual(len(seen), 8 * 5)
                self.assertIn("# Verdict: PASS", p.stdout)
                os.unlink(path)

    def test_table_columns_and_large_sizes(self):
        path = tmp_json()
        p = run(["allreduce-test", "--nproc", "2", "--json", path, "-b", "1M", "-e", "8M",
                 "-f", "2", "-n", "5", "-w", "2"])
        self.assertEqual(p.returncode, 0, p.stderr)
        for col in ("size", "count", "type", "redop", "algbw", "busbw", "#wrong", "slowest"):
            self.assertIn(col, p.stdout)
        rep = load(path)
        check_report(self, rep, 2)
        self.assertEqual([r["bytes"] for r in rep["results"]["sizes"]],
                         [1 << 20, 2 << 20, 4 << 20, 8 << 20])
        # busbw = algbw * 2(n-1)/n = algbw at 2 ranks.
        for r in rep["results"]["sizes"]:
            b = r["out_of_place"]
            self.assertAlmostEqual(b["busbw_gbps"], b["algbw_gbps"], places=6)
            self.assertAlmostEqual(b["algbw_gbps"], r["bytes"] / (b["time_us"] * 1e3), places=6)
        os.unlink(path)

    def test_timeout_bounds_each_op_not_the_whole_queue(self):
        # 40 all_reduces of 64 MiB queued back to back take longer than
        # --timeout 2 together, each far less: a slow sweep that moves is no
        # hang. (It was reported as one, exit 4, blaming the network.)
        path = tmp_json()
        p = run(["allreduce-test", "--nproc", "2", "--json", path, "-b", "64M", "-e", "64M",
                 "-n", "40", "-w", "0", "-c", "0", "--no-in-place", "--timeout", "2"])
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        rep = load(path)
        self.assertEqual(rep["verdict"], "PASS")
        op_us = rep["results"]["sizes"][0]["out_of_place"]["time_us"]
        if 40 * op_us < 2e6:
            self.skipTest(f"the queue took {40 * op_us / 1e6:.2f} s, under --timeout: nothing shown")
        self.assertLess(op_us, 2e6)
        os.unlink(path)

    def test_min_busbw_threshold_fails_with_exit_1(self):
        path = tmp_json()
        p = run(["allreduce-test", "--nproc", "2", "--json", path] + SMALL +
                ["--min-busbw", "100000"])
        self.assertEqual(p.returncode, 1, p.stderr)
        rep = load(path)
        self.assertEqual(rep["verdict"], "FAIL")
        self.assertTrue(any(c["name"] == "min_busbw" and c["status"] == "fail"
                            for c in rep["checks"]))
        self.assertIn("# Verdict: FAIL", p.stdout)
        os.unlink(path)

    def test_killed_rank_is_named_and_others_end(self):
        # Rank 1 is SIGKILLed mid-sweep; the job must end within the timeout
        # plus a margin, and the launcher must name rank 1 and the signal.
        path = tmp_json()
        p = subprocess.Popen([BIN, "allreduce-test", "--nproc", "3", "--timeout", "10", "--json",
                              path, "-b", "1M", "-e", "1M", "-n", "100000", "-w", "1"],
                             env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
        pid1 = None
        t0 = time.monotonic()
        while pid1 is None and time.monotonic() - t0 < 60:
            line = p.stdout.readline()
            if not line:
                break
            parts = line.split()
            if line.startswith("#  Rank") and parts[2] == "1":
                pid1 = int(parts[4])
        self.assertIsNotNone(pid1, "rank 1's pid was not printed")
        time.sleep(1.0)
        os.kill(pid1, signal.SIGKILL)
        t_kill = time.monotonic()
        out, err = communicate_or_fail(self, p, 10 + 5 + 30, "job did not end after a rank was killed")
        elapsed = time.monotonic() - t_kill
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("rank 1 (pid %d) failed first" % pid1, err)
        self.assertIn("SIGKILL", err)
        self.assertLess(elapsed, 10 + 15, err)
        rep = load(path)
        self.assertEqual(rep["verdict"], "ERROR")
        self.assertIn(rep["error"]["exit_code"], (4, 5))

    def test_rank_stopped_by_the_launcher_names_the_rank_that_failed(self):
        # Rank 1 is SIGKILLed while rank 0 is in a long simulated backward,
        # in no collective: rank 0 cannot see the failure before the
        # launcher stops it. Its report (the job's) must name rank 1 and how
        # it ended, with exit 5, not "interrupted from outside" (143).
        path = tmp_json()
        p = subprocess.Popen([BIN, "ddp-step", "--nproc", "2", "--model", "mlp", "--compute-gbps",
                              "0.0005", "-n", "1", "-w", "0", "--timeout", "3", "--json", path],
                             env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
        rank1 = None
        deadline = time.monotonic() + 30
        while rank1 is None and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.2)
            for child in os.listdir("/proc"):
                if not child.isdigit():
                    continue
                try:
                    with open(f"/proc/{child}/stat") as f:
                        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                    with open(f"/proc/{child}/environ", "rb") as f:
                        env = f.read().split(b"\0")
                except OSError:
                    continue
                if ppid == p.pid and b"RANK=1" in env:
                    rank1 = int(child)
        self.assertIsNotNone(rank1, "rank 1 did not start")
        time.sleep(1.5)  # past the rendezvous, into the backward
        os.kill(rank1, signal.SIGKILL)
        out, err = communicate_or_fail(self, p, 60, "the job did not end")
        self.assertEqual(p.returncode, 5, err)
        self.assertIn("rank 1 (pid %d) failed first: it was killed by signal 9 (SIGKILL)" % rank1, err)
        self.assertIn("OOM killer", err)
        rep = load(path)
        os.unlink(path)
        self.assertEqual(rep["verdict"], "ERROR")
        self.assertEqual(rep["error"]["exit_code"], 5)
        self.assertEqual(rep["error"]["peer"], 1)
        if rep["error"]["kind"] == "peer" and rep["error"]["phase"] == "launcher":
            self.assertIn("rank 1 (pid %d) was killed by signal 9 (SIGKILL)" % rank1, rep["error"]["message"])
        self.assertNotEqual(rep["error"]["kind"], "interrupted")

    def test_interrupted_launcher_exits_128_plus_signal_blaming_no_rank(self):
        # Ctrl-C (SIGINT) or SIGTERM to the launcher: it passes the signal on,
        # says the job was interrupted, names no rank as failed, and exits
        # 128 + the signal as shells and torchrun do.
        for sig, name, twice in ((signal.SIGINT, "SIGINT", False), (signal.SIGTERM, "SIGTERM", False),
                                 (signal.SIGINT, "SIGINT", True)):
            with self.subTest(signal=name, twice=twice):
                path = tmp_json()
                own = path[:-len(".json")] + ".rank1.json"
                # twice: under GNU timeout, which hands a signal to its child
                # and then to its process group, so the launcher gets it twice
                # within milliseconds. That is one interrupt, not a second
                # Ctrl-C that kills at once (it was, and no report was
                # written).
                wrapper = ["timeout", "300"] if twice else []
                p = subprocess.Popen(wrapper + [BIN, "allreduce-test", "--nproc", "2", "--timeout", "20",
                                                "-b", "64K", "-e", "64K", "-n", "10000000", "-w", "1",
                                                "--json", path],
                                     env=clean_env(), stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
                self.assertEqual(launched_ranks_seen(p, 2), 2, "the ranks did not start")
                time.sleep(0.5)
                p.send_signal(sig)
                out, err = communicate_or_fail(self, p, 30, "the launcher did not end after %s" % name)
                self.assertEqual(p.returncode, 128 + int(sig), err)
                self.assertIn("ddpdiag launcher: interrupted by signal %d (%s)" % (int(sig), name),
                              err)
                self.assertNotIn("failed first", err)
                # Each rank still writes its report: the job's from rank 0,
                # rank 1's own beside it, saying what stopped them.
                for f, rank in ((path, 0), (own, 1)):
                    self.assertTrue(os.path.exists(f), "%s: %s" % (f, err))
                    rep = load(f)
                    os.unlink(f)
                    self.assertEqual(rep["verdict"], "ERROR")
                    self.assertEqual(rep["error"]["kind"], "interrupted")
                    self.assertEqual(rep["error"]["exit_code"], 128 + int(sig))
                    self.assertEqual(rep["error"]["rank"], rank)
                    self.assertIn(name, rep["error"]["message"])

    def test_a_rank_whose_peer_ended_first_on_the_same_signal_says_interrupted(self):
        # SIGTERM to the launcher reaches both ranks; rank 1's signal thread
        # is held back 1.5 s (a busy machine), so rank 1 first sees rank 0,
        # stopped by the same signal, close its connection. That is the
        # interrupt's doing, not a peer failure: rank 1's report says
        # "interrupted" too.
        path = tmp_json()
        own = path[:-len(".json")] + ".rank1.json"
        p = subprocess.Popen([BIN, "allreduce-test", "--nproc", "2", "--timeout", "20", "-b", "64K",
                              "-e", "64K", "-n", "10000000", "-w", "1", "--json", path],
                             env=clean_env(DDPDIAG_TEST_SIGNAL_DELAY="1:1500"),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.assertEqual(launched_ranks_seen(p, 2), 2, "the ranks did not start")
        time.sleep(0.5)
        p.send_signal(signal.SIGTERM)
        out, err = communicate_or_fail(self, p, 30, "the launcher did not end after SIGTERM")
        self.assertEqual(p.returncode, 128 + int(signal.SIGTERM), err)
        for f, rank in ((path, 0), (own, 1)):
            self.assertTrue(os.path.exists(f), "%s: %s" % (f, err))
            rep = load(f)
            os.unlink(f)
            self.assertEqual(rep["error"]["kind"], "interrupted", "rank %d: %s" % (rank, err))
            self.assertEqual(rep["error"]["rank"], rank)
            self.assertEqual(rep["error"]["exit_code"], 128 + int(signal.SIGTERM))

    def test_ranks_of_a_killed_launcher_stop_and_write_their_reports(self):
        # A launcher killed outright (SIGKILL: `timeout -s KILL`, a CI runner,
        # the OOM killer) passes nothing on: its ranks get SIGTERM from the
        # kernel, stop at once and write what they measured, instead of
        # running on unseen until their deadlines.
        path = tmp_json()
        own = path[:-len(".json")] + ".rank1.json"
        p = subprocess.Popen([BIN, "allreduce-test", "--nproc", "2", "--timeout", "60", "-b", "64K",
                              "-e", "64K", "-n", "10000000", "-w", "1", "--json", path],
                             env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
        try:
            self.assertEqual(launched_ranks_seen(p, 2), 2, "the ranks did not start")
            with open("/proc/%d/task/%d/children" % (p.pid, p.pid)) as f:
                ranks = [int(x) for x in f.read().split()]
            self.assertEqual(len(ranks), 2, ranks)
            time.sleep(0.5)
            p.kill()
            p.communicate()

            def running(pid):
                try:
                    with open("/proc/%d/stat" % pid) as f:
                        return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
                except OSError:
                    return False

            t0 = time.monotonic()
            while any(running(r) for r in ranks) and time.monotonic() - t0 < 30:
                time.sleep(0.1)
            left = [r for r in ranks if running(r)]
            for r in left:
                os.kill(r, signal.SIGKILL)
            self.assertEqual(left, [], "ranks still running 30 s after the launcher was killed")
            for f, rank in ((path, 0), (own, 1)):
                self.assertTrue(os.path.exists(f), f)
                rep = load(f)
                self.assertEqual(rep["verdict"], "ERROR")
                self.assertEqual(rep["error"]["kind"], "interrupted")
                self.assertEqual(rep["error"]["rank"], rank)
                self.assertIn("SIGTERM", rep["error"]["message"])
        finally:
            if p.poll() is None:
                p.kill()
                p.communicate()
            for f in (path, own):
                if os.path.exists(f):
                    os.unlink(f)

    def test_report_argv_is_the_command_typed(self):
        # The ranks record the launcher's command line, --nproc included, so
        # rerunning the recorded argv starts the same world.
        path = tmp_json()
        args = ["allreduce-test", "--nproc", "3", "--json", path] + SMALL
        p = run(args)
        self.assertEqual(p.returncode, 0, p.stderr)
        rep = load(path)
        os.unlink(path)
        self.assertEqual(rep["argv"][1:], args)
        self.assertEqual(rep["world"]["size"], 3)
        self.assertNotIn("DDPDIAG_LAUNCHER_ARGV", rep["environment"])


def agent_env(rank, n, port, agent_store, extra=None):
    """The environment torchrun's agent gives worker `rank`."""
    e = dict(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=n, LOCAL_WORLD_SIZE=n, GROUP_RANK=0,
             GROUP_WORLD_SIZE=1, ROLE_RANK=rank, ROLE_WORLD_SIZE=n, ROLE_NAME="default",
             MASTER_ADDR="127.0.0.1", MASTER_PORT=port, TORCHELASTIC_RESTART_COUNT=0,
             TORCHELASTIC_MAX_RESTARTS=0, TORCHELASTIC_RUN_ID="test",
             TORCHELASTIC_USE_AGENT_STORE="True" if agent_store else "False",
             OMP_NUM_THREADS=1)
    e.update(extra or {})
    return clean_env(**e)


class LauncherEnvironments(unittest.TestCase):
    def run_world(self, envs, args=SMALL, expect=0):
        paths = [tmp_json() for _ in envs]
        res = run_ranks([["allreduce-test", "--json", p] + args for p in paths], envs)
        for rc, so, se, _ in res:
            self.assertEqual(rc, expect, se)
        rep = load(paths[0])
        for p in paths[1:]:
            self.assertFalse(os.path.exists(p), "only rank 0 writes the report")
        os.unlink(paths[0])
        return rep, res

    def test_agent_store_hosted_by_ddpdiag_store_serve(self):
        port = free_port()
        server = subprocess.Popen([BIN, "store", "serve", "--port", str(port)],
                                  stdout=subprocess.PIPE, text=True, env=clean_env())
        try:
            server.stdout.readline()
            n = 3
            rep, _ = self.run_world([agent_env(r, n, port, True) for r in range(n)])
            check_report(self, rep, n)
            self.assertEqual(rep["world"]["launcher"], "torchrun")
            self.assertEqual(rep["environment"]["TORCHELASTIC_USE_AGENT_STORE"], "True")
        finally:
            server.terminate()
            server.wait(10)

    def wait_for_sweep_table(self, rank0):
        """Reads rank 0's output until its sweep table has begun."""
        while True:
            line = readline_within(rank0, 30)
            self.assertTrue(line, "rank 0 printed no sweep table")
            if line.startswith("#   "):
                return

    def agent_store(self):
        """`ddpdiag store serve` as torchrun's agent store: (port, process)."""
        port = free_port()
        server = subprocess.Popen([BIN, "store", "serve", "--port", str(port)],
                                  stdout=subprocess.PIPE, text=True, env=clean_env())
        server.stdout.readline()
        self.addCleanup(lambda: (server.terminate(), server.wait(10), server.stdout.close()))
        return port

    def test_two_rank_0s_on_an_agent_store_are_named(self):
        # Each process given RANK=0 takes a run of its own in the agent's
        # store. A rank 0 that finds the one before it still running on this
        # machine names both and tells it; both stop at once.
        port = self.agent_store()
        cmd = [BIN, "allreduce-test", "--timeout", "20"] + SMALL
        first = subprocess.Popen(cmd, env=agent_env(0, 2, port, True), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        self.addCleanup(lambda: first.poll() is None and first.kill())
        time.sleep(1.0)  # the first one waits for its rank 1
        t0 = time.monotonic()
        res = run_ranks([cmd[1:]], [agent_env(0, 2, port, True)])
        rc, _, se, _ = res[0]
        self.assertEqual(rc, 3, se)
        self.assertIn("rank 0 is claimed twice: by pid %d on host" % first.pid, se)
        # Either rank 0 may see the other first: the second finds the first
        # still running, or the first, still waiting, finds the second's run
        # (and may have ended before the second looks). Both name runs 1 and 2.
        self.assertRegex(se, r"\(run 1(, still running)?\) and by pid \d+ on host \S+ \(run 2\)")
        so1, se1 = first.communicate(timeout=15)
        self.assertEqual(first.returncode, 3, se1)
        self.assertIn("rank 0 is claimed twice: by pid %d on host" % first.pid, se1)
        self.assertLess(time.monotonic() - t0, 15, se1)

    def test_a_rank_0_after_the_ranks_met_is_named_and_the_world_runs_on(self):
        port = self.agent_store()
        cmd = [BIN, "allreduce-test", "-b", "1M", "-e", "1M", "-n", "1500", "--timeout", "20"]
        world = [subprocess.Popen(cmd, env=agent_env(r, 2, port, True), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for r in range(2)]
        self.addCleanup(lambda: [p.kill() for p in world if p.poll() is None])
        self.wait_for_sweep_table(world[0])  # the ranks met
        res = run_ranks([cmd[1:]], [agent_env(0, 2, port, True)])
        rc, _, se, elapsed = res[0]
        self.assertEqual(rc, 3, se)
        self.assertIn("rank 0 is claimed twice: by pid %d on host" % world[0].pid, se)
        self.assertIn("(run 1, still running)", se)
        self.assertLess(elapsed, 10, se)
        for p in world:
            so, se = p.communicate(timeout=120)
            self.assertEqual(p.returncode, 0, se)

    def test_a_rank_claimed_twice_is_named_by_every_rank(self):
        # RANK=1 given to two processes: the one turned away at registration
        # calls the world off, and rank 0 keeps the store up until the other
        # claimant, which did register, has read why. Rank 0 once closed it
        # at once (counting the turned-away rank as one that left), and that
        # claimant then said only that the store had closed the connection
        # (about 1 run in 3). Ten runs: without the fix, all ten pass 2% of
        # the time.
        for attempt in range(10):
            port = free_port()
            envs = [clean_env(RANK=r, WORLD_SIZE=3, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
                    for r in (0, 1, 1)]
            res = run_ranks([["allreduce-test", "--timeout", "20"] + SMALL] * 3, envs)
            for r, (rc, _, se, elapsed) in enumerate(res):
                with self.subTest(attempt=attempt, process=r):
                    self.assertEqual(rc, 3, se)
                    self.assertIn("rank 1 is claimed twice: by pid", se)
                    self.assertNotIn("closed the connection", se)
                    self.assertLess(elapsed, 15, se)

    def test_two_rank_0s_and_a_rank_1_started_together(self):
        # Whichever rank 0 meets rank 1 first may run its (whole) world; the
        # other one is named a duplicate at once, never left to wait out
        # --timeout.
        port = self.agent_store()
        envs = [agent_env(0, 2, port, True), agent_env(0, 2, port, True), agent_env(1, 2, port, True)]
        res = run_ranks([["allreduce-test", "--timeout", "20"] + SMALL] * 3, envs)
        errs = "".join(se for _, _, se, _ in res)
        self.assertIn("rank 0 is claimed twice: by pid", errs)
        rcs = [rc for rc, _, _, _ in res]
        self.assertIn(3, rcs[:2], errs)
        for rc, _, se, elapsed in res[:2]:
            self.assertIn(rc, (0, 3), se)
        for rc, _, se, elapsed in res:
            self.assertLess(elapsed, 15, se)  # rank 1 too: it is told
        if 0 in rcs[:2]:
            self.assertEqual(rcs[2], 0, errs)  # rank 1 ran in that world

    def rank_1_met_by_a_played_rank_0(self, timeout):
        """Rank 1 on an agent store, met by a rank 0 played through the store
        that never starts its backend: returns (rank 1's process, a function
        that runs `ddpdiag store ARGS` on that store) once rank 1 has
        published its address in its backend's init."""
        port = self.agent_store()
        addr = "127.0.0.1:%d" % port

        def store(*args):
            r = subprocess.run([BIN, "store"] + list(args) + ["--addr", addr], env=clean_env(),
                               capture_output=True, text=True, timeout=30)
            self.assertEqual(r.returncode, 0, r.stderr)
            return r.stdout.strip()

        rank1 = subprocess.Popen([BIN, "allreduce-test", "--timeout", str(timeout)] + SMALL,
                                 env=agent_env(1, 2, port, True), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        self.addCleanup(lambda: rank1.poll() is None and rank1.kill())
        store("get", "ddpdiag/hello/1", "--timeout", "20")
        store("set", "ddpdiag/welcome/1", "1 %d %s" % (os.getpid(), socket.gethostname()))
        store("get", "ddpdiag/run/1/joined", "--timeout", "20")
        mine = json.loads(store("get", "ddpdiag/run/1/rank/1", "--timeout", "20"))
        mine.update(rank=0, local_rank=0, pid=os.getpid())
        store("set", "ddpdiag/run/1/rank/0", json.dumps(mine))
        store("set", "ddpdiag/run/1/joined", "2")
        deadline = time.monotonic() + 20
        while "ddpdiag/run/1/comm/gloo/rank_1" not in store("keys").split():
            self.assertLess(time.monotonic(), deadline, "rank 1 never began its backend's init")
            if rank1.poll() is not None:
                self.fail("rank 1 stopped before its backend's init: " + rank1.stderr.read())
            time.sleep(0.1)
        return rank1, store

    def test_a_world_called_off_after_a_rank_met_it_stops_that_rank_in_its_backend_init(self):
        # The race of two rank 0s, made deterministic: rank 1 meets a rank 0
        # and goes into its backend's init; then that rank 0 finds it was
        # given rank 0 twice, posts "abort" and exits without starting its
        # backend. Rank 1 must stop at once with that cause (exit 3), not
        # wait out --timeout for an address rank 0 will never publish.
        rank1, store = self.rank_1_met_by_a_played_rank_0(40)
        called_off = time.monotonic()
        store("set", "ddpdiag/run/1/abort",
              "rank 0 is claimed twice: by pid 1 on host h1 and by pid 2 on host h2")
        _, se = rank1.communicate(timeout=60)
        self.assertEqual(rank1.returncode, 3, se)
        self.assertIn("the world was called off at rendezvous: rank 0 is claimed twice: by pid 1", se)
        self.assertLess(time.monotonic() - called_off, 10, se)

    def test_a_backend_init_that_times_out_names_only_the_ranks_that_never_came(self):
        rank1, _ = self.rank_1_met_by_a_played_rank_0(4)
        _, se = rank1.communicate(timeout=60)
        self.assertEqual(rank1.returncode, 4, se)
        self.assertIn("gloo rendezvous timed out after 4000 ms on rank 1: rank(s) 0 never "
                      "published their address", se)

    def test_ranks_of_different_subcommands_are_named(self):
        port = self.agent_store()
        res = run_ranks([["allreduce-test", "--timeout", "20"] + SMALL,
                         ["ddp-step", "--model", "mlp", "--timeout", "20"]],
                        [agent_env(r, 2, port, True) for r in range(2)])
        for rc, _, se, _ in res:
            self.assertEqual(rc, 3, se)
            self.assertIn("ranks run different subcommands: rank 0 runs allreduce-test, "
                          "rank 1 (pid", se)
            self.assertIn("runs ddp-step", se)

    def test_rank0_hosts_the_store(self):
        port = free_port()
        rep, _ = self.run_world([agent_env(r, 2, port, False) for r in range(2)])
        check_report(self, rep, 2)

    def test_mpirun_inside_a_slurm_allocation_takes_its_own_ranks(self):
        # Open MPI's mpirun in a batch script: every rank inherits the
        # shell's SLURM_PROCID=0 (or its daemon step's); OMPI_COMM_WORLD_RANK
        # is the true rank. Before, both ranks were rank 0 of 2.
        port = free_port()
        envs = [clean_env(SLURM_JOB_ID=777, SLURM_PROCID=0, SLURM_NTASKS=2, SLURM_LOCALID=0,
                          SLURM_NODEID=0, SLURM_TASKS_PER_NODE=2, SLURM_STEP_ID=0,
                          OMPI_COMM_WORLD_RANK=r, OMPI_COMM_WORLD_SIZE=2,
                          OMPI_COMM_WORLD_LOCAL_RANK=r, OMPI_COMM_WORLD_LOCAL_SIZE=2,
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=port) for r in range(2)]
        rep, _ = self.run_world(envs)
        self.assertEqual(rep["world"]["launcher"], "openmpi")
        self.assertEqual(rep["world"]["size"], 2)

    @unittest.skipUnless(os.geteuid() == 0 and shutil.which("unshare"),
                         "another host name for one rank needs root (unshare --uts)")
    def test_ranks_without_local_variables_take_their_place_on_their_machine(self):
        # RANK and WORLD_SIZE alone (a cluster's pods; --rank and
        # --world-size): rank 1 on a machine of its own (here another host
        # name, through a UTS namespace) is local rank 0 there, so on NCCL
        # it takes cuda:0, not cuda:1. Two ranks on one machine stay 0 and 1.
        port = free_port()
        paths = [tmp_json(), tmp_json()]
        procs = []
        for r in range(2):
            env = clean_env(RANK=r, WORLD_SIZE=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
            cmd = [BIN, "allreduce-test", "--gloo-interface", "lo", "--json", paths[r]] + SMALL
            if r == 1:
                cmd = ["unshare", "--uts", "sh", "-c", 'hostname ddpdiag-other && exec "$@"',
                       "sh"] + cmd
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
        for p in procs:
            _, err = p.communicate(timeout=240)
            self.assertEqual(p.returncode, 0, err)
        rep = load(paths[0])
        for path in paths:
            if os.path.exists(path):
                os.unlink(path)
        ranks = {r["rank"]: r for r in rep["world"]["ranks"]}
        self.assertEqual(ranks[1]["host"], "ddpdiag-other")
        self.assertEqual((ranks[0]["local_rank"], ranks[1]["local_rank"]), (0, 0))
        port = free_port()
        rep, _ = self.run_world([clean_env(RANK=r, WORLD_SIZE=2, MASTER_ADDR="127.0.0.1",
                                           MASTER_PORT=port) for r in range(2)])
        self.assertEqual(sorted(r["local_rank"] for r in rep["world"]["ranks"]), [0, 1])

    def test_a_second_rank_0_of_the_job_is_named_and_stops_the_first(self):
        # Two processes given rank 0 of one job (SLURM_JOB_ID alike): the
        # second finds the store's port taken by the first. Both name the
        # duplicate at once; before, the second blamed "another job" on the
        # port and the first waited --timeout for a rank 1 that never came.
        port = free_port()
        env = clean_env(RANK=0, WORLD_SIZE=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                        SLURM_JOB_ID=4242)
        cmd = [BIN, "allreduce-test", "--timeout", "60"] + SMALL
        first = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True)
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # until the first serves the store
                with socket.socket() as s:
                    if s.connect_ex(("127.0.0.1", port)) == 0:
                        break
                time.sleep(0.1)
            t0 = time.monotonic()
            second = run(cmd[1:], env=env)
            _, err = first.communicate(timeout=30)
            elapsed = time.monotonic() - t0
        finally:
            if first.poll() is None:
                first.kill()
                first.communicate()
        self.assertEqual(second.returncode, 3, second.stderr)
        self.assertIn("rank 0 is claimed twice: by pid %d" % first.pid, second.stderr)
        self.assertIn("two processes were given rank 0", second.stderr)
        self.assertEqual(first.returncode, 3, err)
        self.assertIn("rank 0 is claimed twice", err)
        self.assertLess(elapsed, 30)

    def test_another_programs_store_on_the_port_is_named_to_every_rank(self):
        # MASTER_PORT is held by another program's store (here `ddpdiag
        # store serve`, no rank of this job): rank 0 cannot serve, and rank
        # 1, which reached that store, learns it there at once instead of
        # waiting --timeout for rank 0.
        port = free_port()
        server = subprocess.Popen([BIN, "store", "serve", "--port", str(port)],
                                  stdout=subprocess.PIPE, text=True, env=clean_env())
        try:
            readline_within(server, 30)
            envs = [clean_env(RANK=r, WORLD_SIZE=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
                    for r in range(2)]
            t0 = time.monotonic()
            res = run_ranks([["init-check", "--timeout", "60"]] * 2, envs)
            elapsed = time.monotonic() - t0
        finally:
            server.terminate()
            server.communicate(timeout=10)
        (rc0, _, err0, _), (rc1, _, err1, _) = res
        self.assertEqual(rc0, 3, err0)
        self.assertIn("address already in use", err0)
        self.assertEqual(rc1, 3, err1)
        self.assertIn("rank 0 refused to start", err1)
        self.assertIn("port %d is taken by another program, which answers as a store" % port, err1)
        self.assertLess(elapsed, 40)

    def test_slurm_variables(self):
        port = free_port()
        n = 2
        envs = [clean_env(SLURM_STEP_ID=0, SLURM_PROCID=r, SLURM_NTASKS=n, SLURM_LOCALID=r,
                          SLURM_NTASKS_PER_NODE=n, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
                for r in range(n)]
        rep, _ = self.run_world(envs)
        check_report(self, rep, n)
        self.assertEqual(rep["world"]["launcher"], "slurm")

    def test_a_rank_of_another_job_finding_its_rank_taken_names_the_jobs(self):
        # Job 1001 runs; a rank 1 of job 2002 reaches its store (same node,
        # same MASTER_PORT). It is named another job's rank, not "rank 1 is
        # claimed twice", and job 1001 is left alone.
        port = free_port()
        envs = [clean_env(SLURM_STEP_ID=0, SLURM_PROCID=r, SLURM_NTASKS=2, SLURM_LOCALID=r,
                          SLURM_NTASKS_PER_NODE=2, SLURM_JOB_ID=1001, MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=port) for r in range(2)]
        cmd = [BIN, "allreduce-test", "-b", "1M", "-e", "1M", "-n", "1500", "--timeout", "30"]
        world = [subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for e in envs]
        self.addCleanup(lambda: [p.kill() for p in world if p.poll() is None])
        self.wait_for_sweep_table(world[0])
        stray = dict(envs[1], SLURM_JOB_ID="2002")
        res = run_ranks([cmd[1:]], [stray])
        rc, _, se, elapsed = res[0]
        self.assertEqual(rc, 3, se)
        self.assertIn("ranks of different jobs met at the store 127.0.0.1:%d: rank 1 there is pid %d"
                      % (port, world[1].pid), se)
        self.assertIn("from SLURM_JOB_ID=1001", se)
        self.assertIn("is rank 1 of SLURM_JOB_ID=2002", se)
        self.assertNotIn("claimed twice", se)
        self.assertLess(elapsed, 15, se)
        for p in world:
            _, err = p.communicate(timeout=120)
            self.assertEqual(p.returncode, 0, err)

    def test_ranks_of_another_job_on_the_same_port_are_refused(self):
        # Two Slurm jobs that share a node and MASTER_PORT: job 2002's rank 1
        # reaches job 1001's store. Both ranks stop, naming both jobs, rather
        # than run a world made of two jobs.
        port = free_port()
        n = 2
        envs = [clean_env(SLURM_STEP_ID=0, SLURM_PROCID=r, SLURM_NTASKS=n, SLURM_LOCALID=r,
                          SLURM_NTASKS_PER_NODE=n, SLURM_JOB_ID=1001 + 1001 * r,
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=port) for r in range(n)]
        paths = [tmp_json() for _ in envs]
        res = run_ranks([["allreduce-test", "--timeout", "20", "--json", p] + SMALL
                         for p in paths], envs)
        for rc, so, se, _ in res:
            self.assertEqual(rc, 3, se)
            self.assertIn("ranks of different jobs met at the store", se)
            self.assertIn("rank 1 (pid", se)
            self.assertIn("is from SLURM_JOB_ID=2002", se)
            self.assertIn("rank 0 is from SLURM_JOB_ID=1001", se)
        for p in paths + [paths[1][:-len(".json")] + ".rank1.json"]:
            if os.path.exists(p):
                os.unlink(p)

    def test_open_mpi_variables(self):
        port = free_port()
        n = 2
        envs = [clean_env(OMPI_COMM_WORLD_RANK=r, OMPI_COMM_WORLD_SIZE=n,
                          OMPI_COMM_WORLD_LOCAL_RANK=r, OMPI_COMM_WORLD_LOCAL_SIZE=n,
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=port) for r in range(n)]
        rep, _ = self.run_world(envs)
        check_report(self, rep, n)
        self.assertEqual(rep["world"]["launcher"], "openmpi")

    def test_mpich_intel_mpi_and_mvapich_variables(self):
        # The variables MPICH's and Intel MPI's Hydra (PMI_*, MPI_LOCAL*) and
        # MVAPICH's mpirun_rsh (MV2_COMM_WORLD_*) give each rank.
        n = 2
        for launcher, names in (("mpich", ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")),
                                ("mvapich", ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE",
                                             "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"))):
            with self.subTest(launcher=launcher):
                port = free_port()
                envs = [clean_env(**dict(zip(names, (r, n, r, n))), MASTER_ADDR="127.0.0.1",
                                  MASTER_PORT=port) for r in range(n)]
                rep, _ = self.run_world(envs)
                check_report(self, rep, n)
                self.assertEqual(rep["world"]["launcher"], launcher)
                self.assertEqual(rep["environment"].get(names[1]), str(n))

    def test_explicit_flags_win(self):
        port = free_port()
        n = 2
        # The environment says something else; flags must win.
        envs = [clean_env(RANK=5, WORLD_SIZE=9, MASTER_PORT=1) for _ in range(n)]
        paths = [tmp_json() for _ in range(n)]
        res = run_ranks([["allreduce-test", "--rank", str(r), "--world-size", str(n),
                          "--master-addr", "127.0.0.1", "--master-port", str(port), "--json",
                          paths[r]] + SMALL for r in range(n)], envs)
        for rc, so, se, _ in res:
            self.assertEqual(rc, 0, se)
        check_report(self, load(paths[0]), n)


class RefusalBeforeTheRendezvous(unittest.TestCase):
    """A rank that refuses to start (its flags, its memory) before the
    rendezvous tells the others, started by hand or by srun, at once: they
    stop naming it (exit 3) instead of waiting out --timeout (60 s here)."""

    def start(self, n, args, limit_as_of=None, json_of=None, late=None):
        port = free_port()
        procs, t0 = [], time.monotonic()
        for r in range(n):
            extra = ["--json", json_of[r]] if json_of and json_of.get(r) else []
            limit = None
            if limit_as_of is not None and r == limit_as_of:
                def limit():
                    resource.setrlimit(resource.RLIMIT_AS, (900 << 20, 900 << 20))
            if late is not None and r == late:
                time.sleep(3)
            procs.append(subprocess.Popen(
                [BIN] + args + ["--rank", str(r), "--world-size", str(n), "--master-addr",
                                "127.0.0.1", "--master-port", str(port), "--timeout", "60"] + extra,
                env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                preexec_fn=limit))
        return self.communicate_all(procs, t0)

    @staticmethod
    def communicate_all(procs, t0):
        """(rc, stderr, seconds since t0) of each rank; fails when one is
        still waiting after 50 s, for a rank that had refused."""
        out = []
        for p in procs:
            try:
                _, se = p.communicate(timeout=50)
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise AssertionError("a rank waited for one that had refused to start")
            out.append((p.returncode, se, time.monotonic() - t0))
        return out

    def test_rank_0_refusing_its_report_path(self):
        for command, args, phase in (("allreduce-test", SMALL, "rendezvous"),
                                     ("init-check", [], "wait_for_ranks")):
            with self.subTest(command=command):
                res = self.start(3, [command] + args, json_of={0: "/nonexistent-dir/out.json"})
                self.assertEqual(res[0][0], 2, res[0][1])
                self.assertIn("--json /nonexistent-dir/out.json", res[0][1])
                # One error: the report is not tried there again.
                self.assertNotIn("cannot write report", res[0][1])
                for rc, se, elapsed in res[1:]:
                    self.assertEqual(rc, 3, se)
                    self.assertIn("rank 0 refused to start, so this world cannot meet: --json "
                                  "/nonexistent-dir/out.json: cannot write the report there", se)
                    self.assertIn("(peer rank 0) during %s" % phase, se)
                    self.assertLess(elapsed, 30, se)

    @unittest.skipIf(SANITIZED, "no address-space limit can be set under a sanitizer")
    def test_rank_1_refusing_for_its_address_space_limit(self):
        # 256 MiB buffers need about 0.8 GiB; rank 1 alone may map 900 MiB.
        res = self.start(3, ["allreduce-test", "-b", "256M", "-e", "256M", "-n", "1", "-w", "0"],
                         limit_as_of=1)
        self.assertEqual(res[1][0], 2, res[1][1])
        self.assertIn("its address-space limit (ulimit -v) is", res[1][1])
        for r in (0, 2):
            rc, se, elapsed = res[r]
            self.assertEqual(rc, 3, se)
            self.assertIn("(peer rank 1) during rendezvous: rank 1 refused to start, so this world "
                          "cannot meet: buffers of 256M", se)
            self.assertLess(elapsed, 30, se)

    @unittest.skipIf(SANITIZED, "no address-space limit can be set under a sanitizer")
    def test_a_rank_started_late_still_learns_of_the_refusal(self):
        # Rank 0 meets rank 1's refusal at once; rank 2 comes 3 s later, and
        # rank 0 kept the store up for it.
        res = self.start(3, ["allreduce-test", "-b", "256M", "-e", "256M", "-n", "1", "-w", "0"],
                         limit_as_of=1, late=2)
        self.assertEqual([r[0] for r in res], [3, 2, 3], [r[1] for r in res])
        self.assertIn("rank 0 keeps the store", res[0][1])
        self.assertIn("(peer rank 1) during rendezvous: rank 1 refused to start", res[2][1])
        self.assertLess(res[2][2], 20, res[2][1])

    def test_rank_refused_its_place_in_the_world_tells_the_others(self):
        # A node's script exported another WORLD_SIZE (rank 3 of 4 told 3),
        # a rank that is no number, a rank 0 told WORLD_SIZE=0: each refuses
        # before it knows a world. With the store's address given, it posts
        # why (rank 0 hosting the store to say so), and the others stop
        # naming it instead of waiting out --timeout for it (60 s).
        cases = [({3: ("3", "3")}, 4, 3, "rank 3 refused to start, so this world cannot meet: "
                  "RANK=3 is out of range for WORLD_SIZE=3"),
                 ({2: ("abc", "3")}, 3, 2, "a rank whose rank is not valid refused to start, so "
                  "this world cannot meet: environment variable RANK='abc' is not an integer"),
                 ({0: ("0", "0")}, 3, 0, "rank 0 refused to start, so this world cannot meet: "
                  "WORLD_SIZE=0 must be at least 1")]
        for odd, n, refused, message in cases:
            with self.subTest(refused=odd):
                port = free_port()
                t0 = time.monotonic()
                procs = []
                for r in range(n):
                    rank, size = odd.get(r, (str(r), str(n)))
                    env = clean_env()
                    env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": rank,
                                "WORLD_SIZE": size})
                    procs.append(subprocess.Popen([BIN, "allreduce-test"] + SMALL + ["--timeout", "60"],
                                                  env=env, stdout=subprocess.PIPE,
                                                  stderr=subprocess.PIPE, text=True))
                res = self.communicate_all(procs, t0)
                self.assertEqual(res[refused][0], 2, res[refused][1])
                for r, (rc, se, elapsed) in enumerate(res):
                    if r == refused:
                        continue
                    self.assertEqual(rc, 3, se)
                    self.assertIn(message, se)
                    self.assertLess(elapsed, 30, se)

    def test_every_rank_refusing_ends_at_once(self):
        # 1000 GiB buffers fit on no rank: each says so, and rank 0 does not
        # keep the store up for ranks that all refused too.
        res = self.start(3, ["allreduce-test", "-b", "1000G", "-e", "1000G"])
        for rc, se, elapsed in res:
            self.assertEqual(rc, 2, se)
            self.assertIn("buffers of 1000G", se)
            self.assertLess(elapsed, 25, se)


class BadInput(unittest.TestCase):
    TIMEOUT = 4

    def test_store_port_in_use(self):
        with socket.socket() as s:
            s.bind(("0.0.0.0", 0))
            s.listen()
            port = s.getsockname()[1]
            p = run(["allreduce-test", "--rank", "0", "--world-size", "2", "--master-port",
                     str(port), "--timeout", str(self.TIMEOUT)] + SMALL)
        self.assertEqual(p.returncode, 3, p.stderr)
        self.assertIn(str(port), p.stderr)
        self.assertIn("in use", p.stderr)
        self.assertLess(p.elapsed, self.TIMEOUT + 5)

    def test_nothing_listens(self):
        port = free_port()
        p = run(["allreduce-test", "--rank", "1", "--world-size", "2", "--master-addr",
                 "127.0.0.1", "--master-port", str(port), "--timeout", str(self.TIMEOUT)] + SMALL)
        self.assertEqual(p.returncode, 3, p.stderr)
        self.assertIn("refused", p.stderr)
        self.assertIn("127.0.0.1:%d" % port, p.stderr)
        self.assertLess(p.elapsed, self.TIMEOUT + 5)

    def test_rank_that_cannot_reach_the_store_writes_its_own_report(self):
        # Rank 1 cannot hand its story to rank 0, so it writes FILE.rank1.json
        # (never FILE: that is the job's, from rank 0).
        for command in ("allreduce-test", "init-check"):
            with self.subTest(command=command):
                path = tmp_json()
                own = path[:-len(".json")] + ".rank1.json"
                try:
                    env = clean_env(RANK=1, WORLD_SIZE=2, MASTER_ADDR="127.0.0.1",
                                    MASTER_PORT=free_port())
                    p = run([command, "--timeout", "1", "--json", path], env=env)
                    self.assertEqual(p.returncode, 3, p.stderr)
                    self.assertIn("rank 1 could not reach the store; its own report: %s" % own,
                                  p.stderr)
                    self.assertFalse(os.path.exists(path))
                    rep = load(own)
                    self.assertEqual(rep["command"], command)
                    self.assertEqual(rep["verdict"], "ERROR")
                    self.assertEqual(rep["error"]["rank"], 1)
                    self.assertEqual(rep["error"]["exit_code"], 3)
                    self.assertIn("refused", rep["error"]["message"])
                    # What this rank knew of its world: everything but its peers.
                    world = rep["world"]
                    self.assertEqual((world["size"], world["backend"], world["launcher"]),
                                     (2, "gloo", "env"))
                    self.assertEqual([r["rank"] for r in world["ranks"]], [1])
                    self.assertGreater(world["ranks"][0]["pid"], 0)
                    if command == "init-check":
                        ranks = rep["results"]["ranks"]
                        self.assertEqual([r["rank"] for r in ranks], [1])
                        status = {ph["name"]: ph["status"] for ph in ranks[0]["phases"]}
                        self.assertEqual(status["environment"], "ok")
                        self.assertEqual(status["store_connect"], "fail")
                        self.assertTrue(any(c["name"] == "store_connect" and c["status"] == "fail"
                                            for c in rep["checks"]))
                    self.assertLess(p.elapsed, self.TIMEOUT + 5)
                finally:
                    for f in (path, own):
                        if os.path.exists(f):
                            os.unlink(f)

    def test_early_failures_record_the_known_world(self):
        # Once the environment is read, the world's size, the backend, the
        # launcher and this rank are known: a run that fails in the
        # rendezvous records them, and every rank that had registered.
        host = socket.gethostname()
        for command in ("allreduce-test", "init-check"):
            with self.subTest(command=command):
                port = free_port()
                path = tmp_json()
                own = path[:-len(".json")] + ".rank1.json"
                extra = SMALL if command == "allreduce-test" else []
                # Ranks 0 and 1 of 3: rank 2 never comes.
                res = run_ranks([[command, "--rank", str(r), "--world-size", "3", "--master-addr",
                                  "127.0.0.1", "--master-port", str(port), "--timeout", "2",
                                  "--json", path] + extra for r in range(2)],
                                [clean_env(), clean_env()], timeout=60)
                try:
                    self.assertEqual(res[0][0], 3, res[0][2])
                    rep = load(path)
                    self.assertIn("never arrived: 2", rep["error"]["message"])
                    world = rep["world"]
                    self.assertEqual((world["size"], world["backend"], world["launcher"]),
                                     (3, "gloo", "flags"))
                    self.assertEqual([(r["rank"], r["local_rank"], r["host"], r["device"])
                                      for r in world["ranks"]],
                                     [(0, 0, host, "cpu"), (1, 1, host, "cpu")])
                    self.assertEqual(world["hosts"], [host])
                    self.assertTrue(world["library_versions"]["gloo"].startswith("gloo "))
                    self.assertEqual(world["gloo_threads"], 2)
                finally:
                    for f in (path, own):
                        if os.path.exists(f):
                            os.unlink(f)

    def test_backend_that_cannot_start_records_the_world(self):
        # --backend nccl where there is no GPU (or no NCCL in this build): the
        # backend fails to start after the rendezvous, which every rank passed.
        for command in ("allreduce-test", "init-check"):
            with self.subTest(command=command):
                path = tmp_json()
                extra = SMALL if command == "allreduce-test" else []
                p = run([command, "--backend", "nccl", "--rank", "0", "--world-size", "1",
                         "--timeout", "5", "--json", path] + extra, timeout=60)
                try:
                    if p.returncode == 0:
                        self.skipTest("NCCL runs here: there is a GPU")
                    self.assertIn(p.returncode, (2, 3), p.stderr)
                    rep = load(path)
                    self.assertEqual(rep["verdict"], "ERROR")
                    world = rep["world"]
                    self.assertEqual((world["size"], world["backend"], world["launcher"]),
                                     (1, "nccl", "flags"))
                    self.assertEqual([(r["rank"], r["device"]) for r in world["ranks"]],
                                     [(0, "cuda:0")])
                    self.assertNotIn("gloo_threads", world)
                finally:
                    if os.path.exists(path):
                        os.unlink(path)

    def test_nproc_with_world_flags_is_a_usage_error(self):
        # --nproc starts a world of its own: flags that set a rank's world
        # cannot go with it. One message naming the flags, before any rank.
        for flags, named in ((["--rank", "0", "--world-size", "1"], "--rank and --world-size"),
                             (["--master-port", "29500"], "--master-port"),
                             (["--local-world-size", "3"], "--local-world-size")):
            with self.subTest(flags=flags):
                p = run(["allreduce-test", "--nproc", "2"] + flags + ["-e", "1K"])
                self.assertEqual(p.returncode, 2, p.stderr)
                self.assertIn("--nproc 2 cannot be combined with %s" % named, p.stderr)
                self.assertNotIn("[rank", p.stderr)  # no rank was started
                self.assertNotIn("LOCAL_WORLD_SIZE", p.stderr)
                self.assertEqual(p.stderr.count("ddpdiag: error"), 1, p.stderr)

    def test_nproc_in_every_rank_of_a_launchers_job_is_a_usage_error(self):
        # `torchrun --nproc-per-node 2 ddpdiag ... --nproc 2` (or mpirun's)
        # ran two separate worlds that both passed. Slurm's batch shell
        # (SLURM_PROCID=0 and SLURM_NTASKS set) keeps --nproc.
        for env, named in (({"RANK": 1, "WORLD_SIZE": 2, "TORCHELASTIC_RUN_ID": "x"},
                            "rank 1 of 2 (RANK=1, WORLD_SIZE=2, as torchrun sets them)"),
                           ({"OMPI_COMM_WORLD_RANK": 0, "OMPI_COMM_WORLD_SIZE": 4},
                            "rank 0 of 4 (OMPI_COMM_WORLD_RANK=0, OMPI_COMM_WORLD_SIZE=4, as "
                            "mpirun (Open MPI) sets them)"),
                           ({"PMI_RANK": 1, "PMI_SIZE": 2}, "as mpiexec (MPICH, Intel MPI) sets them"),
                           # A task srun started (its step's SLURM_STEP_ID).
                           ({"SLURM_STEP_ID": 0, "SLURM_PROCID": 1, "SLURM_NTASKS": 2,
                             "SLURM_JOB_ID": 7},
                            "rank 1 of 2 (SLURM_PROCID=1, SLURM_NTASKS=2, as srun sets them)")):
            with self.subTest(env=env):
                p = run(["allreduce-test", "--nproc", "2", "-e", "1K"], env=clean_env(**env))
                self.assertEqual(p.returncode, 2, p.stderr)
                self.assertIn("--nproc 2 cannot be used in one rank of a launcher's job: this "
                              "process is " if "RANK" in env else "--nproc 2 cannot be used", p.stderr)
                self.assertIn(named, p.stderr)
                self.assertNotIn("[rank", p.stderr)  # no world was started
        p = run(["allreduce-test", "--nproc", "2"] + SMALL,
                env=clean_env(SLURM_PROCID=0, SLURM_NTASKS=2, SLURM_JOB_ID=7))
        self.assertEqual(p.returncode, 0, p.stderr)

    def test_a_batch_scripts_shell_is_no_rank_of_the_allocation(self):
        # sbatch -n 2: the script's own shell has SLURM_PROCID=0 and
        # SLURM_NTASKS=2 but no srun step. ddpdiag run there starts its own
        # local world (and says so) instead of waiting, as rank 0 of 2, for a
        # rank 1 that never comes.
        batch = dict(SLURM_JOB_ID=99, SLURM_PROCID=0, SLURM_LOCALID=0, SLURM_NODEID=0,
                     SLURM_NTASKS=2, SLURM_TASKS_PER_NODE=2, SLURM_JOB_NODELIST="vm")
        t0 = time.monotonic()
        path = tmp_json()
        p = run(["allreduce-test", "--timeout", "20", "--json", path] + SMALL,
                env=clean_env(**batch))
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertLess(time.monotonic() - t0, 20)
        self.assertIn("Slurm job 99: this shell is not a task srun started", p.stderr)
        self.assertIn("starts 2 local rank(s) of its own", p.stderr)
        rep = load(path)
        os.unlink(path)
        self.assertEqual(rep["world"]["launcher"], "ddpdiag")
        # Without SLURM_NTASKS (sbatch without -n) alike: no "SLURM_NTASKS is
        # not set" refusal.
        batch.pop("SLURM_NTASKS")
        p = run(["allreduce-test"] + SMALL, env=clean_env(**batch))
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)

    def test_default_world_with_store_flags_is_a_usage_error(self):
        # No launcher, no --rank/--world-size: ddpdiag starts its own ranks
        # and hosts their store on a free port; a store address of the
        # user's would send them to a port nobody serves.
        for flags, named in ((["--master-port", "29500"], "--master-port"),
                             (["--master-addr", "127.0.0.1", "--local-rank", "0"],
                              "--local-rank and --master-addr")):
            with self.subTest(flags=flags):
                p = run(["allreduce-test"] + flags + ["-e", "1K", "--timeout", "30"],
                        env=clean_env())
                self.assertEqual(p.returncode, 2, p.stderr)
                self.assertIn("%s cannot be used without --rank and --world-size" % named,
                              p.stderr)
                self.assertNotIn("[rank", p.stderr)
                self.assertLess(p.elapsed, 10)

    def test_report_paths_are_checked_before_anything_is_measured(self):
        # A report that could not be written must not cost a whole sweep:
        # a missing directory, a directory as the path, and one file for
        # both --json and --markdown are refused at once, before any rank.
        d = tempfile.mkdtemp()
        try:
            for flags, said in ((["--json", os.path.join(d, "missing", "r.json")],
                                 "does not exist"),
                                (["--json", d], "is a directory"),
                                (["--json", os.path.join(d, "r.json"), "--markdown",
                                  os.path.join(d, ".", "r.json")], "name the same file")):
                with self.subTest(flags=flags):
                    p = run(["allreduce-test", "--nproc", "2", "-e", "1K"] + flags)
                    self.assertEqual(p.returncode, 2, p.stderr)
                    self.assertIn(said, p.stderr)
                    self.assertNotIn("[rank", p.stderr)
                    self.assertLess(p.elapsed, 10)
            # A rank started alone (rank 0 of a world) checks too, before the rendezvous.
            p = run(["allreduce-test", "--rank", "0", "--world-size", "2", "--master-port",
                     str(free_port()), "--timeout", "30", "--json",
                     os.path.join(d, "missing", "r.json")])
            self.assertEqual(p.returncode, 2, p.stderr)
            self.assertLess(p.elapsed, 10)
        finally:
            shutil.rmtree(d, ignore_errors=True)

    def test_ranks_with_different_flags_are_refused(self):
        # Rank 1 would run sizes rank 0 never runs: rank 0 must not pass
        # while rank 1 hangs. Both stop at the rendezvous, naming the flag.
        port = free_port()
        res = run_ranks([["allreduce-test", "--rank", str(r), "--world-size", "2",
                          "--master-port", str(port), "--timeout", str(self.TIMEOUT),
                          "-b", "1K", "-e", e, "-n", "2", "-w", "1",
                          "--json", os.path.join(tempfile.gettempdir(), "ddpdiag-flags-%d-%d.json"
                                                 % (os.getpid(), r))]
                         for r, e in ((0, "1K"), (1, "4K"))],
                        [clean_env(), clean_env()], timeout=self.TIMEOUT + 20)
        for rc, so, se, elapsed in res:
            self.assertEqual(rc, 3, se)
            self.assertIn("ranks were started with different settings", se)
            self.assertIn("--maxbytes: rank 1 has --maxbytes 4K, rank 0 has --maxbytes 1K", se)
            self.assertNotIn("Verdict: PASS", so)
            self.assertLess(elapsed, self.TIMEOUT + 5)

    def test_one_setting_spelt_two_ways_is_no_disagreement(self):
        # -e 16K and -e 16384, -f 2 and -f 2.0, -w 5 and the default 5: the
        # same run. Only what the ranks would do differently is refused.
        port = free_port()
        res = run_ranks([["allreduce-test", "--rank", str(r), "--world-size", "2",
                          "--master-port", str(port), "--timeout", str(self.TIMEOUT),
                          "-b", "1K", "-n", "2"] + extra
                         for r, extra in ((0, ["-e", "16K", "-f", "2", "-w", "5"]),
                                          (1, ["-e", "16384", "-f", "2.0", "--gloo-threads", "2"]))],
                        [clean_env(), clean_env()], timeout=self.TIMEOUT + 20)
        for rc, so, se, elapsed in res:
            self.assertEqual(rc, 0, se)
        self.assertIn("Verdict: PASS", res[0][1])
        # Names of one dtype or op, --backend auto and the backend it picks
        # here (gloo: no GPU), dp-vs-ring's --world-sizes left at the job's
        # size and given as it; a different dtype is still refused.
        for command, extras, rc in (
                ("allreduce-test", (["-d", "float", "-o", "avg", "--backend", "gloo"],
                                    ["-d", "float32", "-o", "mean"]), 0),
                ("dp-vs-ring", (["--world-sizes", "2"], []), 0),
                ("dp-vs-ring", (["--world-sizes", "1"], []), 3),
                ("allreduce-test", (["-d", "float"], ["-d", "double"]), 3)):
            with self.subTest(command=command, extras=extras):
                port = free_port()
                res = run_ranks([[command, "--rank", str(r), "--world-size", "2", "--master-port", str(port),
                                  "--timeout", str(self.TIMEOUT), "-b", "1K", "-e", "1K", "-n", "2"] + extras[r]
                                 for r in range(2)],
                                [clean_env(), clean_env()], timeout=self.TIMEOUT + 20)
                for r_rc, so, se, elapsed in res:
                    self.assertEqual(r_rc, rc, se)
                    if rc == 3:
                        self.assertIn("ranks were started with different settings", se)

    def test_a_report_path_given_only_to_another_rank_is_named(self):
        # Rank 0 writes the job's report: --json on rank 1 alone writes
        # nothing, and both ranks say so (the run itself goes on).
        port = free_port()
        path = tmp_json()  # a name only
        res = run_ranks([["allreduce-test", "--rank", str(r), "--world-size", "2",
                          "--master-port", str(port), "--timeout", str(self.TIMEOUT),
                          "-b", "1K", "-e", "1K", "-n", "2"] + (["--json", path] if r == 1 else [])
                         for r in range(2)],
                        [clean_env(), clean_env()], timeout=self.TIMEOUT + 20)
        for r, (rc, so, se, elapsed) in enumerate(res):
            self.assertEqual(rc, 0, se)
            self.assertIn("warning on rank %d: rank(s) 1 were given --json or --markdown and rank 0 "
                          "was not" % r, se)
        self.assertFalse(os.path.exists(path))

    def test_another_rank_warns_of_a_report_path_it_could_not_write(self):
        # Rank 1 writes its own report only when it fails apart from rank 0,
        # and its host may lack rank 0's directory: it warns at the start
        # (the run goes on) rather than lose its report at the failure.
        port = free_port()
        path = tmp_json()
        bad = "/nonexistent-ddpdiag-dir/out.json"
        res = run_ranks([["allreduce-test", "--rank", str(r), "--world-size", "2",
                          "--master-port", str(port), "--timeout", str(self.TIMEOUT),
                          "-b", "1K", "-e", "1K", "-n", "2", "--json", path if r == 0 else bad]
                         for r in range(2)],
                        [clean_env(), clean_env()], timeout=self.TIMEOUT + 20)
        try:
            for rc, so, se, elapsed in res:
                self.assertEqual(rc, 0, se)
            self.assertIn("ddpdiag: warning on rank 1: --json %s: should this rank fail on its own, "
                          "it could not write its report /nonexistent-ddpdiag-dir/out.rank1.json: "
                          "the directory /nonexistent-ddpdiag-dir" % bad, res[1][2])
            self.assertNotIn("should this rank fail", res[0][2])
            self.assertEqual(load(path)["verdict"], "PASS")
        finally:
            if os.path.exists(path):
                os.unlink(path)

    def test_ipv6_master_addr_reaches_rank_0s_store(self):
        # Rank 0 hosts the store on every address of its host, IPv6 too, as
        # torch's server does; "[::1]" is the URL form of ::1.
        try:
            with socket.socket(socket.AF_INET6) as s:
                s.bind(("::1", 0))
        except OSError:
            self.skipTest("no IPv6 loopback here")
        for addr in ("::1", "[::1]"):
            with self.subTest(addr=addr):
                port = free_port()
                res = run_ranks([["allreduce-test", "--timeout", str(self.TIMEOUT)] + SMALL] * 2,
                                [clean_env(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(r),
                                           WORLD_SIZE="2") for r in range(2)],
                                timeout=self.TIMEOUT + 20)
                for rc, so, se, _ in res:
                    self.assertEqual(rc, 0, se)

    def test_rank_0_names_a_master_addr_that_does_not_lead_to_it(self):
        # Rank 0 hosts the store; when nobody arrives, a MASTER_ADDR that
        # does not resolve here is named as the likely cause.
        p = run(["allreduce-test", "--timeout", "2"] + SMALL,
                env=clean_env(MASTER_ADDR="no-such-host.invalid", MASTER_PORT=str(free_port()),
                              RANK="0", WORLD_SIZE="2"))
        self.assertEqual(p.returncode, 3, p.stderr)
        self.assertIn("MASTER_ADDR='no-such-host.invalid' does not resolve", p.stderr)

    def test_world_size_disagrees(self):
        port = free_port()
        sizes = [2, 3]
        res = run_ranks([["allreduce-test", "--rank", str(r), "--world-size", str(sizes[r]),
                          "--master-port", str(port), "--timeout", str(self.TIMEOUT)] + SMALL
                         for r in range(2)], [clean_env(), clean_env()],
                        timeout=self.TIMEOUT + 20)
        for rc, so, se, elapsed in res:
            self.assertEqual(rc, 3, se)
            self.assertIn("world size", se)
            self.assertLess(elapsed, self.TIMEOUT + 5)

    def test_missing_rank_is_named(self):
        port = free_port()
        p = run(["allreduce-test", "--rank", "0", "--world-size", "3", "--master-port", str(port),
                 "--timeout", str(self.TIMEOUT)] + SMALL)
        self.assertEqual(p.returncode, 3, p.stderr)
        self.assertIn("never arrived: 1-2", p.stderr)
        self.assertLess(p.elapsed, self.TIMEOUT + 5)

    def test_duplicate_rank_is_named(self):
        port = free_port()
        res = run_ranks([["allreduce-test", "--rank", str(r), "--world-size", "3",
                          "--master-port", str(port), "--timeout", str(self.TIMEOUT)] + SMALL
                         for r in (0, 1, 1)], [clean_env()] * 3, timeout=self.TIMEOUT + 20)
        errs = "".join(se for _, _, se, _ in res)
        self.assertIn("claimed twice", errs)
        for rc, _, se, elapsed in res:
            self.assertEqual(rc, 3, se)
            self.assertLess(elapsed, self.TIMEOUT + 5)

    def test_bad_environment_is_exit_2(self):
        p = run(["allreduce-test"] + SMALL, env=clean_env(RANK="one", WORLD_SIZE=2))
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("RANK='one'", p.stderr)
        path = tmp_json()
        own = path[:-len(".json")] + ".rank2.json"
        p = run(["allreduce-test", "--json", path] + SMALL, env=clean_env(RANK=2, WORLD_SIZE=2))
        self.assertEqual(p.returncode, 2)
        self.assertIn("RANK=2 is out of range", p.stderr)
        # Not rank 0: its report goes beside the job's, not over it.
        self.assertFalse(os.path.exists(path))
        rep = load(own)
        os.unlink(own)
        self.assertEqual(rep["error"]["exit_code"], 2)
        self.assertIn("rank 2 was refused its place in the world", p.stderr)

    def test_bad_flags_are_exit_2(self):
        p = run(["allreduce-test", "--nproc", "2", "-d", "complex"])
        self.assertEqual(p.returncode, 2)
        self.assertIn("complex", p.stderr)
        # Each bad value is refused before any rank starts, with a message
        # that names the flag and what it takes.
        cases = [
            (["--nproc", "0"], "--nproc: must be a number > 0, not 0"),
            (["--nproc", "-3"], "--nproc: must be a number > 0, not -3"),
            (["-n", "0"], "--iters: must be a number > 0, not 0"),
            (["--timeout", "abc"], "--timeout: 'abc' is not a number"),
            # A subnormal is a number (too small here), overflow and inf are
            # not finite.
            (["--timeout", "1e-310"], "--timeout: must be between 0.001 and 10000000, not 1e-310"),
            (["--timeout", "1e999"], "--timeout: must be between 0.001 and 10000000 (a finite number), not 1e999"),
            (["-f", "1"], "--stepfactor: must be a number > 1, not 1"),
            (["-f", "0.5"], "--stepfactor: must be a number > 1, not 0.5"),
            (["--min-busbw", "-1"], "--min-busbw: must be a number >= 0, not -1"),
            (["--gloo-threads", "20"], "--gloo-threads: must be between 1 and 16, not 20"),
            (["-b", "1X"], "--minbytes: '1X' has an unknown unit 'X'"),
            # Past what the flag's integer holds: the range, not CLI11's
            # "Could not convert".
            (["-n", "2147483648"], "--iters: 2147483648 is out of range; it takes at most 2147483647"),
            (["--nproc", "99999999999999999999"],
             "--nproc: 99999999999999999999 is out of range; it takes at most 2147483647"),
            (["--rank", "-2147483649"], "--rank: -2147483649 is out of range; it takes at least -2147483648"),
            (["--master-port", "1e3"], "--master-port: '1e3' is not a whole number"),
            (["-n", "08"], "--iters: '08' has a leading 0, which would read it as octal"),
            (["-n", "010"], "--iters: '010' has a leading 0, which would read it as octal"),
            (["--master-port", "029500"], "--master-port: '029500' has a leading 0"),
            (["-n", "0x80000000"], "--iters: 0x80000000 is out of range; it takes at most 2147483647"),
            (["-f", "two"], "--stepfactor: 'two' is not a number"),
        ]
        cases += [
            (["-e", "1K", "-b", "1M"], "--maxbytes: 1K is below --minbytes 1M"),
            (["--no-in-place", "--no-out-of-place"], "leaves nothing to run"),
        ]
        for flags, message in cases:
            with self.subTest(flags=flags):
                p = run(["allreduce-test"] + flags)
                self.assertEqual(p.returncode, 2, p.stderr)
                self.assertIn(message, p.stderr)
                self.assertNotIn("[rank", p.stderr)  # no rank was started

    def test_sizes_beyond_memory_are_exit_2_with_a_report(self):
        # 1 TiB buffers: every rank refuses before allocating (the OOM killer
        # would end them with no report), exit 2, and rank 0's report holds
        # the error.
        path = tmp_json()
        p = run(["allreduce-test", "--nproc", "2", "-b", "1024G", "-e", "1024G", "--json", path])
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("buffers of 1024G (the sweep's largest size) take about 3072.0 GiB per rank, 6144.0 GiB for the 2 "
                      "ranks on this host, but this host has", p.stderr)
        self.assertIn("hint: use a smaller -e, or fewer ranks on this host", p.stderr)
        rep = load(path)
        os.unlink(path)
        self.assertEqual(rep["error"]["exit_code"], 2)
        self.assertEqual(rep["error"]["phase"], "flags")
        # link-health's pair exchange alike.
        p = run(["link-health", "--nproc", "2", "--bytes", "1024G"])
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("buffers of 1024G (--bytes) and 1M (--allreduce-bytes) take about 3072.0 GiB "
                      "per rank", p.stderr)
        self.assertIn("hint: use a smaller --bytes, or fewer ranks on this host", p.stderr)
        # dp-vs-ring: rank 0, the gather root, also holds the other ranks'
        # buffers; with the gather left out, it holds no more than the others.
        p = run(["dp-vs-ring", "--nproc", "3", "-b", "1024G", "-e", "1024G"])
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("buffers of 1024G (the sweep's largest size) take about 2048.0 GiB per rank, "
                      "6144.0 GiB for the 3 ranks on this host, and 2048.0 GiB more on this rank "
                      "(the gather root holds the 2 other ranks' buffers), but this host has", p.stderr)
        p = run(["dp-vs-ring", "--nproc", "3", "-b", "1024G", "-e", "1024G", "--world-sizes", "2"])
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("and 1024.0 GiB more on this rank (the gather root holds the other rank's "
                      "buffer)", p.stderr)
        p = run(["dp-vs-ring", "--nproc", "2", "-b", "1024G", "-e", "1024G", "--algorithms", "ring"])
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("buffers of 1024G (the sweep's largest size) take about 2048.0 GiB per rank, "
                      "4096.0 GiB for the 2 ranks on this host, but this host has", p.stderr)
        # The commands that run a model layout: 2 TiB of float parameters.
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump({"name": "huge", "tensors": [{"name": "w%d" % i, "shape": [1 << 37],
                                                    "dtype": "float32"} for i in range(4)]}, f)
        self.addCleanup(os.unlink, f.name)
        for cmd in ("ddp-step", "bucket-sweep", "memory", "broadcast-test"):
            with self.subTest(cmd=cmd):
                p = run([cmd, "--nproc", "2", "--model", f.name])
                self.assertEqual(p.returncode, 2, p.stderr)
                self.assertIn("the buffers of model %s (2048.0 GiB of parameters) take about" % f.name,
                              p.stderr)
                self.assertIn("hint: use a smaller model layout, or fewer ranks on this host",
                              p.stderr)

    def test_a_refused_flag_still_writes_the_report(self):
        # A value refused while the line is parsed: the report CI reads is
        # there, with the error, as for a run refused later.
        for cmd in (["allreduce-test", "--nproc", "2", "-n", "0"],
                    ["allreduce-test", "--nproc", "2", "-b", "4K", "-e", "1K"],
                    ["init-check", "--timeout", "0"],
                    ["store", "ping", "127.0.0.1:1", "--timeout", "0"]):
            with self.subTest(cmd=cmd):
                path = tmp_json()
                p = run(cmd + ["--json", path])
                self.assertEqual(p.returncode, 2, p.stderr)
                rep = load(path)  # valid against the schema
                os.unlink(path)
                self.assertEqual(rep["command"], " ".join(cmd[:2]) if cmd[0] == "store" else cmd[0])
                self.assertEqual(rep["verdict"], "ERROR")
                self.assertEqual((rep["error"]["kind"], rep["error"]["phase"], rep["error"]["exit_code"]),
                                 ("usage", "flags", 2))
                self.assertIn(rep["error"]["message"].split(":")[0], p.stderr)
                self.assertIsNone(rep["world"])
        # Every rank refuses the same line: only rank 0 writes the job's report.
        path = tmp_json()
        env = dict(clean_env(), RANK="1", WORLD_SIZE="2")
        p = run(["allreduce-test", "-n", "0", "--json", path], env=env)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertFalse(os.path.exists(path))
        self.assertFalse(os.path.exists(path.replace(".json", ".rank1.json")))
        # Nor a rank given by --rank; RANK=00 is rank 0.
        p = run(["allreduce-test", "--rank", "1", "--world-size", "2", "-n", "0", "--json", path])
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertFalse(os.path.exists(path))
        p = run(["allreduce-test", "-n", "0", "--json", path], env=dict(clean_env(), RANK="00", WORLD_SIZE="2"))
        self.assertEqual(load(path)["error"]["phase"], "flags")
        os.unlink(path)

    def test_report_in_a_directory_where_no_file_can_be_made_is_refused_up_front(self):
        # /proc: writable to root by access(), yet no file can be created
        # there; refused before any rank starts, not after the sweep.
        p = run(["allreduce-test", "--nproc", "2", "--json", "/proc/ddpdiag-report.json"] + SMALL)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("--json /proc/ddpdiag-report.json: cannot write the report there", p.stderr)
        self.assertNotIn("[rank", p.stderr)

    def test_dash_as_report_path_is_refused(self):
        # "-" is not a file name to create, and stdout carries the table:
        # every command that runs something refuses it, before any rank
        # starts, and says to give a path.
        cmds = [["allreduce-test", "--nproc", "2"] + SMALL,
                ["bucket-sweep", "--nproc", "2", "--model", "mlp"],
                ["store", "ping", "127.0.0.1:1", "--timeout", "0.1"],
                ["sampler", "--dataset-size", "10", "--world-size", "1", "--rank", "0"],
                ["buckets", "--model", "mlp"]]
        with tempfile.TemporaryDirectory() as cwd:
            for cmd in cmds:
                for flag in ("--json", "--markdown"):
                    with self.subTest(cmd=cmd[0], flag=flag):
                        p = subprocess.run([BIN] + cmd + [flag, "-"], env=clean_env(), cwd=cwd,
                                           capture_output=True, text=True, timeout=60)
                        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
                        self.assertIn("%s: '-' (stdout) is not supported here" % flag, p.stderr)
                        self.assertIn("give a file path", p.stderr)
                        self.assertNotIn("[rank", p.stderr)
                        self.assertEqual(os.listdir(cwd), [])

    def test_sampler_bad_values_are_named(self):
        base = {"--dataset-size": "100", "--world-size": "4", "--rank": "0"}
        for flag, value, message in [("--rank", "-1", "--rank: must be a number >= 0, not -1"),
                                     ("--dataset-size", "-5", "--dataset-size: must be a number >= 0"),
                                     ("--world-size", "0", "--world-size: must be a number > 0"),
                                     ("--count", "-3", "--count: must be a number >= 0, not -3"),
                                     # Beyond 64 bits: refused as given, not read as 2^63 - 1.
                                     ("--dataset-size", "%s" % ("9" * 20),
                                      "--dataset-size: must be a 64-bit integer (-9223372036854775808 "
                                      "to 9223372036854775807), not " + "9" * 20),
                                     ("--start", "-" + "9" * 20, "--start: must be a 64-bit integer"),
                                     ("--world-size", "9" * 20, "--world-size: must be a 64-bit integer")]:
            with self.subTest(flag=flag):
                args = dict(base, **{flag: value})
                p = run(["sampler"] + [x for kv in args.items() for x in kv])
                self.assertEqual(p.returncode, 2, p.stderr)
                self.assertIn(message, p.stderr)
                self.assertEqual(p.stdout, "")

    def test_other_commands_refuse_bad_values_before_any_rank_starts(self):
        for args, message in [
                (["ddp-step", "--hook", "fp8"], "--hook: 'fp8' is not none, fp16 or bf16"),
                (["ddp-step", "--bucket-cap-mb", "0"], "--bucket-cap-mb: must be a number > 0"),
                (["bucket-sweep", "--caps", "0"], "--caps: '0' is not a positive number of MiB"),
                (["bucket-sweep", "--first-bucket-mb", "-1"], "--first-bucket-mb: must be a number > 0"),
                (["ddp-step", "--sparse-rows", "9" * 20], "--sparse-rows: must be a 64-bit integer"),
        ]:
            with self.subTest(args=args):
                p = run(args)
                self.assertEqual(p.returncode, 2, p.stderr)
                self.assertIn(message, p.stderr)
                self.assertNotIn("[rank", p.stderr)  # once, from the launcher

    def test_sizes_and_lists_are_refused_before_any_rank_starts(self):
        # Sizes that do not fit 64 bits are named as too large (not wrapped
        # around into a small number); reversed ranges, empty list entries,
        # steps that never move and values that round to nothing are refused
        # by every subcommand that takes them, the same way.
        too_large = "is too large (at most 18446744073709551615 bytes"
        for args, message in [
                (["allreduce-test", "-e", "99999999999999999999"],
                 "--maxbytes: '99999999999999999999' " + too_large),
                (["allreduce-test", "-e", "18446744073709551616"], too_large),
                (["allreduce-test", "-e", "17179869184G"], "--maxbytes: '17179869184G' " + too_large),
                (["allreduce-test", "-b", "1e30"], "--minbytes: '1e30' " + too_large),
                (["allreduce-test", "-i", "17179869184G"], "--stepbytes: '17179869184G' " + too_large),
                (["allreduce-test", "-i", "0"], "--stepbytes: must be a size > 0, not 0"),
                (["dp-vs-ring", "-e", "99999999999999999999"], "--maxbytes: '99999999999999999999' " + too_large),
                (["dp-vs-ring", "-f", "1"], "--stepfactor: must be a number > 1, not 1"),
                (["dp-vs-ring", "-b", "4M", "-e", "1M"], "--maxbytes: 1M is below --minbytes 4M (swap them)"),
                (["dp-vs-ring", "--world-sizes", "2,,1"], "--world-sizes: '2,,1' has an empty entry"),
                (["dp-vs-ring", "--world-sizes", "2abc"],
                 "--world-sizes: '2abc' is not a whole number of ranks"),
                (["dp-vs-ring", "--world-sizes", "1,2.9"],
                 "--world-sizes: '2.9' is not a whole number of ranks"),
                (["dp-vs-ring", "--world-sizes", "0"], "--world-sizes: '0' is not a whole number of ranks"),
                (["dp-vs-ring", "--algorithms", "ring,"], "--algorithms: 'ring,' has an empty entry"),
                (["bucket-sweep", "--sweep-minbytes", "1", "--sweep-maxbytes", "3"],
                 "--sweep-maxbytes: 3 B is less than one float element (4 B)"),
                (["bucket-sweep", "--model", "mlp", "--caps", "1", "--sweep-minbytes", "4M",
                  "--sweep-maxbytes", "1M"], "--sweep-maxbytes: 1M is below --sweep-minbytes 4M (swap them)"),
                (["bucket-sweep", "--sweep-maxbytes", "99999999999999999999"], too_large),
                (["bucket-sweep", "--caps", "1,,5"], "--caps: '1,,5' has an empty entry"),
                (["bucket-sweep", "--caps", ",1"], "--caps: ',1' has an empty entry"),
                (["broadcast-test", "--chunk-mb", "1,,2"], "--chunk-mb: '1,,2' has an empty entry"),
                (["broadcast-test", "--chunk-mb", "0.0000001"],
                 "--chunk-mb: '0.0000001' MiB rounds down to 0 bytes (the smallest chunk is 1 byte, "
                 "--chunk-mb 0.000001"),
                (["broadcast-test", "--chunk-mb", "250,x"], "--chunk-mb: 'x' is not a positive number of MiB"),
                (["memory", "--model", "mlp", "--workspace-mb", "-1"],
                 "--workspace-mb: must be between 0 and 1000000, not -1"),
                (["memory", "--model", "mlp", "--workspace-mb", "1e9"],
                 "--workspace-mb: must be between 0 and 1000000, not 1e9"),
                (["memory", "--bucket-cap-mb", "-5"], "--bucket-cap-mb: must be a number > 0, not -5"),
                (["link-health", "--bytes", "0"], "--bytes: must be a size > 0, not 0"),
                (["link-health", "--bytes", "99999999999999999999"], "--bytes: '99999999999999999999' " + too_large),
        ]:
            with self.subTest(args=args):
                p = run(args + ["--nproc", "2"])
                self.assertEqual(p.returncode, 2, p.stderr)
                self.assertIn(message, p.stderr)
                self.assertNotIn("[rank", p.stderr)  # once, from the launcher
        # Below one element of the dtype there is no size to measure: refused
        # alike by allreduce-test and dp-vs-ring (dp-vs-ring measured 4 B).
        for cmd in ("allreduce-test", "dp-vs-ring"):
            with self.subTest(cmd=cmd):
                p = run([cmd, "--nproc", "2", "-b", "1", "-e", "3"])
                self.assertEqual(p.returncode, 2, p.stderr)
                self.assertIn("-e 3 B is less than one float element (4 B): no size to measure",
                              p.stderr)

    def test_model_refuses_reversed_ranges(self):
        for args, message in [(["-b", "4M", "-e", "1M"], "--maxbytes 1M is below --minbytes 4M"),
                              (["--fit-min-bytes", "4M", "--fit-max-bytes", "1M"],
                               "--fit-max-bytes 1M is below --fit-min-bytes 4M")]:
            with self.subTest(args=args):
                p = run(["model", "/nonexistent.json", "--world-size", "8"] + args)
                self.assertEqual(p.returncode, 2, p.stderr)
                self.assertIn(message, p.stderr)
                self.assertIn("swap them", p.stderr)

    def test_rank_spread_names_the_block_shown(self):
        for flag, label in [("--no-out-of-place", "rank spread (ip)"), ("--no-in-place", "rank spread (oop)")]:
            with self.subTest(flag=flag):
                p = run(["allreduce-test", "--nproc", "2", "-b", "8", "-e", "64", "-n", "1", "-w", "0", flag])
                self.assertEqual(p.returncode, 0, p.stderr)
                self.assertIn(label, p.stdout)

    def test_linear_sweep_with_i_takes_any_factor(self):
        # nccl-tests' linear sweep: -i steps by bytes and -f is unused, so a
        # factor of 1 is fine there (it is refused only without -i).
        path = tmp_json()
        p = run(["allreduce-test", "--nproc", "2", "-b", "64K", "-e", "192K", "-f", "1", "-i",
                 "64K", "-n", "2", "-w", "1", "--json", path])
        self.assertEqual(p.returncode, 0, p.stderr)
        rep = load(path)
        os.unlink(path)
        self.assertEqual([r["bytes"] for r in rep["results"]["sizes"]],
                         [64 << 10, 128 << 10, 192 << 10])

    def test_unknown_subcommand_is_named(self):
        p = run(["allreduce-tset"])
        self.assertEqual(p.returncode, 2)
        self.assertIn("unknown subcommand 'allreduce-tset'", p.stderr)
        self.assertIn("allreduce-test", p.stderr)
        # One level down, and an option before any subcommand: named too
        # (CLI11 answered "A subcommand is required" to both).
        p = run(["report", "rendr", "x.json"])
        self.assertEqual(p.returncode, 2)
        self.assertIn("unknown subcommand 'rendr' of ddpdiag report", p.stderr)
        self.assertIn("render", p.stderr)
        p = run(["--bogus"])
        self.assertEqual(p.returncode, 2)
        self.assertIn("unknown option '--bogus' before a subcommand of ddpdiag", p.stderr)
        p = run(["store", "pnig"])
        self.assertEqual(p.returncode, 2)
        self.assertIn("unknown subcommand 'pnig' of ddpdiag store", p.stderr)

    def test_report_compare_of_different_commands_is_exit_2(self):
        a, b = tmp_json(), tmp_json()
        try:
            self.assertEqual(run(["buckets", "--model", "mlp", "--json", a]).returncode, 0)
            self.assertEqual(run(["sampler", "--dataset-size", "10", "--world-size", "2",
                                  "--rank", "0", "--json", b]).returncode, 0)
            p = run(["report", "compare", a, b])
            self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
            self.assertIn("a report of 'buckets'", p.stderr)
            self.assertIn("'sampler'", p.stderr)
        finally:
            for f in (a, b):
                if os.path.exists(f):
                    os.unlink(f)

    def test_report_compare_takes_several_baseline_runs(self):
        # BASE... NEW: runs of one command and settings are merged; runs of
        # different settings, or a lone report, are refused with exit 2.
        a, b, c = tmp_json(), tmp_json(), tmp_json()
        try:
            for path, model in ((a, "mlp"), (b, "mlp"), (c, "resnet50")):
                self.assertEqual(run(["memory", "--model", model, "--json", path]).returncode, 0)
            p = run(["report", "compare", a, b, a])
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            self.assertIn("and 1 more run(s)", p.stdout)
            self.assertIn("no regression", p.stdout)
            p = run(["report", "compare", a, c, a])
            self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
            self.assertIn("the baseline runs were made with different settings", p.stderr)
            self.assertIn("model resnet50 (%s) vs mlp (%s)" % (c, a), p.stderr)
            p = run(["report", "compare", a])
            self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
            self.assertIn("needs a baseline report and a new one", p.stderr)
        finally:
            for f in (a, b, c):
                if os.path.exists(f):
                    os.unlink(f)

    def test_report_compare_refuses_a_schema_invalid_report(self):
        # An unknown verdict and no world: report validate calls it invalid,
        # so the gate must not pass on it (exit 2, the file and the errors named).
        a, b = tmp_json(), tmp_json()
        try:
            self.assertEqual(run(["buckets", "--model", "mlp", "--json", a]).returncode, 0)
            p = run(["report", "compare", a, a])
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            with open(a) as f:
                doc = json.load(f)
            doc["verdict"] = "MAYBE"
            del doc["world"]
            with open(b, "w") as f:
                json.dump(doc, f)
            self.assertEqual(run(["report", "validate", b]).returncode, 1)
            for args in ([a, b], [b, a]):
                with self.subTest(args=args):
                    p = run(["report", "compare"] + args)
                    self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
                    self.assertIn(f"{b} is not a valid ddpdiag.report/1 report", p.stderr)
                    self.assertIn("/verdict", p.stderr)
                    self.assertIn("report validate", p.stderr)
                    self.assertNotIn("no regression", p.stdout)
        finally:
            for f in (a, b):
                if os.path.exists(f):
                    os.unlink(f)

    def test_help_names_the_per_rank_report_file(self):
        # --json out.json: another rank's own report is out.rank1.json, and
        # the help says so rather than FILE.rank<R>.json (out.json.rank1.json).
        p = run(["allreduce-test", "--help"])
        self.assertEqual(p.returncode, 0, p.stderr)
        text = " ".join(p.stdout.split())
        self.assertIn("out.rank1.json", text)
        self.assertNotIn("FILE.rank<R>.json", text)

    def test_help_shows_defaults_but_not_placeholders(self):
        # A default that is a real value is shown, as torchrun shows its own;
        # one that stands for "not given" (-1, 0 for a size > 0, an empty
        # list, a launcher's variable) is not shown as if it were a value.
        def line_of(sub, flag):
            p = run(sub + ["--help"])
            self.assertEqual(p.returncode, 0, p.stderr)
            for line in p.stdout.splitlines():
                # "  --timeout FLOAT:0.001 to 10000000=60   Seconds to ...":
                # the option's part ends at the first run of spaces.
                head = line.strip().split("  ")[0]
                if head and flag in head.split()[0].split(","):
                    return head
            self.fail("%s --help has no %s: %s" % (sub, flag, p.stdout))
        self.assertIn("=60", line_of(["allreduce-test"], "--timeout"))
        self.assertIn("=64M", line_of(["allreduce-test"], "--maxbytes"))
        self.assertIn("=20", line_of(["allreduce-test"], "--iters"))
        self.assertIn("=1,5,10,25,50,100,200", line_of(["bucket-sweep"], "--caps"))
        self.assertIn("=29500", line_of(["store", "serve"], "--port"))
        for sub, flag in ((["allreduce-test"], "--stepbytes"), (["allreduce-test"], "--rank"),
                          (["allreduce-test"], "--nproc"), (["sampler"], "--dataset-size"),
                          (["sampler"], "--count"), (["model"], "--world-size"),
                          (["model"], "--inter-gbps"), (["model"], "reports")):
            with self.subTest(sub=sub, flag=flag):
                # "INT:>= 0" is the check; "=value" after the type a default
                self.assertIsNone(re.search(r"[^\s<>]=", line_of(sub, flag)))

    def test_unwritable_report_path_is_exit_2(self):
        # A single-process command: the path is the user's mistake, not an
        # internal error, and the message names the path asked for. It is
        # checked before the work: nothing is printed (sampler printed every
        # index, buckets its table, before failing), and one file for both
        # --json and --markdown is refused as the distributed commands do.
        for cmd in (["buckets", "--model", "mlp"],
                    ["sampler", "--dataset-size", "1000", "--world-size", "2", "--rank", "0"]):
            with self.subTest(cmd=cmd[0]):
                p = run(cmd + ["--json", "/nonexistent-dir/b.json"])
                self.assertEqual(p.returncode, 2, p.stderr)
                self.assertIn("/nonexistent-dir/b.json", p.stderr)
                self.assertIn("cannot write the report there", p.stderr)
                self.assertIn("an existing, writable directory", p.stderr)
                self.assertEqual(p.stdout, "")
                with tempfile.TemporaryDirectory() as d:
                    same = os.path.join(d, "r.json")
                    p = run(cmd + ["--json", same, "--markdown", same])
                    self.assertEqual(p.returncode, 2, p.stderr)
                    self.assertIn("name the same file", p.stderr)
                    self.assertEqual(p.stdout, "")
                    self.assertFalse(os.path.exists(same))


if __name__ == "__main__":
    main()
