"""ddpdiag under PyTorch's own launch machinery, with whichever torch the
interpreter running this file has (Debian's 1.13 or a 2.x):

- a store hosted by torch (TCPStore(is_master=True), as torchrun's agent does)
  with the workers' environment set exactly as the agent sets it;
- the real torchrun: torch 2.x's `torchrun`, or for 1.13 the module
  torch.distributed.run with the fix in scripts/torchrun113.py.
"""
import json
import os
import subprocess
import sys
import unittest
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "mp"))
from common import (BIN, check_report, clean_env, free_port, load, run_ranks,  # noqa: E402
                    tmp_json)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

TORCH2 = int(torch.__version__.split(".")[0]) >= 2
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
SMALL = ["-b", "8", "-e", "64K", "-f", "8", "-n", "3", "-w", "1"]


def agent_env(rank, n, port, restart_count=0):
    return clean_env(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=n, LOCAL_WORLD_SIZE=n, GROUP_RANK=0,
                     GROUP_WORLD_SIZE=1, ROLE_RANK=rank, ROLE_WORLD_SIZE=n, ROLE_NAME="default",
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                     TORCHELASTIC_RESTART_COUNT=restart_count, TORCHELASTIC_MAX_RESTARTS=0,
                     TORCHELASTIC_RUN_ID="none", TORCHELASTIC_USE_AGENT_STORE="True",
                     OMP_NUM_THREADS=1)


class TorchHostedStore(unittest.TestCase):
    def test_allreduce_test_against_torch_store(self):
        port = free_port()
        store = dist.TCPStore("127.0.0.1", port, is_master=True,
                              timeout=timedelta(seconds=60))
        # A torch user of the same store, as the agent's own keys would be.
        store.set("/worker/attempt_1/user_key", "torch")
        n = 3
        paths = [tmp_json() for _ in range(n)]
        res = run_ranks([["allreduce-test", "--json", paths[r]] + SMALL for r in range(n)],
                        [agent_env(r, n, port, restart_count=1) for r in range(n)])
        for rc, so, se, _ in res:
            self.assertEqual(rc, 0, se)
        rep = load(paths[0])
        check_report(self, rep, n)
        self.assertEqual(rep["world"]["launcher"], "torchrun")
        # ddpdiag's keys are under its own prefix, in the run its ranks
        # agreed on (the report names it), and it left torch's own key alone.
        self.assertEqual(rep["world"]["restart_count"], 1)
        run = rep["world"]["store_run"]
        store.set_timeout(timedelta(seconds=5))
        info = json.loads(store.get("ddpdiag/run/%d/rank/0" % run))
        self.assertEqual(info["rank"], 0)
        self.assertEqual(info["world_size"], n)
        self.assertEqual(store.get("/worker/attempt_1/user_key"), b"torch")

    def test_restarts_on_one_store_meet_whatever_each_node_counts(self):
        """torch 2.x keeps torchrun's agent store across restarts, and each
        node counts its own restarts: the workers of a restart find the keys
        of the runs before (from ranks that completed, ranks that died before
        they met, and a rank that took a hello and died), and their
        TORCHELASTIC_RESTART_COUNT differ. Each run still meets, in a run of
        its own."""
        port = free_port()
        store = dist.TCPStore("127.0.0.1", port, is_master=True,
                              timeout=timedelta(seconds=60))
        n = 2
        # A run that completes: its keys stay.
        paths = [tmp_json() for _ in range(n)]
        res = run_ranks([["allreduce-test", "--json", paths[r]] + SMALL for r in range(n)],
                        [agent_env(r, n, port) for r in range(n)])
        for rc, so, se, _ in res:
            self.assertEqual(rc, 0, se)
        first = load(paths[0])["world"]["store_run"]
        # A run whose rank 1 died before it met: alone, rank 0 times out.
        p = run_ranks([["allreduce-test", "--timeout", "3"] + SMALL],
                      [agent_env(0, n, port, restart_count=1)])
        self.assertEqual(p[0][0], 3, p[0][2])
        self.assertIn("never arrived: 1", p[0][2])
        # A process that took a hello and died before setting it, and one
        # that said hello as rank 1 and died: no rank 0 ever answered them.
        store.add("ddpdiag/hello/last", 1)
        k = store.add("ddpdiag/hello/last", 1)
        store.set("ddpdiag/hello/%d" % k, "1 999999 gone")
        # The restart: node 0 counts 1 restart, node 1 counts 2.
        res = run_ranks([["allreduce-test", "--json", paths[r]] + SMALL for r in range(n)],
                        [agent_env(r, n, port, restart_count=1 + r) for r in range(n)])
        for rc, so, se, _ in res:
            self.assertEqual(rc, 0, se)
        rep = load(paths[0])
        check_report(self, rep, n)
        self.assertGreater(rep["world"]["store_run"], first)
        self.assertEqual(rep["world"]["restart_count"], 1)
        # And the same command again on the same store (a script that runs
        # ddpdiag twice in one worker): a run of its own again.
        res = run_ranks([["allreduce-test", "--json", paths[r]] + SMALL for r in range(n)],
                        [agent_env(r, n, port, restart_count=1 + r) for r in range(n)])
        for rc, so, se, _ in res:
            self.assertEqual(rc, 0, se)
        self.assertGreater(load(paths[0])["world"]["store_run"], rep["world"]["store_run"])
        for path in paths:
            if os.path.exists(path):
                os.unlink(path)

    def test_a_rank_whose_rank_0_never_comes_says_so(self):
        port = free_port()
        store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=60))
        res = run_ranks([["allreduce-test", "--timeout", "3"] + SMALL],
                        [agent_env(1, 2, port)])
        rc, _, se, elapsed = res[0]
        self.assertEqual(rc, 3, se)
        self.assertIn("rank 0 never took this rank into its run", se)
        self.assertIn("never arrived: 0", se)
        self.assertLess(elapsed, 30)
        self.assertEqual(store.get("ddpdiag/hello/1").split()[0], b"1")

    def test_store_ping_reports_the_protocol(self):
        port = free_port()
        store = dist.TCPStore("127.0.0.1", port, is_master=True,
                              timeout=timedelta(seconds=30))
        store.set("a", "1")
        p = subprocess.run([BIN, "store", "ping", "127.0.0.1:%d" % port], capture_output=True,
                           text=True, timeout=60, env=clean_env())
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("2.x" if TORCH2 else "1.13", p.stdout)


