"""Hangs, desyncs, dead ranks, init-check and bisect with real processes.

Faults come from the hidden --inject-fault seam of the monitored
communicator (comm/monitor.h), so the tests need no sleeps and no luck:
hang@seq=N,rank=R (R stalls before collective N), desync@seq=N,rank=R (R runs
a broadcast instead), exit@seq=N,rank=R (R is SIGKILLed), throw@seq=N,rank=R (a thread of R throws,
as Gloo's does on a protocol error), slow@rank=R,ms=M and
corrupt@rank=R (bisect). --test-hosts gives every rank a host name of its own.
Every wait is bounded: the ranks must end within the timeout plus a margin."""
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "reports"))
from common import (BIN, clean_env, free_port, load, readline_within, run, run_ranks, tmp_json,
                    main)  # noqa: E402
from validate_hook import validate  # noqa: E402

TIMEOUT = 6       # --timeout of the fault tests (s)
MARGIN = 10       # what a rank may take beyond it: publish, gather states, report
SMALL = ["-b", "1K", "-e", "1K", "-n", "20", "-w", "1"]
PHASES = ["environment", "resolve_master", "store_connect", "store_handshake", "register",
          "wait_for_ranks", "backend_init", "first_allreduce", "barrier"]


def rank_cmds(n, args, port):
    """args[0] is the subcommand; the rank flags follow it."""
    return [args[:1] + ["--rank", str(r), "--world-size", str(n), "--master-addr", "127.0.0.1",
                        "--master-port", str(port)] + args[1:] for r in range(n)]



