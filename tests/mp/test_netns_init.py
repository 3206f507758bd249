"""init-check and the watchdog across hosts, with network namespaces as hosts.

Two namespaces joined by a veth pair (the interface is called ddh0 on both
sides, so every rank passes the same --gloo-interface). Rank 0 lives in the
first and hosts the store, rank 1 in the second. Needs root and `ip netns`;
exits 77 (skipped) otherwise."""
import os
import signal
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(__file__))
from common import BIN, clean_env, load, tmp_json  # noqa: E402
from netns import finish, sh  # noqa: E402
import netns  # noqa: E402

SKIP = 77
TIMEOUT = 5
MARGIN = 12
TAG = "ddh%d" % (os.getpid() % 100000)
NS = [TAG + "a", TAG + "b"]
ADDR = ["10.231.%d.1" % (os.getpid() % 200), "10.231.%d.2" % (os.getpid() % 200)]
IFACE = "ddh0"


def setup():
    for ns in NS:
        sh("ip", "netns", "add", ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
    sh("ip", "link", "add", TAG + "x", "type", "veth", "peer", "name", TAG + "y")
    for ns, dev, addr in zip(NS, (TAG + "x", TAG + "y"), ADDR):
        sh("ip", "link", "set", dev, "netns", ns)
        sh("ip", "-n", ns, "link", "set", dev, "name", IFACE)
        sh("ip", "-n", ns, "addr", "add", addr + "/24", "dev", IFACE)
        sh("ip", "-n", ns, "link", "set", IFACE, "up")


def teardown():
    for ns in NS:
        sh("ip", "netns", "del", ns, check=False)


def start(rank, args, port):
    cmd = ["ip", "netns", "exec", NS[rank], BIN] + args[:1] + [
        "--rank", str(rank), "--world-size", "2", "--master-addr", ADDR[0], "--master-port",
        str(port), "--gloo-interface", IFACE, "--timeout", str(TIMEOUT)] + args[1:]
    return subprocess.Popen(cmd, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


class Netns(unittest.TestCase):
    port = 29611

    def setUp(self):
        setup()
        Netns.port += 1

    def tearDown(self):
        teardown()

    def test_init_check_passes_across_hosts(self):
        path = tmp_json()
        procs = [start(r, ["init-check"] + (["--json", path] if r == 0 else []), self.port)
                 for r in range(2)]
        res = [finish(p, 60) for p in procs]
        for rc, so, se in res:
            self.assertEqual(rc, 0, so + se)
        rep = load(path)
        ranks = rep["results"]["ranks"]
        self.assertIn(ADDR[0], ranks[1]["phases"][1]["detail"])
        self.assertTrue(all(ph["status"] == "ok" for r in ranks for ph in r["phases"]))
        # Where each rank's Gloo listens: the interface it was given, its address.
        for r in range(2):
            init = [ph for ph in ranks[r]["phases"] if ph["name"] == "backend_init"][0]
            self.assertIn("listening on %s %s" % (IFACE, ADDR[r]), init["detail"])
        os.unlink(path)

    def test_host_with_its_link_down_is_named(self):
        sh("ip", "-n", NS[1], "link", "set", IFACE, "down")
        t0 = time.monotonic()
        procs = [start(r, ["init-check"], self.port) for r in range(2)]
        (rc0, so0, se0), (rc1, so1, se1) = [finish(p, TIMEOUT + 60) for p in procs]
        self.assertEqual(rc0, 3, so0 + se0)
        self.assertIn("never arrived: 1", so0)
        self.assertEqual(rc1, 3, se1)
        self.assertRegex(se1, "unreachable|timed out")
        self.assertIn("store_connect", se1)
        self.assertLess(time.monotonic() - t0, TIMEOUT + MARGIN)

    def test_link_down_during_a_run_is_named_within_the_bound(self):
        procs = [start(r, ["allreduce-test", "-b", "1M", "-e", "1M", "-n", "100000", "-w", "1"],
                       self.port) for r in range(2)]
        try:
            t0 = time.monotonic()
            while time.monotonic() - t0 < 60:
                line = procs[0].stdout.readline()
                if not line or (line.startswith("#   ") and "size" in line):
                    break
            time.sleep(0.5)
            sh("ip", "-n", NS[1], "link", "set", IFACE, "down")
            t_down = time.monotonic()
            rc0, _, se0 = finish(procs[0], TIMEOUT + 60)
            elapsed = time.monotonic() - t_down
        finally:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGKILL)
                    p.communicate()
        self.assertIn(rc0, (4, 5), se0)
        self.assertLess(elapsed, TIMEOUT + MARGIN, se0)
        self.assertIn("Rank 1 did not publish its state", se0)


if __name__ == "__main__":
    why = netns.usable(TAG)
    if why:
        print("SKIP: " + why)
        sys.exit(SKIP)
    unittest.main(verbosity=2)
