"""A host's link goes down in the middle of a run, across "hosts" made of
network namespaces.

Three namespaces, one rank each, joined through a bridge in a fourth (the
switch); every rank runs in its own UTS namespace with its own host name
(host0, host1, host2), and rank 0 hosts the store on host0. init-check must
pass first. Then allreduce-test runs on every host, and the test takes one
host's link down:

- host2 (its interface, inside its namespace): ranks 0 and 1 must exit with
  code 5 (a peer failed: DESIGN.md's code for a failure that has a culprit
  rank; 4 is for hangs where every rank is still there) within the timeout
  plus MARGIN, naming rank 2 on host2 as unreachable on stderr and in the
  job's report; rank 2, which can reach neither its peers nor the store, must
  exit 5 within the same bound, name the store and ranks 0 and 1 as
  unreachable, and write its own report (FILE.rank2.json).
- host0, the store's host (its switch port, on the bridge side): ranks 1 and
  2 must say that the store is unreachable and write their own reports; rank
  0 names ranks 1 and 2 as unreachable.

Needs root, `ip netns` and unshare; exits 77 (skipped) otherwise. Every
namespace (and with it every veth and the bridge) is removed on every path;
names carry the test's pid, and namespaces left by a run that was killed are
removed by the next one."""
import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.dirname(__file__))
from common import BIN, clean_env, load, tmp_json  # noqa: E402
from netns import BridgedHosts, sh  # noqa: E402
import netns  # noqa: E402

SKIP = 77
TIMEOUT = 10   # --timeout of the runs (s)
# What a rank may take beyond --timeout once the link is down: the watchdog's
# grace over the deadline (1 s), its wait for the others' states or its store
# deadline (timeout / 4 = 2.5 s), writing the report; the rest is slack for a
# loaded two-core machine.
MARGIN = 10
PREFIX = "ddk"
TAG = "%s%d" % (PREFIX, os.getpid())
IFACE = "ddk0"
NET = BridgedHosts(TAG, 3, "10.233.%d" % (os.getpid() % 250), IFACE)  # pid < 2^22: names fit
HOSTS, SWITCH, ADDR, SWITCH_END = NET.hosts, NET.switch, NET.addr, NET.switch_end
setup, teardown = NET.setup, NET.teardown