def wrapper_script(prefix, line):
    """A directory of its own and, in it, a shell script that runs `line`
    and then execs its arguments (the worker torchrun starts)."""
    import tempfile
    d = tempfile.mkdtemp(prefix=prefix)
    wrap = os.path.join(d, "wrap.sh")
    with open(wrap, "w") as f:
        f.write('#!/bin/sh\n%s\nexec "$@"\n' % line)
    os.chmod(wrap, 0o755)
    return d, wrap


class RealTorchrun(unittest.TestCase):
    def torchrun_cmd(self):
        if TORCH2:
            return [sys.executable, "-m", "torch.distributed.run"]
        return [sys.executable, os.path.join(REPO, "scripts", "torchrun113.py")]

    def run_torchrun(self, extra, n=2):
        path = tmp_json()
        cmd = self.torchrun_cmd() + extra + ["--nproc-per-node", str(n), "--no-python", BIN,
                                             "allreduce-test", "--json", path] + SMALL
        env = clean_env()
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        rep = load(path)
        os.unlink(path)
        check_report(self, rep, n)
        self.assertEqual(rep["world"]["launcher"], "torchrun")
        return rep

    def test_torchrun_default(self):
        port = free_port()
        rep = self.run_torchrun(["--master-addr", "127.0.0.1", "--master-port", str(port)])
        self.assertIn("TORCHELASTIC_USE_AGENT_STORE", rep["environment"])

    def test_torchrun_standalone(self):
        self.run_torchrun(["--standalone"])

    def test_torchrun_summary_shows_ddpdiag_error(self):
        # torchrun shows a failed worker's TORCHELASTIC_ERROR_FILE in its
        # summary; without it the summary said only "error_file: <N/A>".
        port = free_port()
        cmd = self.torchrun_cmd() + ["--master-addr", "127.0.0.1", "--master-port", str(port),
                                     "--nproc-per-node", "2", "--no-python", BIN, "allreduce-test",
                                     "--timeout", "4", "--inject-fault", "hang@seq=3,rank=1"] + SMALL
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=clean_env())
        self.assertNotEqual(p.returncode, 0, p.stdout + p.stderr)
        summary = p.stderr[p.stderr.find("Root Cause"):]
        self.assertIn("ddpdiag error on rank", summary, p.stderr[-3000:])
        self.assertIn("Rank 1 behind", summary)

    def test_torchrun_summary_shows_a_usage_error(self):
        # A flag refused while parsing (exit 2) reaches torchrun's summary too.
        cmd = self.torchrun_cmd() + ["--standalone", "--nproc-per-node", "2", "--no-python", BIN,
                                     "allreduce-test", "-b", "1K", "-e", "8"]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=clean_env())
        self.assertNotEqual(p.returncode, 0, p.stdout + p.stderr)
        summary = p.stderr[p.stderr.find("Root Cause"):]
        self.assertIn("exitcode  : 2", summary, p.stderr[-3000:])
        self.assertIn("ddpdiag usage error: --maxbytes: 8 is below --minbytes 1K", summary,
                      p.stderr[-3000:])

    def test_worker_stopped_after_another_died_names_it(self):
        # torchrun ends the other workers with SIGTERM once one has died;
        # the survivor's report (the job's) names the one that died.
        import signal
        import time
        port = free_port()
        path = tmp_json()
        cmd = self.torchrun_cmd() + ["--master-addr", "127.0.0.1", "--master-port", str(port),
                                     "--nproc-per-node", "2", "--no-python", BIN, "allreduce-test",
                                     "--timeout", "20", "-b", "1K", "-e", "1M", "-n", "3000",
                                     "--json", path]
        # A session of its own, so that whatever happens the whole job
        # (torchrun and its workers) is ended below.
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=clean_env(), start_new_session=True)
        rank1 = None
        deadline = time.monotonic() + 60
        while rank1 is None and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.3)
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    with open(f"/proc/{pid}/stat") as f:
                        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                    with open(f"/proc/{pid}/environ", "rb") as f:
                        env = f.read().split(b"\0")
                except (OSError, ValueError, IndexError):
                    continue
                # This torchrun's own worker (other tests may run torchrun
                # beside this one).
                if ppid == p.pid and b"RANK=1" in env:
                    rank1 = int(pid)
        try:
            self.assertIsNotNone(rank1, "rank 1 did not start")
            time.sleep(2)  # into the sweep
            os.kill(rank1, signal.SIGKILL)
            out, err = p.communicate(timeout=120)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
        self.assertNotEqual(p.returncode, 0)
        # torchrun's summary names the rank that died as the root cause, not
        # the survivor that stopped within the same second (its error file
        # waits until torchrun has seen the death).
        root = err[err.find("Root Cause"):]
        self.assertRegex(root, r"Root Cause \(first observed failure\):\n\[0\]:\n(  .*\n)*?"
                               r"  rank      : 1 \(local_rank: 1\)", err[-3000:])
        rep = load(path)
        os.unlink(path)
        self.assertEqual(rep["error"]["rank"], 0)
        self.assertEqual(rep["error"]["peer"], 1, rep["error"])
        self.assertEqual(rep["error"]["exit_code"], 5)
        self.assertNotEqual(rep["error"]["kind"], "interrupted")

    def failing_init_check(self, prefix, line, timeout_s):
        """init-check under torchrun, two workers, each started through a
        wrapper that runs `line` first; the run must fail. Returns the
        completed process and rank 0's report."""
        import shutil
        d, wrap = wrapper_script(prefix, line)
        try:
            path = os.path.join(d, "r.json")
            cmd = self.torchrun_cmd() + ["--master-addr", "127.0.0.1", "--master-port",
                                         str(free_port()), "--nproc-per-node", "2", "--no-python",
                                         wrap, BIN, "init-check", "--timeout", str(timeout_s),
                                         "--json", path]
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=clean_env())
            self.assertNotEqual(p.returncode, 0, p.stdout + p.stderr)
            return p, load(path)
        finally:
            shutil.rmtree(d, ignore_errors=True)

    def test_a_worker_failing_in_backend_init_is_named_by_the_other(self):
        # Rank 1 cannot start Gloo (an interface that does not exist) and
        # exits; torchrun then stops rank 0, which was starting its own
        # backend, with SIGTERM. Rank 0's report names rank 1 (kind peer,
        # exit 5), not "interrupted" (the ranks on this machine are known
        # from the moment the ranks met).
        _, rep = self.failing_init_check(
            "ddpdiag-badif-", 'if [ "$LOCAL_RANK" = 1 ]; then export GLOO_SOCKET_IFNAME=nosuch0; fi', 20)
        err = rep["error"]
        self.assertNotEqual(err["kind"], "interrupted", err)
        if err["rank"] == 0:
            # Stopped by torchrun before it learnt why: it names rank 1.
            self.assertEqual((err["kind"], err["peer"], err["exit_code"]), ("peer", 1, 5), err)
        else:
            # It learnt rank 1's own error through the store first (torch
            # 1.x's torchrun polls its workers every 5 s): init-check's
            # report holds that error, the cause.
            self.assertEqual((err["rank"], err["phase"]), (1, "backend_init"), err)
            self.assertIn("nosuch0", err["message"])

    def test_a_worker_that_died_before_the_ranks_met_is_named(self):
        # Rank 1 ends (exit 1) before it ever reaches the store; torchrun
        # then stops rank 0, waiting for it in wait_for_ranks, with SIGTERM.
        # Rank 0 names rank 1 from /proc (no registration to go by), and
        # prints its timeline so far with the phase it was stopped in.
        p, rep = self.failing_init_check(
            "ddpdiag-early-", 'if [ "$LOCAL_RANK" = 1 ]; then sleep 2; exit 1; fi', 60)
        err = rep["error"]
        self.assertEqual((err["rank"], err["kind"], err["peer"], err["exit_code"]), (0, "peer", 1, 5),
                         err)
        self.assertIn("rank 1 (local rank 1 on this machine) had ended", err["message"])
        self.assertIn("# init-check timeline of rank 0 ", p.stdout, p.stderr[-2000:])
        self.assertRegex(p.stdout, r"\n +0 +\S+ +register +[0-9.]+ +[0-9.]+ +ok ")
        self.assertRegex(p.stdout, r"\n +0 +\S+ +wait_for_ranks +[0-9.]+ +- +run +running for "
                                   r"[0-9.]+ s when stopped")
        self.assertNotIn("backend_init", p.stdout)

    def two_nodes_with_a_restart(self, rdzv):
        """Two torchrun agents (two "nodes" on this machine), one worker
        each; node 1's worker fails at once in its first attempt, so node 1
        restarts and counts 1 restart while node 0 counts 0 (or restarts too,
        with c10d, still counting 0 on its side)."""
        d, wrap = wrapper_script(
            "ddpdiag-restart-",
            'if [ "$GROUP_RANK" = 1 ] && [ "$TORCHELASTIC_RESTART_COUNT" = 0 ]; then exit 1; fi')
        paths = [os.path.join(d, "node%d.json" % n) for n in range(2)]
        procs = []
        for n in range(2):
            cmd = self.torchrun_cmd() + rdzv(n) + [
                "--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "1", "--no-python",
                wrap, BIN, "allreduce-test", "--timeout", "20", "--json", paths[n]] + SMALL
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True, env=clean_env()))
        outs = []
        for p in procs:
            try:
                outs.append(p.communicate(timeout=240)[0])
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise
        for p, out in zip(procs, outs):
            self.assertEqual(p.returncode, 0, out[-3000:])
        # Rank 0 (node 0) writes the job's report; rank 1 writes one of its
        # own only when it fails, and its first attempt never started ddpdiag.
        self.assertFalse(os.path.exists(paths[1]))
        rep = load(paths[0])
        check_report(self, rep, 2)
        self.assertEqual(rep["verdict"], "PASS")
        self.assertEqual(rep["world"]["restart_count"], 0)
        return rep

    def test_two_nodes_restart_static_rendezvous(self):
        port = free_port()
        self.two_nodes_with_a_restart(lambda n: ["--node-rank", str(n), "--master-addr",
                                                 "127.0.0.1", "--master-port", str(port)])

    @unittest.skipUnless(TORCH2, "torch 2.x: the agents share one store across restarts")
    def test_two_nodes_restart_c10d_rendezvous(self):
        # torch 2.x keeps the agent's store across the restart, with node 0's
        # restart count at 0 and node 1's at 1: the workers of the restart
        # still meet.
        port = free_port()
        rep = self.two_nodes_with_a_restart(
            lambda n: ["--rdzv-backend", "c10d", "--rdzv-id", "restart%d" % port,
                       "--rdzv-endpoint", "127.0.0.1:%d" % port])
        # Node 0's worker of the first round met nobody (its peer exited
        # before ddpdiag started); the restart's workers met in a later run.
        self.assertGreaterEqual(rep["world"]["store_run"], 2)

    def test_torchrun_c10d_rendezvous_on_ddpdiag_store_serve(self):
        """torchrun's c10d rendezvous with its store on `ddpdiag store serve`
        (is_host=0: no agent hosts it), as the README offers for launches
        where no rank should host the store."""
        srv = subprocess.Popen([BIN, "store", "serve", "--port", "0", "--host", "127.0.0.1"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=clean_env())
        try:
            line = srv.stdout.readline()
            port = int(line.split("serving on ")[1].split()[0].rsplit(":", 1)[1])
            rep = self.run_torchrun(["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                                     "127.0.0.1:%d" % port, "--rdzv-id", "ddpdiag-c10d",
                                     "--rdzv-conf", "is_host=0"])
            self.assertEqual(rep["verdict"], "PASS")
        finally:
            srv.terminate()
            _, err = srv.communicate(timeout=30)
        # torch's agents and the workers used only what the store serves.
        self.assertNotIn("closed the connection of", err)

    @unittest.skipUnless(hasattr(dist.TCPStore, "list_keys"), "listing keys is torch 2.10 and later")
    def test_store_keys_names_the_rank_that_has_not_joined(self):
        """A torch job whose rank 2 has not reached init_process_group yet:
        `ddpdiag store keys --world-size 3` on torchrun's store names it."""
        import tempfile
        import time
        d = tempfile.mkdtemp(prefix="ddpdiag-keys-")
        go = os.path.join(d, "go")
        worker = os.path.join(d, "worker.py")
        with open(worker, "w") as f:
            f.write("import os, sys, time\n"
                    "import torch.distributed as dist\n"
                    "if os.environ['RANK'] == '2':\n"
                    "    t0 = time.monotonic()\n"
                    "    while not os.path.exists(sys.argv[1]) and time.monotonic() - t0 < 120:\n"
                    "        time.sleep(0.05)\n"
                    "dist.init_process_group('gloo')\n"
                    "dist.destroy_process_group()\n")
        port = free_port()
        job = subprocess.Popen(self.torchrun_cmd() + ["--master-addr", "127.0.0.1", "--master-port",
                                                      str(port), "--nproc-per-node", "3", worker, go],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=clean_env())
        try:
            deadline = time.monotonic() + 90
            seen = ""
            while time.monotonic() < deadline:
                p = subprocess.run([BIN, "store", "keys", "--addr", "127.0.0.1:%d" % port,
                                    "--world-size", "3", "--timeout", "2"],
                                   capture_output=True, text=True, timeout=60, env=clean_env())
                seen = p.stdout + p.stderr
                if p.returncode == 0 and "2 of 3 present (0-1); missing: 2" in p.stdout:
                    break
                time.sleep(0.2)
            self.assertIn("2 of 3 present (0-1); missing: 2", seen)
            self.assertIn("written by torchrun's agent of each node, N = node rank: 0", seen)
        finally:
            open(go, "w").close()
            out, _ = job.communicate(timeout=120)
        self.assertEqual(job.returncode, 0, out[-3000:])


if __name__ == "__main__":
    unittest.main(verbosity=2)