class KilledPeerOnThisMachine(unittest.TestCase):
    def test_a_killed_peer_ends_the_collective_long_before_the_timeout(self):
        # Rank 1 SIGKILLed mid-sweep (the OOM killer's way), no launcher to
        # stop the others. Gloo reports a connection closed (rather than
        # reset) only at the collective's deadline; the watchdog sees the
        # peer's process gone on this machine and ends the collective now.
        # Several runs: which error Gloo raises varies.
        for attempt in range(3):
            with self.subTest(attempt=attempt):
                port = free_port()
                env = [clean_env(RANK=r, WORLD_SIZE=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
                       for r in range(2)]
                args = [BIN, "allreduce-test", "-b", "64K", "-e", "64K", "-n", "200000",
                        "--timeout", "30"]
                procs = [subprocess.Popen(args, env=e, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True) for e in env]
                try:
                    deadline = time.monotonic() + 60
                    while time.monotonic() < deadline:
                        line = procs[0].stdout.readline()
                        if not line or line.startswith("#   "):
                            break
                    time.sleep(0.5 + 0.3 * attempt)
                    procs[1].send_signal(signal.SIGKILL)
                    t0 = time.monotonic()
                    _, err = procs[0].communicate(timeout=60)
                    elapsed = time.monotonic() - t0
                finally:
                    for p in procs:
                        if p.poll() is None:
                            p.kill()
                        p.communicate()
                self.assertEqual(procs[0].returncode, 5, err)
                self.assertIn("Rank 1", err)
                self.assertIn("is dead", err)
                self.assertLess(elapsed, 10, err)

class InitCheck(unittest.TestCase):
    def test_full_timeline_at_2_and_3_ranks(self):
        for n in (2, 3):
            with self.subTest(ranks=n):
                path = tmp_json()
                p = run(["init-check", "--nproc", str(n), "--timeout", "20", "--json", path])
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                self.assertIn("# Verdict: PASS", p.stdout)
                rep = load(path)
                validate(path)
                self.assertEqual(rep["command"], "init-check")
                self.assertEqual(rep["world"]["size"], n)
                ranks = rep["results"]["ranks"]
                self.assertEqual([r["rank"] for r in ranks], list(range(n)))
                for r in ranks:
                    self.assertEqual([ph["name"] for ph in r["phases"]], PHASES)
                    for ph in r["phases"]:
                        self.assertEqual(ph["status"], "ok", ph)
                        self.assertGreaterEqual(ph["end_s"], ph["start_s"])
                        self.assertTrue(ph["detail"], ph)
                env = ranks[1]["phases"][0]["detail"]
                self.assertIn("launcher ddpdiag", env)
                self.assertIn("MASTER_PORT=", env)
                self.assertIn("IPv4", ranks[1]["phases"][1]["detail"])
                self.assertIn("protocol", ranks[1]["phases"][3]["detail"])
                names = {c["name"]: c["status"] for c in rep["checks"]}
                for ph in PHASES:
                    self.assertEqual(names[ph], "pass")
                self.assertEqual(names["all_ranks_reported"], "pass")
                os.unlink(path)

    def test_unresolvable_master_addr(self):
        p = run(["init-check", "--rank", "1", "--world-size", "2", "--master-addr",
                 "no-such-host.invalid", "--master-port", str(free_port()), "--timeout", "5"])
        self.assertEqual(p.returncode, 3, p.stderr)
        # Named as it was given: by the flag here, by the variable below.
        self.assertIn("--master-addr='no-such-host.invalid' does not resolve", p.stderr)
        self.assertIn("wrong MASTER_ADDR", p.stderr)
        p = run(["init-check", "--timeout", "5"],
                env=clean_env(RANK="1", WORLD_SIZE="2", MASTER_ADDR="no-such-host.invalid",
                              MASTER_PORT=str(free_port())))
        self.assertEqual(p.returncode, 3, p.stderr)
        self.assertIn("MASTER_ADDR='no-such-host.invalid' does not resolve", p.stderr)
        # It never reached the store, so it prints its own timeline.
        self.assertIn("could not reach the store", p.stderr)
        self.assertIn("resolve_master", p.stderr)
        self.assertLess(p.elapsed, 5 + MARGIN)

    def test_nothing_listens_is_refused(self):
        port = free_port()
        p = run(["init-check", "--rank", "1", "--world-size", "2", "--master-addr", "127.0.0.1",
                 "--master-port", str(port), "--timeout", "3"])
        self.assertEqual(p.returncode, 3, p.stderr)
        self.assertIn("refused", p.stderr)
        self.assertIn("store_connect", p.stderr)

    def test_a_server_that_accepts_and_never_answers_is_timed_in_the_handshake(self):
        # The TCP connection is made at once; the wait for an answer is the
        # handshake's row, not the connect's, and the message gives the time
        # the probes took.
        with socket.socket() as srv:
            srv.bind(("127.0.0.1", 0))
            srv.listen(8)
            port = srv.getsockname()[1]
            path = tmp_json()
            own = path[:-len(".json")] + ".rank1.json"
            p = run(["init-check", "--rank", "1", "--world-size", "2", "--master-addr",
                     "127.0.0.1", "--master-port", str(port), "--timeout", "3", "--json", path])
        self.assertEqual(p.returncode, 3, p.stderr)
        rep = load(own if os.path.exists(own) else path)
        for f in (path, own):
            if os.path.exists(f):
                os.unlink(f)
        phases = {ph["name"]: ph for ph in rep["results"]["ranks"][0]["phases"]}
        self.assertEqual(phases["store_connect"]["status"], "ok")
        self.assertLess(phases["store_connect"]["duration_ms"], 1000, phases)
        self.assertEqual(phases["store_handshake"]["status"], "fail")
        self.assertGreater(phases["store_handshake"]["duration_ms"], 2500, phases)
        # Both probes within --timeout 3 in all, not 3 s after the first.
        self.assertLess(phases["store_handshake"]["duration_ms"], 4000, phases)
        self.assertRegex(p.stderr, r"answered neither the torch 2.x handshake nor a torch 1.13 "
                                   r"request in [0-9]+ ms")

    def test_rank_0_killed_while_the_ranks_meet_is_named(self):
        # Rank 0 hosts the store and dies while rank 1 waits for rank 2:
        # rank 1 names rank 0 as gone (exit 5, a peer failure), not a
        # rejected request or a protocol mismatch, and writes its own report.
        port = free_port()
        path = tmp_json()
        own = path[:-len(".json")] + ".rank1.json"
        self.addCleanup(lambda: [os.unlink(f) for f in (path, own) if os.path.exists(f)])
        args = lambda r: [BIN, "init-check", "--rank", str(r), "--world-size", "3", "--master-addr",
                          "127.0.0.1", "--master-port", str(port), "--timeout", "30", "--json", path]
        rank0 = subprocess.Popen(args(0), env=clean_env(), stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
        self.addCleanup(lambda: rank0.poll() is None and rank0.kill())
        rank1 = subprocess.Popen(args(1), env=clean_env(), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        self.addCleanup(lambda: rank1.poll() is None and rank1.kill())
        time.sleep(2.0)  # both registered; rank 2 never comes
        t0 = time.monotonic()
        rank0.kill()
        rank0.wait(10)
        _, se = rank1.communicate(timeout=60)
        self.assertEqual(rank1.returncode, 5, se)
        self.assertIn("error on rank 1 (peer rank 0) during wait_for_ranks: rank 0, which hosted "
                      "the store at 127.0.0.1:%d, is gone" % port, se)
        self.assertNotIn("key over 8 KiB", se)
        self.assertIn("rank 1 lost the store; its own report", se)
        self.assertLess(time.monotonic() - t0, 15, se)  # --timeout is 30
        rep = load(own)
        self.assertEqual((rep["error"]["kind"], rep["error"]["peer"], rep["error"]["exit_code"]),
                         ("peer", 0, 5))

    def test_port_taken_by_another_job(self):
        with socket.socket() as s:
            s.bind(("0.0.0.0", 0))
            s.listen()
            port = s.getsockname()[1]
            path = tmp_json()
            p = run(["init-check", "--rank", "0", "--world-size", "2", "--master-port", str(port),
                     "--timeout", "3", "--json", path])
        self.assertEqual(p.returncode, 3, p.stderr)
        self.assertIn("another job", p.stdout + p.stderr)
        rep = load(path)
        validate(path)
        self.assertEqual(rep["error"]["phase"], "store_connect")
        os.unlink(path)

    def test_sigterm_writes_the_timeline_so_far(self):
        # torchrun stops its workers with SIGTERM on every restart: the
        # report of an init-check so stopped holds its timeline up to there.
        path = tmp_json()
        env = clean_env(RANK=0, WORLD_SIZE=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port())
        p = subprocess.Popen([BIN, "init-check", "--timeout", "20", "--json", path], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(2)  # waiting for rank 1 at the rendezvous
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=30)
        self.assertEqual(p.returncode, 143, err)
        self.assertIn("ddpdiag: rank 0: interrupted by SIGTERM; report: " + path, err)
        self.assertNotIn("ddpdiag: ddpdiag:", err)
        rep = load(path)
        os.unlink(path)
        self.assertEqual(rep["error"]["kind"], "interrupted")
        phases = [ph["name"] for ph in rep["results"]["ranks"][0]["phases"] if ph["status"] == "ok"]
        self.assertIn("store_connect", phases)

    @unittest.skipUnless(os.environ.get("DDPDIAG_TEST_SLOW_RENAME"),
                         "needs the slow_rename shim (tests/CMakeLists.txt; not in sanitizer builds)")
    def test_a_signal_while_the_final_report_is_written_waits_for_it(self):
        # A run that has finished: a SIGTERM (torchrun ending its workers, a
        # scheduler's time limit) that comes while rank 0 writes its report
        # neither loses the report (nor leaves a temporary file) nor calls
        # the run interrupted: the process ends with the run's exit code.
        for cmd, expect_rc in ((["allreduce-test", "-b", "8", "-e", "64"], 0),
                               (["init-check", "--timeout", "20"], 0)):
            with self.subTest(cmd=cmd[0]):
                d = tempfile.mkdtemp()
                path = os.path.join(d, "out.json")
                flag = os.path.join(d, "writing")
                env = clean_env(RANK=0, WORLD_SIZE=1, MASTER_ADDR="127.0.0.1",
                                MASTER_PORT=free_port(),
                                LD_PRELOAD=os.environ["DDPDIAG_TEST_SLOW_RENAME"],
                                SLOW_RENAME_SUFFIX="/out.json", SLOW_RENAME_FLAG=flag,
                                SLOW_RENAME_MS=3000)
                p = subprocess.Popen([BIN] + cmd + ["--json", path], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                deadline = time.monotonic() + 60
                while not os.path.exists(flag):
                    if p.poll() is not None or time.monotonic() > deadline:
                        p.kill()
                        self.fail("never reached its report's write: " + p.communicate()[1])
                    time.sleep(0.02)
                p.send_signal(signal.SIGTERM)
                out, err = p.communicate(timeout=30)
                self.assertEqual(p.returncode, expect_rc, err)
                self.assertIn("SIGTERM came after the run had finished and written its report; "
                              "exit code %d is the run's" % expect_rc, err)
                self.assertIn("# Verdict: PASS", out)
                rep = load(path)
                self.assertEqual(rep["verdict"], "PASS")
                self.assertEqual(sorted(os.listdir(d)), ["out.json", "writing"])
                shutil.rmtree(d)

    def test_a_sigterm_to_every_worker_blames_no_rank_that_ended_the_same_way(self):
        # A scheduler's time limit or a kill of torchrun: every worker gets
        # SIGTERM, and one that ends first must not be taken for the rank
        # that failed by a peer stopped later (it was, as "torchrun stopped
        # this rank ...: rank 1 ... had ended", exit 5). Rank 0 is held
        # (slow fault) outside any collective while rank 1 is stopped.
        port = free_port()
        envs = [clean_env(RANK=r, WORLD_SIZE=2, LOCAL_RANK=r, LOCAL_WORLD_SIZE=2,
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=port, TORCHELASTIC_RUN_ID="t",
                          TORCHELASTIC_USE_AGENT_STORE="False", TORCHELASTIC_RESTART_COUNT=0)
                for r in range(2)]
        args = [BIN, "allreduce-test", "-b", "8", "-e", "64", "-n", "3", "-w", "1", "--timeout",
                "40", "--inject-fault", "slow@rank=0,seq=5,ms=15000"]
        procs = [subprocess.Popen(args, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for e in envs]
        try:
            while True:  # the header: the ranks met; rank 0 then sleeps before #5
                line = readline_within(procs[0], 30)
                self.assertTrue(line, "rank 0 printed no header")
                if "(B)" in line:
                    break
            time.sleep(1.0)
            procs[1].send_signal(signal.SIGTERM)
            _, err1 = procs[1].communicate(timeout=30)
            self.assertEqual(procs[1].returncode, 143, err1)
            procs[0].send_signal(signal.SIGTERM)
            _, err0 = procs[0].communicate(timeout=30)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.communicate()
        self.assertEqual(procs[0].returncode, 143, err0)
        self.assertIn("ddpdiag: rank 0: interrupted by SIGTERM", err0)
        self.assertNotIn("had ended", err0)

    def test_rejected_environment_claims_no_rank(self):
        # RANK=4 in a world of 4: the rank is unknown and the store was never
        # tried, so the output claims neither rank 0 nor an unreachable store.
        path = tmp_json()
        env = clean_env(RANK=4, WORLD_SIZE=4, MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port())
        p = run(["init-check", "--timeout", "3", "--json", path], env=env, timeout=60)
        try:
            self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
            out = p.stdout + p.stderr
            self.assertIn("RANK=4 is out of range", out)
            self.assertIn("# FAILED in environment (the rank could not be determined)", p.stdout)
            for wrong in ("rank 0", "rank -1", "could not reach the store", "1 rank(s)"):
                self.assertNotIn(wrong, out)
            rep = load(path)
            self.assertEqual(rep["verdict"], "ERROR")
            self.assertEqual(rep["error"]["exit_code"], 2)
            self.assertIsNone(rep["results"]["ranks"][0]["rank"])
            # Nothing of the world is known.
            self.assertIsNone(rep["world"])
        finally:
            if os.path.exists(path):
                os.unlink(path)

    def test_rank_that_never_started_is_named(self):
        path = tmp_json()
        p = run(["init-check", "--rank", "0", "--world-size", "3", "--master-port",
                 str(free_port()), "--timeout", "4", "--json", path])
        self.assertEqual(p.returncode, 3, p.stderr)
        self.assertIn("never arrived: 1-2", p.stdout)
        self.assertIn("a rank that never started", p.stdout)
        rep = load(path)
        validate(path)
        self.assertEqual(rep["error"]["phase"], "wait_for_ranks")
        self.assertEqual([r["reported"] for r in rep["results"]["ranks"]], [True, False, False])
        wait = [ph for ph in rep["results"]["ranks"][0]["phases"] if ph["name"] == "wait_for_ranks"]
        self.assertEqual(wait[0]["status"], "fail")
        self.assertLess(p.elapsed, 4 + MARGIN)
        os.unlink(path)

    def test_a_world_of_a_million_where_one_rank_came_is_told_in_a_line(self):
        # 2^20 ranks (the most a world may have), only rank 0 started: the
        # ranks that never came are found without asking the store for each,
        # within the timeout, as ranges, and the timeline has one line for
        # them; one rank more is refused as a typo.
        path = tmp_json()
        try:
            for command in ("allreduce-test", "init-check"):
                with self.subTest(command=command):
                    p = run([command, "--rank", "0", "--world-size", str(2 ** 20), "--master-port",
                             str(free_port()), "--timeout", "3", "--json", path], timeout=120)
                    self.assertEqual(p.returncode, 3, p.stderr)
                    self.assertIn("1 of 1048576 ranks joined; rank(s) that never arrived: 1-1048575",
                                  p.stderr)
                    self.assertLess(len(p.stderr) + len(p.stdout), 8000)
                    self.assertLess(p.elapsed, 3 + MARGIN)
                    validate(path)
            self.assertIn("  1-1048575 ?", p.stdout)
            self.assertIn("no timeline from rank(s) 1-1048575", p.stdout)
            # The report lists the rank that came and the range that did not
            # (an entry each would make it 150 MB).
            rep = load(path)
            self.assertEqual([r["rank"] for r in rep["results"]["ranks"]], [0])
            self.assertEqual(rep["results"]["absent_ranks"], "1-1048575")
            self.assertEqual(rep["results"]["absent_rank_count"], 2 ** 20 - 1)
            self.assertLess(os.path.getsize(path), 100000)
            p = run(["allreduce-test", "--rank", "0", "--world-size", str(2 ** 20 + 1), "--master-port",
                     str(free_port()), "--timeout", "3"])
            self.assertEqual(p.returncode, 2, p.stderr)
            self.assertIn("--world-size=1048577 is more ranks than ddpdiag meets in one world "
                          "(at most 1048576)", p.stderr)
        finally:
            if os.path.exists(path):
                os.unlink(path)

    def test_backend_init_failure_on_rank_1_is_the_jobs_error(self):
        # Rank 1 alone names an interface that does not exist (--gloo-interface
        # may differ per rank): it reaches the store and the rendezvous, then
        # its Gloo cannot bind. Rank 0, waiting for rank 1's address, sees
        # rank 1's failure posted at the store and stops at once, well before
        # its --timeout of 20 s; the job's error is rank 1's failure.
        port = free_port()
        path = tmp_json()
        own = path[:-len(".json")] + ".rank1.json"
        cmds = rank_cmds(2, ["init-check", "--backend", "gloo", "--timeout", "20",
                             "--json", path], port)
        cmds[1] += ["--gloo-interface", "nosuchif"]
        try:
            (rc0, so0, se0, t0), (rc1, so1, se1, _) = run_ranks(
                cmds, [clean_env(), clean_env()], timeout=TIMEOUT + 60)
            self.assertEqual(rc1, 2, se1)
            self.assertIn("cannot bind to interface 'nosuchif'", se1)
            # Rank 0 exits with the cause's code (2, a configuration error on
            # rank 1), not its own timeout's (4).
            self.assertEqual(rc0, 2, so0 + se0)
            self.assertLess(t0, 10)
            self.assertIn("# FAILED on rank 1 in backend_init: gloo: cannot bind to interface "
                          "'nosuchif'", so0)
            self.assertIn("# also on rank 0 in backend_init: gloo: rank 0 stopped waiting for its "
                          "peers' connections: rank 1 failed in backend init", so0)
            self.assertNotIn("never reached the store", so0)
            rows = [l.split() for l in so0.splitlines() if not l.startswith("#")]
            rank1 = {r[2]: r[5] for r in rows if len(r) > 5 and r[0] == "1"}
            for ph in PHASES[:6]:
                self.assertEqual(rank1.get(ph), "ok", so0)
            self.assertEqual(rank1.get("backend_init"), "fail", so0)

            rep = load(path)
            self.assertEqual(rep["verdict"], "ERROR")
            err = rep["error"]
            self.assertEqual((err["rank"], err["phase"], err["exit_code"]), (1, "backend_init", 2),
                             err)
            self.assertIn("nosuchif", err["message"])
            self.assertIn("--gloo-interface", err["hint"])
            ranks = rep["results"]["ranks"]
            self.assertTrue(ranks[1]["reported"])
            status = {ph["name"]: ph["status"] for ph in ranks[1]["phases"]}
            for ph in PHASES[:6]:
                self.assertEqual(status[ph], "ok", ranks[1])
            self.assertEqual(status["backend_init"], "fail")
            self.assertIn("nosuchif", ranks[1]["error"]["message"])
            # Rank 0's own failure stays in its timeline.
            self.assertEqual(ranks[0]["error"]["kind"], "peer")
            checks = {c["name"]: c for c in rep["checks"]}
            self.assertEqual(checks["wait_for_ranks"]["status"], "pass")
            self.assertEqual(checks["backend_init"]["status"], "fail")
            self.assertIn("1", checks["backend_init"]["detail"])

            # Rank 1 failed: with --json it writes its own report beside the job's.
            self.assertIn("rank 1 failed in backend_init; its own report: %s" % own, se1)
            mine = load(own)
            self.assertEqual(mine["verdict"], "ERROR")
            self.assertEqual((mine["error"]["rank"], mine["error"]["phase"]), (1, "backend_init"))
            self.assertEqual([r["rank"] for r in mine["results"]["ranks"]], [1])
            self.assertEqual(mine["world"]["size"], 2)
        finally:
            for f in (path, own):
                if os.path.exists(f):
                    os.unlink(f)

    def test_peers_stop_waiting_when_a_rank_cannot_start_its_backend(self):
        # allreduce-test at 3 ranks, rank 2's interface does not exist: ranks
        # 0 and 1 stop waiting for it in Gloo's init at once (not at their
        # --timeout of 20 s), naming rank 2 and its error.
        port = free_port()
        cmds = rank_cmds(3, ["allreduce-test", "--timeout", "20", "-b", "1K", "-e", "1K"], port)
        cmds[2] += ["--gloo-interface", "nosuchif"]
        res = run_ranks(cmds, [clean_env()] * 3, timeout=60)
        rc2, _, se2, _ = res[2]
        self.assertEqual(rc2, 2, se2)
        for rank in (0, 1):
            rc, so, se, t = res[rank]
            self.assertLess(t, 10, se)
            self.assertNotEqual(rc, 0, se)
            self.assertIn("error on rank %d (peer rank 2) during backend.init: gloo: rank %d "
                          "stopped waiting for its peers' connections: rank 2 failed in backend "
                          "init: gloo: cannot bind to interface 'nosuchif'" % (rank, rank), se)

    def test_rank_that_registered_then_died_is_not_called_unreachable(self):
        # Rank 1 passes the rendezvous and the backend init, then is killed
        # before the first all_reduce: it never sends a timeline, but it did
        # reach the store.
        port = free_port()
        path = tmp_json()
        cmds = rank_cmds(2, ["init-check", "--timeout", str(TIMEOUT), "--json", path,
                             "--inject-fault", "exit@seq=1,rank=1"], port)
        try:
            (rc0, so0, se0, t0), _ = run_ranks(cmds, [clean_env(), clean_env()],
                                               timeout=TIMEOUT + 60)
            self.assertEqual(rc0, 5, so0 + se0)
            self.assertLess(t0, TIMEOUT + MARGIN)
            self.assertNotIn("never reached the store", so0)
            self.assertIn("no timeline: this rank registered at the store", so0)
            # On this machine its process is seen gone: named so, not waited for.
            self.assertRegex(so0, r"then its process \(pid \d+ on this machine\) ended")
            rep = load(path)
            self.assertEqual(rep["error"]["rank"], 0)
            r1 = rep["results"]["ranks"][1]
            self.assertFalse(r1["reported"])
            self.assertTrue(r1["registered"])
            self.assertEqual(r1["host"], rep["world"]["ranks"][1]["host"])
            checks = {c["name"]: c for c in rep["checks"]}
            self.assertEqual(checks["all_ranks_reported"]["status"], "fail")
            self.assertIn("registered at the store", checks["all_ranks_reported"]["detail"])
        finally:
            if os.path.exists(path):
                os.unlink(path)

    def test_world_size_mismatch_is_named(self):
        port = free_port()
        res = run_ranks([["init-check", "--rank", str(r), "--world-size", str(ws),
                          "--master-port", str(port), "--timeout", "4"]
                         for r, ws in ((0, 2), (1, 3))], [clean_env(), clean_env()],
                        timeout=4 + 30)
        for rc, so, se, elapsed in res:
            self.assertEqual(rc, 3, se)
            self.assertIn("world size", so + se)
            self.assertLess(elapsed, 4 + MARGIN)


class Hangs(unittest.TestCase):
    def launch(self, n, fault, extra=(), timeout=TIMEOUT):
        path = tmp_json()
        t0 = time.monotonic()
        p = run(["allreduce-test", "--nproc", str(n), "--timeout", str(timeout), "--json", path,
                 "--inject-fault", fault] + SMALL + list(extra), timeout=timeout + 60)
        p.elapsed = time.monotonic() - t0
        rep = load(path)
        validate(path)
        os.unlink(path)
        return p, rep

    def test_stalled_rank_every_rank_exits_4_naming_it(self):
        p, rep = self.launch(3, "hang@seq=5,rank=1")
        self.assertEqual(p.returncode, 4, p.stderr)
        self.assertLess(p.elapsed, TIMEOUT + MARGIN, p.stderr)
        # Every rank explains the hang the same way.
        for r in (0, 1, 2):
            self.assertIn("[rank %d] ddpdiag: error on rank %d" % (r, r), p.stderr)
        self.assertEqual(p.stderr.count("Rank 1 behind"), 3, p.stderr)
        self.assertNotIn("exited with code 5", p.stderr)
        # The launcher's last word agrees: the rank that ended first is
        # named, and when that is not rank 1, so is the rank its watchdog
        # blamed.
        self.assertRegex(p.stderr, r"ddpdiag launcher: rank (1 \(pid \d+\) failed first: it exited "
                                   r"with code 4 \(timed out\)\n|[02] \(pid \d+\) failed first: it "
                                   r"exited with code 4 \(timed out\), naming rank 1 as the cause)")
        # One numbering: the watchdog's collective #5 (the backend's own op
        # counter, which also counts the setup barrier, is not shown), and
        # the stuck rank does not name itself as its own peer.
        for r in (0, 1, 2):
            self.assertIn("[rank %d] ddpdiag: error on rank %d%s during all_reduce: collective #5 "
                          "all_reduce(float, 256, sum) did not complete on rank %d"
                          % (r, r, "" if r == 1 else " (peer rank 1)", r), p.stderr)
        self.assertNotIn("(peer rank 1) during", p.stderr.split("[rank 1] ddpdiag: error")[1]
                         .split("\n")[0])
        self.assertNotIn("allreduce #", p.stderr)
        self.assertNotIn("allreduce #", rep["error"]["message"])
        self.assertIn("collective #5 all_reduce(float, 256, sum)", rep["error"]["message"])
        self.assertEqual(rep["error"]["exit_code"], 4)
        self.assertEqual(rep["error"]["peer"], 1)
        wd = rep["results"]["watchdog"]
        self.assertEqual(wd["diagnosis"]["behind_ranks"], [1])
        self.assertEqual(len(wd["ranks"]), 3)
        self.assertTrue(wd["flight_recorder"])

    def test_hang_before_any_size_passes_no_check(self):
        # The hang comes during the first (only) size: nothing was measured,
        # so nothing may pass and there is no average bandwidth of nothing.
        p, rep = self.launch(2, "hang@seq=3,rank=1")
        self.assertEqual(p.returncode, 4, p.stderr)
        self.assertEqual(rep["verdict"], "ERROR")
        self.assertEqual(rep["results"]["sizes"], [])
        self.assertNotIn("avg_busbw_gbps", rep["results"])
        checks = {c["name"]: c for c in rep["checks"]}
        self.assertEqual(checks["correctness"]["status"], "skip", checks)
        self.assertIn("before any size was measured", checks["correctness"]["detail"])
        self.assertFalse([c for c in rep["checks"] if c["status"] == "pass"], rep["checks"])

    def test_bucket_sweep_that_hangs_recommends_no_cap(self):
        # mlp at 2 ranks, -n 2 -w 1: collective #3 is in the first cap, #40
        # in the second. The best of the caps measured before the hang is
        # not a recommendation, and nothing passes over no cap at all.
        for seq, caps_done in ((3, 0), (40, 1)):
            with self.subTest(seq=seq):
                path = tmp_json()
                p = run(["bucket-sweep", "--nproc", "2", "--timeout", str(TIMEOUT), "--json", path,
                         "--model", "mlp", "--caps", "1,25", "-n", "2", "-w", "1", "--no-size-sweep",
                         "--inject-fault", "hang@seq=%d,rank=1" % seq], timeout=TIMEOUT + 60)
                rep = load(path)
                os.unlink(path)
                self.assertEqual(p.returncode, 4, p.stderr)
                self.assertEqual(rep["verdict"], "ERROR")
                self.assertEqual(len(rep["results"]["caps"]), caps_done)
                self.assertIsNone(rep["results"]["recommended_cap_mb"])
                self.assertIsNone(rep["results"]["recommendation"])
                self.assertNotIn("# Recommendation", p.stdout)
                names = [c["name"] for c in rep["checks"]]
                self.assertEqual(len(names), len(set(names)), names)  # each check once
                checks = {c["name"]: c for c in rep["checks"]}
                if caps_done == 0:
                    self.assertFalse([c for c in rep["checks"] if c["status"] == "pass"], rep["checks"])
                    self.assertEqual(checks["correctness"]["status"], "skip")
                else:
                    self.assertIn("after 1 of 2 cap(s)", checks["correctness"]["detail"])

    def test_other_commands_that_hang_say_how_far_they_came(self):
        # broadcast-test, ddp-step and link-health stopped by a hang: no check
        # passes over nothing measured, each check is in the report once, and
        # broadcast-test judges the chunk sizes it measured, saying so.
        cases = (
            (["broadcast-test", "--model", "mlp", "--chunk-mb", "1,2"], 3,
             {"parameters_identical": ("skip", "before any chunk size was measured")}),
            (["broadcast-test", "--model", "mlp", "--chunk-mb", "1,2"], 20,
             {"parameters_identical": ("pass", "after 1 of 2 chunk size(s)")}),
            (["ddp-step", "--model", "mlp"], 3,
             {"gradients_correct": ("skip", "rank 0 alone: 0 wrong")}),
            (["link-health"], 3,
             {"links": ("skip", "before every pair's figures were gathered"),
              "data_correct": ("skip", "rank 0 alone: 0 wrong")}))
        for args, seq, want in cases:
            with self.subTest(args=args[0], seq=seq):
                path = tmp_json()
                p = run(args + ["--nproc", "2", "--timeout", str(TIMEOUT), "--json", path,
                                "-n", "2", "-w", "1", "--inject-fault", "hang@seq=%d,rank=1" % seq],
                        timeout=TIMEOUT + 60)
                rep = load(path)
                os.unlink(path)
                self.assertEqual(p.returncode, 4, p.stderr)
                self.assertEqual(rep["verdict"], "ERROR")
                names = [c["name"] for c in rep["checks"]]
                self.assertEqual(sorted(names), sorted(want), rep["checks"])
                for c in rep["checks"]:
                    self.assertEqual(c["status"], want[c["name"]][0], c)
                    self.assertIn(want[c["name"]][1], c["detail"])

    def test_desync_names_both_collectives(self):
        p, rep = self.launch(3, "desync@seq=4,rank=2")
        self.assertEqual(p.returncode, 4, p.stderr)
        self.assertLess(p.elapsed, TIMEOUT + MARGIN)
        self.assertIn("Ranks 0 and 1 are running all_reduce(float, 256, sum) but rank 2 is "
                      "running broadcast(float, 256, root=0)", p.stderr)
        mm = rep["results"]["watchdog"]["diagnosis"]["mismatches"]
        self.assertEqual(mm[0]["seq"], 4)
        self.assertEqual([g["ranks"] for g in mm[0]["groups"]], [[0, 1], [2]])

    def test_desync_check_catches_it_before_the_collective(self):
        p, rep = self.launch(2, "desync@seq=3,rank=1", ["--desync-check"], timeout=30)
        self.assertEqual(p.returncode, 5, p.stderr)
        self.assertLess(p.elapsed, 15, "--desync-check must not wait for the timeout")
        self.assertIn("--desync-check", p.stderr)
        self.assertIn("broadcast(float, 256, root=0)", p.stderr)
        self.assertEqual(rep["results"]["watchdog"]["detected_by"], "desync_check")

    def test_desync_check_passes_a_healthy_run(self):
        path = tmp_json()
        p = run(["allreduce-test", "--nproc", "2", "--desync-check", "--json", path] + SMALL)
        self.assertEqual(p.returncode, 0, p.stderr)
        os.unlink(path)


class PeerDeath(unittest.TestCase):
    def test_killed_rank_is_named_by_every_survivor(self):
        port = free_port()
        paths = [tmp_json() for _ in range(3)]
        args = rank_cmds(3, ["allreduce-test", "--timeout", str(TIMEOUT), "--inject-fault",
                             "exit@seq=6,rank=1"] + SMALL, port)
        res = run_ranks([a + ["--json", p] for a, p in zip(args, paths)],
                        [clean_env()] * 3, timeout=TIMEOUT + 60)
        self.assertEqual(res[1][0], -signal.SIGKILL)
        for r in (0, 2):
            rc, so, se, elapsed = res[r]
            self.assertEqual(rc, 5, se)
            self.assertLess(elapsed, TIMEOUT + MARGIN, se)
            self.assertIn("Rank 1 did not publish its state: it is dead", se)
        rep = load(paths[0])
        validate(paths[0])
        self.assertEqual(rep["error"]["exit_code"], 5)
        self.assertEqual(rep["error"]["peer"], 1)
        self.assertEqual(rep["results"]["watchdog"]["diagnosis"]["gone_ranks"], [1])
        for p in paths:
            if os.path.exists(p):
                os.unlink(p)

    def test_killed_rank_under_the_launcher(self):
        p = run(["allreduce-test", "--nproc", "3", "--timeout", str(TIMEOUT), "--inject-fault",
                 "exit@seq=6,rank=2"] + SMALL, timeout=TIMEOUT + 60)
        self.assertEqual(p.returncode, 5, p.stderr)
        self.assertIn("rank 2 (pid", p.stderr)
        self.assertIn("failed first: it was killed by signal 9 (SIGKILL)", p.stderr)
        self.assertIn("Rank 2 did not publish its state: it is dead", p.stderr)
        self.assertLess(p.elapsed, TIMEOUT + MARGIN)

    def test_killed_rank_0_leaves_a_report_from_the_survivor(self):
        # Rank 0 writes the job's report; killed, it writes none. A rank that
        # saw it gone writes its own (FILE.rank<R>.json), with the diagnosis.
        path = tmp_json()
        own = path[:-len(".json")] + ".rank1.json"
        try:
            p = run(["allreduce-test", "--nproc", "2", "--timeout", str(TIMEOUT), "--inject-fault",
                     "exit@seq=6,rank=0", "--json", path] + SMALL, timeout=TIMEOUT + 60)
            self.assertEqual(p.returncode, 5, p.stderr)
            self.assertFalse(os.path.exists(path))
            self.assertIn("its own report: %s" % own, p.stderr)
            rep = load(own)
            self.assertEqual(rep["verdict"], "ERROR")
            self.assertEqual(rep["error"]["rank"], 1)
            self.assertIn(0, rep["results"]["watchdog"]["diagnosis"]["gone_ranks"])
        finally:
            for f in (path, own):
                if os.path.exists(f):
                    os.unlink(f)

    def test_rank_0_that_hosted_the_store_is_named_when_it_dies(self):
        # Started by hand (RANK, WORLD_SIZE): rank 0's process hosts the
        # store. When it dies the store goes with it; rank 1, on the same
        # machine, must say so, not send the user to cables and firewalls.
        port = free_port()
        path = tmp_json()
        own = path[:-len(".json")] + ".rank1.json"
        envs = [clean_env(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)) for r in range(2)]
        args = ["allreduce-test", "--timeout", str(TIMEOUT), "--inject-fault", "exit@seq=6,rank=0",
                "--json", path] + SMALL
        try:
            out = run_ranks([args, args], envs, timeout=TIMEOUT + 60)
            rc1, _, se1, _ = out[1]
            self.assertEqual(rc1, 5, se1)
            self.assertRegex(se1, r"Rank 0 \(pid \d+ on this machine\), which hosted the store, has "
                                  r"ended: its process is gone, and the store with it\.")
            self.assertIn("hint: look at rank 0's log and report", se1)
            self.assertNotIn("cable", se1)
            rep = load(own)
            self.assertEqual(rep["error"]["exit_code"], 5)
            self.assertEqual(rep["error"]["peer"], 0)
        finally:
            for f in (path, own):
                if os.path.exists(f):
                    os.unlink(f)

    def test_rank_0_that_hosted_the_store_killed_mid_collective_ends_it_early(self):
        # Started by hand, rank 0 hosting the store is SIGKILLed while a large
        # broadcast is in flight: rank 1 loses the store within seconds, and
        # must still end the collective on seeing rank 0's process gone from
        # this machine, not wait out --timeout 30.
        for attempt in range(2):
            with self.subTest(attempt=attempt):
                port = free_port()
                procs = [subprocess.Popen([BIN] + a, env=clean_env(), stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True)
                         for a in rank_cmds(2, ["broadcast-test", "--model", "gpt2", "-n", "100000",
                                                "-w", "0", "--chunk-mb", "250", "--timeout", "30"], port)]
                try:
                    # Rank 0 prints its header once the world is up; the
                    # broadcasts of 250 MiB chunks follow back to back.
                    t0 = time.monotonic()
                    while time.monotonic() - t0 < 60:
                        line = procs[0].stdout.readline()
                        if not line or line.startswith("#"):
                            break
                    time.sleep(1.0 + 0.5 * attempt)
                    procs[0].send_signal(signal.SIGKILL)
                    t_kill = time.monotonic()
                    _, se = procs[1].communicate(timeout=90)
                    elapsed = time.monotonic() - t_kill
                finally:
                    for p in procs:
                        if p.poll() is None:
                            p.kill()
                        p.communicate()
                self.assertEqual(procs[1].returncode, 5, se)
                self.assertRegex(se, r"Rank 0 \(pid \d+ on this machine\), which hosted the store, has ended")
                self.assertLess(elapsed, 15, se)

    def test_library_thread_failure_still_writes_the_report(self):
        # An exception in a thread ddpdiag does not own (Gloo's network thread
        # on a protocol error) ends the process in std::terminate: it exits 5
        # with the message and a hint, and still writes its report of the
        # failure (rank 0: the job's; another rank: FILE.rank<R>.json).
        for rank in (0, 1):
            with self.subTest(rank=rank):
                path = tmp_json()
                own = path[:-len(".json")] + ".rank1.json"
                try:
                    p = run(["allreduce-test", "--nproc", "2", "--timeout", str(TIMEOUT),
                             "--inject-fault", "throw@seq=3,rank=%d" % rank, "--json", path]
                            + SMALL, timeout=TIMEOUT + 60)
                    self.assertEqual(p.returncode, 5, p.stderr)
                    self.assertIn("ddpdiag: error on rank %d: a library thread failed: injected "
                                  "fault" % rank, p.stderr)
                    self.assertIn("failed first: it exited with code 5", p.stderr)
                    written = path if rank == 0 else own
                    self.assertIn("report of the failure: %s" % written, p.stderr)
                    rep = load(written)
                    self.assertEqual(rep["verdict"], "ERROR")
                    self.assertEqual(rep["error"]["kind"], "backend")
                    self.assertEqual(rep["error"]["rank"], rank)
                    self.assertEqual(rep["error"]["exit_code"], 5)
                    self.assertIn("a library thread failed", rep["error"]["message"])
                    self.assertEqual(rep["world"]["size"], 2)
                    if rank == 1:
                        # Rank 0 wrote the job's report from what it saw.
                        job = load(path)
                        self.assertEqual(job["verdict"], "ERROR")
                        self.assertEqual(job["error"]["peer"], 1)
                    elif os.path.exists(own):
                        # Rank 1 saw rank 0 gone, and cannot know that rank 0
                        # wrote its report: it writes its own beside it.
                        mine = load(own)
                        self.assertEqual(mine["error"]["rank"], 1)
                        self.assertIn(0, mine["results"]["watchdog"]["diagnosis"]["gone_ranks"])
                    self.assertLess(p.elapsed, TIMEOUT + MARGIN)
                finally:
                    for f in (path, own):
                        if os.path.exists(f):
                            os.unlink(f)

    def test_stopped_rank_is_named_as_stopped(self):
        self.stop_rank_1(TIMEOUT)

    def test_stopped_rank_ends_the_collective_at_the_stall_not_the_timeout(self):
        # --timeout 40: a rank on this machine stopped for 10 s (a quarter
        # of it) ends the collective then, as a silent rank on another
        # machine does, rather than at 40 s.
        outs = self.stop_rank_1(40)
        for r in (0, 2):
            rc, se, elapsed = outs[r]
            self.assertEqual(rc, 5, se)
            self.assertLess(elapsed, 30, se)
            # The rank whose watchdog saw the stall first says for how long;
            # on a loaded machine the other may first see that rank's
            # connection close, and names rank 1 stopped from its state.
            self.assertRegex(se, r"rank 1 \(pid \d+ on this machine\) has been stopped for 1\d s "
                                 r"\(state T: SIGSTOP, or a debugger\)|"
                                 r"Rank 1 did not publish its state: it is stopped: its process \d+ "
                                 r"on this machine exists but does not run \(SIGSTOP or a debugger\)")
        self.assertTrue(any("has been stopped for" in outs[r][1] for r in (0, 2)),
                        [outs[r][1] for r in (0, 2)])

    def test_stopped_rank_0_that_hosts_the_store_is_named_stopped(self):
        # Started by hand, rank 0's process hosts the store: stopped, it takes
        # the store with it, and rank 1 on the same machine must say that
        # rank 0 is stopped, not send the user to cables and firewalls. With
        # the store gone too, rank 1 still ends the collective at the stall
        # (a quarter of --timeout 40: 10 s), not at the timeout.
        outs, pids = self.stop_one_rank(2, 0, 40)
        rc, se, elapsed = outs[1]
        self.assertEqual(rc, 5, se)
        self.assertLess(elapsed, 30, se)
        self.assertRegex(se, r"Rank 0 \(pid %d on this machine\), which hosts the store, is "
                             r"stopped" % pids[0])
        self.assertIn("hint: resume rank 0 (kill -CONT %d)" % pids[0], se)
        self.assertNotIn("cable", se)

    def stop_one_rank(self, n, stopped, timeout):
        """Starts n ranks by hand and stops rank `stopped` mid-sweep with
        SIGSTOP; returns ({other rank: (rc, stderr, seconds from the stop to
        its exit)}, the ranks' pids)."""
        port = free_port()
        procs = [subprocess.Popen([BIN] + a, env=clean_env(), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
                 # -n 10^7: the sweep keeps at most 1,024 ops in flight, so the
                 # timeout runs from the first op that cannot complete, not from
                 # the last of ten million queued ones.
                 for a in rank_cmds(n, ["allreduce-test", "--timeout", str(timeout), "-b", "1K",
                                        "-e", "1K", "-n", "10000000", "-w", "1"], port)]
        try:
            # Rank 0 prints the table header once the world is up.
            t0 = time.monotonic()
            while time.monotonic() - t0 < 60:
                line = procs[0].stdout.readline()
                if not line or line.startswith("#   ") and "size" in line:
                    break
            time.sleep(0.5)
            os.kill(procs[stopped].pid, signal.SIGSTOP)
            t_stop = time.monotonic()
            outs = {}
            for r in range(n):
                if r == stopped:
                    continue
                so, se = procs[r].communicate(timeout=timeout + 60)
                outs[r] = (procs[r].returncode, se, time.monotonic() - t_stop)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.communicate()
        return outs, [p.pid for p in procs]

    def stop_rank_1(self, timeout):
        """Stops rank 1 of 3 mid-sweep with SIGSTOP; returns, for ranks 0 and
        2, (rc, stderr, seconds from the stop to their exit), having checked
        that both ended within the timeout and named rank 1 stopped."""
        outs, _ = self.stop_one_rank(3, 1, timeout)
        for r in (0, 2):
            rc, se, elapsed = outs[r]
            self.assertIn(rc, (4, 5), se)
            self.assertLess(elapsed, timeout + MARGIN, se)
            self.assertIn("Rank 1 did not publish its state: it is stopped", se)
        return outs


class Bisect(unittest.TestCase):
    def test_slow_host_is_found(self):
        path = tmp_json()
        p = run(["allreduce-test", "--nproc", "4", "--test-hosts", "a,a,b,b", "--bisect",
                 "--inject-fault", "slow@rank=3,ms=30", "--json", path, "-b", "1K", "-e", "1K",
                 "-n", "3", "-w", "1"])
        self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
        self.assertIn("# bisect: smallest failing set: host b", p.stdout)
        rep = load(path)
        validate(path)
        b = rep["results"]["bisect"]
        self.assertEqual(b["suspect_hosts"], ["b"])
        self.assertEqual(b["suspect_ranks"], [2, 3])
        self.assertEqual(sorted(rep["world"]["hosts"]), ["a", "b"])
        os.unlink(path)

    def test_broken_rank_is_found(self):
        path = tmp_json()
        p = run(["allreduce-test", "--nproc", "3", "--test-hosts", "x,y,z", "--bisect",
                 "--inject-fault", "corrupt@rank=2", "--json", path, "-b", "1K", "-e", "1K",
                 "-n", "2", "-w", "1"])
        self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
        rep = load(path)
        validate(path)
        b = rep["results"]["bisect"]
        self.assertEqual(b["suspect_ranks"], [2])
        self.assertEqual(b["suspect_hosts"], ["z"])
        self.assertEqual(b["smallest_failing_set"]["ranks"], [2])
        self.assertIn("points to rank 2 on host z", p.stdout)
        os.unlink(path)

    def test_a_run_that_ends_with_an_error_records_bisect_as_skipped(self):
        # Rank 2 hangs: the watchdog names it (exit 4); sub-groups are not
        # tested (those holding rank 2 would wait out --timeout each), and
        # the report says so rather than leaving the check out.
        path = tmp_json()
        p = run(["allreduce-test", "--nproc", "3", "-b", "1K", "-e", "2K", "-n", "2", "-w", "1",
                 "--timeout", "5", "--bisect", "--inject-fault", "hang@seq=5,rank=2", "--json",
                 path])
        self.assertEqual(p.returncode, 4, p.stdout + p.stderr)
        rep = load(path)
        validate(path)
        os.unlink(path)
        checks = {c["name"]: c for c in rep["checks"]}
        self.assertEqual(checks["bisect"]["status"], "skip")
        self.assertIn("the run ended with an error", checks["bisect"]["detail"])
        self.assertNotIn("bisect", rep["results"])

    def test_wrong_result_names_the_rank_without_bisect(self):
        # The check itself says whose result was wrong (the sweep gathers
        # every rank's count), in the table's footer, the check and the JSON;
        # the launcher calls it a failed check, not a rank that failed first.
        for bad in (0, 2):
            with self.subTest(rank=bad):
                path = tmp_json()
                p = run(["allreduce-test", "--nproc", "3", "--test-hosts", "x,y,z",
                         "--inject-fault", "corrupt@rank=%d" % bad, "--json", path, "-b", "8",
                         "-e", "64", "-n", "2", "-w", "0", "-c", "3"])
                self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
                host = "xyz"[bad]
                self.assertIn("# Wrong on rank %d (%s) :" % (bad, host), p.stdout)
                self.assertIn("wrong on rank %d on %s:" % (bad, host), p.stdout)
                self.assertIn("a check failed (verdict FAIL)", p.stderr)
                self.assertNotIn("failed first", p.stderr)
                rep = load(path)
                validate(path)
                os.unlink(path)
                r = rep["results"]
                self.assertEqual([w["rank"] for w in r["wrong_ranks"]], [bad])
                self.assertEqual(r["wrong_ranks"][0]["host"], host)
                self.assertEqual(r["wrong_ranks"][0]["first"], "8 B float sum out-of-place")
                # The fault adds 1 to element 0 of one result: the element,
                # the value found and the one expected are named.
                w = r["wrong_ranks"][0]
                self.assertEqual(w["first_element"], 0)
                self.assertEqual(w["got"], w["expected"] + 1)
                self.assertIn("first at 8 B float sum out-of-place, element 0 = %g instead of %g"
                              % (w["got"], w["expected"]), p.stdout)
                for row in r["sizes"]:
                    self.assertEqual(row["out_of_place"]["wrong_ranks"], [bad])
                # -c 3 checks three times: an element wrong each time counts once.
                self.assertEqual(r["sizes"][0]["out_of_place"]["wrong"], 1)

    def test_init_check_bisect(self):
        path = tmp_json()
        p = run(["init-check", "--nproc", "3", "--test-hosts", "x,y,z", "--bisect",
                 "--inject-fault", "slow@rank=1,ms=30", "--timeout", "20", "--json", path])
        self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
        rep = load(path)
        validate(path)
        self.assertEqual(rep["results"]["bisect"]["suspect_ranks"], [1])
        self.assertEqual(rep["results"]["bisect"]["suspect_hosts"], ["y"])
        # The header comes first; the bisect block and the failing check that
        # makes the verdict FAIL (every phase was ok) follow the timeline.
        out = p.stdout
        header = out.find("# ddpdiag init-check:")
        self.assertEqual(header, out.find("#"), out)
        self.assertLess(header, out.find("# bisect:"), out)
        self.assertLess(out.find("# bisect:"), out.find("# Verdict: FAIL"), out)
        self.assertRegex(out, r"# Check bisect\s+: fail \(smallest failing set")
        os.unlink(path)

    def test_healthy_run_bisect_says_nothing_failed(self):
        # On 2 ranks the groups are the ranks alone: their times are not
        # judged (a busy machine's scheduler once timed one 14x the other).
        path = tmp_json()
        p = run(["allreduce-test", "--nproc", "2", "-b", "1K", "-e", "4K", "-n", "3", "-w", "1",
                 "--timeout", "10", "--bisect", "--json", path])
        rep = load(path)
        validate(path)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertTrue(all(not g["slow"] for g in rep["results"]["bisect"]["groups"]), p.stdout)
        summary = rep["results"]["bisect"]["summary"]
        self.assertIn("the full world passed", summary)
        self.assertNotIn("failure", summary)
        bisect = [c for c in rep["checks"] if c["name"] == "bisect"]
        self.assertEqual([c["status"] for c in bisect], ["pass"])
        self.assertEqual(bisect[0]["detail"], summary)
        self.assertIn("# bisect: the full world passed", p.stdout)
        self.assertNotIn("the failure needs the whole world", p.stdout)
        os.unlink(path)


if __name__ == "__main__":
    main()