def remove_stale():
    """Namespaces of earlier runs whose process is gone (killed by a timeout)."""
    listing = sh("ip", "netns", "list", check=False).stdout
    for line in listing.splitlines():
        m = re.match(r"^(%s(\d+)(?:h\d|sw|probe))\b" % PREFIX, line)
        if m and not os.path.exists("/proc/%s" % m.group(2)):
            for pid in sh("ip", "netns", "pids", m.group(1), check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            sh("ip", "netns", "del", m.group(1), check=False)


def start(rank, hosts, args, port, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
          timeout=TIMEOUT):
    """Starts `rank` of a job whose rank r runs on host hosts[r]."""
    host = hosts[rank]
    local = [r for r in range(len(hosts)) if hosts[r] == host]
    inner = [BIN] + args[:1] + [
        "--rank", str(rank), "--world-size", str(len(hosts)), "--local-rank",
        str(local.index(rank)), "--local-world-size", str(len(local)), "--master-addr", ADDR[0],
        "--master-port", str(port), "--gloo-interface", IFACE, "--timeout", str(timeout)
    ] + args[1:]
    return subprocess.Popen(NET.command(host, inner), env=clean_env(), stdout=stdout,
                            stderr=stderr, text=True,
                            preexec_fn=die_with_parent)


def die_with_parent():
    """A rank outlives a test that was SIGKILLed (a ctest timeout) by minutes
    otherwise: its sweep is long. `ip netns exec`, unshare and sh all exec in
    place, so the signal stays armed in ddpdiag itself."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def kill_all(procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
        try:
            p.communicate(timeout=10)
        except (subprocess.TimeoutExpired, ValueError):
            pass


def rank_path(path, rank):
    return path[:-len(".json")] + ".rank%d.json" % rank


def ranks_word(ranks):
    """As ddpdiag writes them: "rank 2", "ranks 2 and 3", "ranks 0, 1 and 2"."""
    if len(ranks) == 1:
        return "rank %d" % ranks[0]
    return "ranks %s and %d" % (", ".join(str(r) for r in ranks[:-1]), ranks[-1])


def ranks_are(ranks):
    return ranks_word(ranks) + (" is" if len(ranks) == 1 else " are")


def remove(*paths):
    for p in paths:
        if os.path.exists(p):
            os.unlink(p)


class LinkDown(unittest.TestCase):
    port = 29811

    def setUp(self):
        teardown()
        try:
            setup()
        except Exception:
            teardown()
            raise
        LinkDown.port += 2
        self.json = tmp_json()
        self.addCleanup(remove, self.json, *[rank_path(self.json, r) for r in range(4)])

    def tearDown(self):
        teardown()

    def init_check_passes(self, hosts):
        procs = [start(r, hosts, ["init-check"], self.port) for r in range(len(hosts))]
        try:
            res = [p.communicate(timeout=60) + (p.returncode,) for p in procs]
        finally:
            kill_all(procs)
        for so, se, rc in res:
            self.assertEqual(rc, 0, so + se)
        self.assertIn("# Verdict: PASS", res[0][0])

    def all_running(self, procs, files):
        for r, p in enumerate(procs):
            if p.poll() is not None:
                with open(files[r][1].name) as f:
                    self.fail("rank %d ended (rc %s) before the cut:\n%s" % (r, p.returncode,
                                                                          f.read()))

    def run_and_cut(self, hosts, cut, timeout=TIMEOUT, ending=None, args=None, settle=None):
        """Runs allreduce-test on the three hosts, calls cut() once rank 0 has
        printed its table header, and returns per rank (rc, stderr, seconds
        from the cut to the rank's exit). ending: the ranks that must end
        (all by default). args: another command (and its options) instead,
        cut `settle` seconds after the start, since it prints no header.

        The run is a long sweep of small blocks (4097 sizes from 64 KiB to
        128 KiB, 5 timed iterations each): every wait is far shorter than
        --timeout on a healthy link, so a run that times out was stopped by
        the cut, and the sweep outlasts the bound by minutes. Output goes to
        files, which never fill up as a pipe would."""
        n = len(hosts)
        if args is None:
            args = ["allreduce-test", "-b", "64K", "-e", "128K", "-i", "16", "-n", "5", "-w",
                    "1"]
        args = args + ["--json", self.json]
        logs = tempfile.TemporaryDirectory(prefix="ddpdiag-linkdown-")
        self.addCleanup(logs.cleanup)
        files = [(open(os.path.join(logs.name, "out%d" % r), "w+"),
                  open(os.path.join(logs.name, "err%d" % r), "w+")) for r in range(n)]
        procs = [start(r, hosts, args, self.port + 1, *files[r], timeout=timeout)
                 for r in range(n)]
        ending = list(range(n)) if ending is None else ending
        ended = {}
        try:
            t0 = time.monotonic()
            while time.monotonic() - t0 < 60 and procs[0].poll() is None:
                if settle is not None:
                    time.sleep(settle)
                    break
                with open(files[0][0].name) as f:
                    if any(line.startswith("#   ") and "size" in line for line in f):
                        break
                time.sleep(0.05)
            self.all_running(procs, files)
            time.sleep(1.0)
            self.all_running(procs, files)
            cut(procs) if getattr(cut, "takes_procs", False) else cut()
            t_cut = time.monotonic()
            # Poll all three, so each exit time is its own.
            while (any(r not in ended for r in ending)
                   and time.monotonic() - t_cut < timeout + 60):
                for r, p in enumerate(procs):
                    if r not in ended and p.poll() is not None:
                        ended[r] = time.monotonic() - t_cut
                time.sleep(0.05)
        finally:
            kill_all(procs)
            for fo, fe in files:
                fo.close()
                fe.close()
        out = {}
        for r, p in enumerate(procs):
            with open(files[r][1].name) as f:
                out[r] = (p.returncode, f.read(), ended.get(r, float("inf")))
        sys.stderr.write("\n  exit after the cut: %s\n" % ", ".join(
            "rank %d %.1f s (rc %s)" % (r, out[r][2], out[r][0]) for r in sorted(out)))
        for r in ending:
            self.assertIn(r, ended, "rank %d did not end within %d s of the cut:\n%s"
                          % (r, timeout + 60, out[r][1]))
        return out

    def host2_link_down(self, hosts):
        """hosts[r]: the host of rank r. Host 2's interface goes down inside
        its namespace."""
        n = len(hosts)
        cut = [r for r in range(n) if hosts[r] == 2]
        self.init_check_passes(hosts)
        out = self.run_and_cut(hosts, lambda: sh("ip", "-n", HOSTS[2], "link", "set", IFACE,
                                                 "down"))
        for r in range(n):
            rc, se, elapsed = out[r]
            self.assertEqual(rc, 5, "rank %d: %s" % (r, se))
            self.assertLess(elapsed, TIMEOUT + MARGIN, "rank %d: %s" % (r, se))
        for r in range(n):
            if r in cut:
                continue
            se = out[r][1]
            for q in cut:
                self.assertIn("Rank %d did not publish its state: it is unreachable: no state and "
                              "no heartbeat" % q, se)
            self.assertIn("(host host2, pid", se)
            self.assertIn("hint: %s unreachable (host host2)" % ranks_are(cut), se)
            self.assertNotIn("The store at", se)
            # It reached the store: its view is in rank 0's report, no file of its own.
            self.assertFalse(os.path.exists(rank_path(self.json, r)))
        rep = load(self.json)
        self.assertEqual(rep["error"]["exit_code"], 5)
        self.assertEqual(rep["error"]["peer"], cut[0])
        wd = rep["results"]["watchdog"]
        self.assertEqual(wd["diagnosis"]["gone_ranks"], cut)
        self.assertEqual(wd["diagnosis"]["unreachable_ranks"], cut)
        self.assertTrue(wd["store"]["reachable"])
        self.assertTrue(any("Rank %d did not publish its state: it is unreachable" % cut[0] in f
                            for f in wd["diagnosis"]["findings"]), wd["diagnosis"])

        store = "%s:%d" % (ADDR[0], self.port + 1)
        for r in cut:
            se = out[r][1]
            others = [q for q in range(n) if q != r]
            far = [q for q in others if q not in cut]      # on other hosts: unreachable
            near = [q for q in others if q in cut]         # on host2 too: cut off with it
            on = sorted({hosts[q] for q in far})
            self.assertIn("The store at %s is unreachable from rank %d (it did not answer "
                          % (store, r), se)
            self.assertIn("%s (host%s %s) %s unreachable from here" % (
                ranks_word(far), "s" if len(on) > 1 else "",
                ", ".join("host%d" % h for h in on), "are" if len(far) > 1 else "is"), se)
            if near:
                self.assertIn("; %s, on this host, %s cut off with it." % (
                    ranks_word(near), "are" if len(near) > 1 else "is"), se)
            else:
                self.assertNotIn("on this host", se)
            self.assertIn("its own report: " + rank_path(self.json, r), se)
            own = load(rank_path(self.json, r))
            self.assertEqual(own["world"]["size"], n)
            self.assertEqual(own["error"]["exit_code"], 5)
            self.assertEqual(own["error"]["rank"], r)
            wd = own["results"]["watchdog"]
            self.assertEqual(wd["diagnosis"]["unreachable_ranks"], far)
            self.assertEqual(wd["diagnosis"]["gone_ranks"], others)
            self.assertEqual(wd["store"], {"address": store, "reachable": False,
                                           "error": wd["store"]["error"]})
            self.assertIn("did not answer", wd["store"]["error"])

    def test_rank_killed_on_another_host_is_dead_not_unreachable(self):
        # Rank 2's process is killed on host 2 (the OOM killer's way): its
        # host's kernel resets the connections, so the network is up and the
        # process is gone; the others must not send the user to the cables.
        hosts = [0, 1, 2]

        def kill2(procs):
            procs[2].send_signal(signal.SIGKILL)
        kill2.takes_procs = True
        out = self.run_and_cut(hosts, kill2)
        for r in (0, 1):
            rc, se, elapsed = out[r]
            self.assertEqual(rc, 5, "rank %d: %s" % (r, se))
            self.assertIn("Rank 2 did not publish its state: it is dead", se)
            self.assertIn("closed or reset the connection to it", se)
            self.assertNotIn("lost its network", se)
            self.assertNotIn("network link", se.split("hint:")[-1])
        rep = load(self.json)
        self.assertEqual(rep["error"]["peer"], 2)
        self.assertEqual(rep["results"]["watchdog"]["diagnosis"]["unreachable_ranks"], [])

    def test_rank_frozen_on_another_host_ends_the_collective_before_the_timeout(self):
        # Rank 2's process is stopped on host 2 (SIGSTOP; a frozen host or
        # one whose process was killed with its connections closed looks the
        # same): no connection fails, so only its silent heartbeat tells.
        # With --timeout 60 the others stop after 15 s of silence, not 60.
        hosts = [0, 1, 2]

        def stop2(procs):
            procs[2].send_signal(signal.SIGSTOP)
        stop2.takes_procs = True
        out = self.run_and_cut(hosts, stop2, timeout=60, ending=[0, 1])
        for r in (0, 1):
            rc, se, elapsed = out[r]
            self.assertEqual(rc, 5, "rank %d: %s" % (r, se))
            self.assertLess(elapsed, 35, "rank %d: %s" % (r, se))
            # Host 2 answers on the network: not sent to the cables.
            self.assertIn("Rank 2 did not publish its state: it is silent: no state and no "
                          "heartbeat (host host2, pid", se)
            self.assertIn("yet its host answers on the network, so the process is frozen", se)
            self.assertNotIn("unreachable", se)
            self.assertIn("hint: look at the process of rank 2 on its host", se)
        rep = load(self.json)
        self.assertEqual(rep["error"]["peer"], 2)
        wd = rep["results"]["watchdog"]
        self.assertEqual(wd["diagnosis"]["unreachable_ranks"], [])
        # What ended the wait: rank 0 watched rank 2's heartbeat.
        self.assertIn("rank 2 (pid", json.dumps(rep))
        self.assertRegex(json.dumps(rep), r"wrote no new heartbeat for (1[5-9]|2\d) s")

    def test_store_host_killed_on_another_host_is_dead_not_our_network(self):
        # Rank 0, whose process hosts the store, is killed on host 0: ranks
        # 1 and 2 lose the store and their peer at once. Host 0's kernel
        # refuses the store's port, so host and network are up: they must
        # name rank 0 as ended, not send the user to their own cables, and
        # not call each other unreachable.
        hosts = [0, 1, 2]

        def kill0(procs):
            procs[0].send_signal(signal.SIGKILL)
        kill0.takes_procs = True
        out = self.run_and_cut(hosts, kill0, ending=[1, 2])
        store = "%s:%d" % (ADDR[0], self.port + 1)
        for r in (1, 2):
            rc, se, elapsed = out[r]
            self.assertEqual(rc, 5, "rank %d: %s" % (r, se))
            self.assertLess(elapsed, TIMEOUT + MARGIN, "rank %d: %s" % (r, se))
            self.assertIn("Rank 0 (host host0, pid", se)
            self.assertIn("which hosted the store, has ended: its host refuses connections to "
                          "the store's port %s" % store, se)
            self.assertNotIn("unreachable from here", se)
            self.assertIn("hint: look at rank 0's log and report (its own error), and, if it has "
                          "none, at the kernel log on host0", se)
            own = load(rank_path(self.json, r))
            self.assertEqual(own["error"]["exit_code"], 5)
            self.assertEqual(own["error"]["peer"], 0)
            self.assertEqual(own["results"]["watchdog"]["diagnosis"]["unreachable_ranks"], [])

    def test_store_host_frozen_on_another_host_is_named_before_the_timeout(self):
        # Rank 0, whose process hosts the store, is stopped on host 0: no
        # connection fails and no heartbeat can be read (they live in the
        # store). Host 0 still accepts connections on the store's port while
        # the store never answers: ranks 1 and 2 must name rank 0 frozen a
        # heartbeat stall (a quarter of --timeout 60: 15 s) after losing the
        # store, not at the timeout, and not blame their own network.
        hosts = [0, 1, 2]

        def stop0(procs):
            procs[0].send_signal(signal.SIGSTOP)
        stop0.takes_procs = True
        out = self.run_and_cut(hosts, stop0, timeout=60, ending=[1, 2])
        store = "%s:%d" % (ADDR[0], self.port + 1)
        self.assertTrue(any("cannot complete: rank 0 (host host0, pid" in out[r][1] for r in (1, 2)),
                        out[1][1] + out[2][1])
        for r in (1, 2):
            rc, se, elapsed = out[r]
            self.assertEqual(rc, 5, "rank %d: %s" % (r, se))
            self.assertLess(elapsed, 50, "rank %d: %s" % (r, se))
            # The rank whose watchdog named it first says so ("cannot
            # complete: rank 0 ... has not answered for"); the other may
            # end on that rank's closed connections first. Both diagnose:
            self.assertIn("Rank 0 (host host0, pid", se)
            self.assertIn("which hosts the store, is frozen: its host accepts connections to the "
                          "store's port %s" % store, se)
            self.assertNotIn("unreachable from here", se)
            self.assertIn("hint: look at rank 0's process (pid", se)
            own = load(rank_path(self.json, r))
            self.assertEqual(own["error"]["peer"], 0)
            self.assertEqual(own["results"]["watchdog"]["diagnosis"]["unreachable_ranks"], [])

    def test_rank_frozen_in_a_point_to_point_op_is_named_before_the_timeout(self):
        # link-health's pair exchanges are send/recv, not collectives: rank 1
        # on host 2 is stopped in the middle of its 256 MiB exchanges with
        # rank 0 (1000 of them: minutes), and rank 0, blocked on its send or
        # recv, must end after 10 s of silence (a quarter of --timeout 40,
        # at least 10 s), not at the timeout.
        hosts = [0, 2]

        def stop1(procs):
            procs[1].send_signal(signal.SIGSTOP)
        stop1.takes_procs = True
        out = self.run_and_cut(hosts, stop1, timeout=40, ending=[0],
                               args=["link-health", "--bytes", "256M", "-n", "1000",
                                     "--rechecks", "0"], settle=10)
        rc, se, elapsed = out[0]
        self.assertEqual(rc, 5, se)
        self.assertLess(elapsed, 30, se)
        self.assertRegex(se, r"point-to-point op (send|recv|sendrecv)\(")
        self.assertIn("cannot complete: rank 1 (pid", se)
        self.assertRegex(se, r"wrote no new heartbeat for 1\d s")
        self.assertIn("Rank 1 did not publish its state: it is silent: no state and no "
                      "heartbeat (host host2, pid", se)
        self.assertIn("hint: look at the process of rank 1 on its host", se)
        rep = load(self.json)
        self.assertEqual(rep["error"]["exit_code"], 5)
        self.assertEqual(rep["error"]["peer"], 1)
        self.assertEqual(rep["results"]["watchdog"]["diagnosis"]["unreachable_ranks"], [])

    def test_host2_link_down_names_it_unreachable(self):
        self.host2_link_down([0, 1, 2])

    def test_host2_with_two_ranks_link_down_names_both(self):
        self.host2_link_down([0, 1, 2, 2])

    def test_store_host_link_down_names_the_store_unreachable(self):
        hosts = [0, 1, 2]
        self.init_check_passes(hosts)
        # The switch side this time: host0's port on the bridge goes down.
        out = self.run_and_cut(hosts, lambda: sh("ip", "-n", SWITCH, "link", "set", SWITCH_END[0],
                                          "down"))
        store = "%s:%d" % (ADDR[0], self.port + 1)
        for r in range(3):
            rc, se, elapsed = out[r]
            self.assertEqual(rc, 5, "rank %d: %s" % (r, se))
            self.assertLess(elapsed, TIMEOUT + MARGIN, "rank %d: %s" % (r, se))
        for r in (1, 2):
            se = out[r][1]
            self.assertIn("The store at %s is unreachable from rank %d" % (store, r), se)
            self.assertIn("hint: this rank can reach neither the store at %s" % store, se)
            own = load(rank_path(self.json, r))
            self.assertEqual(own["error"]["exit_code"], 5)
            wd = own["results"]["watchdog"]
            self.assertFalse(wd["store"]["reachable"])
            self.assertEqual(wd["diagnosis"]["unreachable_ranks"], [q for q in range(3) if q != r])
        se0 = out[0][1]
        for r in (1, 2):
            self.assertIn("Rank %d did not publish its state: it is unreachable" % r, se0)
        rep = load(self.json)
        self.assertEqual(rep["results"]["watchdog"]["diagnosis"]["unreachable_ranks"], [1, 2])
        self.assertTrue(rep["results"]["watchdog"]["store"]["reachable"])


def on_term(_signum, _frame):
    # unittest records SystemExit as a test error and runs on; an interrupt
    # stops the run, through every finally (ranks killed, namespaces removed).
    raise KeyboardInterrupt


if __name__ == "__main__":
    why = netns.usable(TAG, ("ip", "unshare"))
    if why:
        print("SKIP: " + why)
        sys.exit(SKIP)
    signal.signal(signal.SIGTERM, on_term)
    remove_stale()
    try:
        unittest.main(verbosity=2)
    finally:
        teardown()
