"""ddpdiag under the real torchrun of torch 2.x, launched across two "hosts" the
way users launch multi-node jobs: one torchrun per host, each starting two
ranks (a world of four), with

- the c10d rendezvous (`--rdzv-backend c10d --rdzv-endpoint host0:port`), in
  which the agents meet in a store hosted by host0's agent and the agent of
  group rank 0 then hosts the store the workers share
  (TORCHELASTIC_USE_AGENT_STORE=True); and
- the static rendezvous (`--node-rank k --master-addr host0 --master-port P`),
  in which node 0's agent hosts the store.

The hosts are network namespaces joined through a bridge (tests/mp/netns.py),
each with its own host name (a UTS namespace) and one interface, which Gloo
is told to use (GLOO_SOCKET_IFNAME). Single-host torchrun runs
(test_launch_torch.py) never exercise what only a multi-node launch does: a
store on another host's address, ranks 2 and 3 told by their agent where the
store is, Gloo's mesh across hosts, and the report naming two hosts.

The c10d form needs two flags there that real clusters may need too:
`--rdzv-conf is_host=1` (0 on host1), because torch decides whether it hosts
the rendezvous store by resolving this machine's host name, which fails or
resolves to loopback in a namespace (and on hosts whose name is not in DNS);
and `--local-addr <this host's address>`, because otherwise the workers are
pointed at the store by the agent's FQDN, here a loopback name that the
other host cannot reach.

Each job must end with exit 0 on both hosts within DEADLINE; rank 0's report
must validate, pass check_report with four ranks, name torchrun as the
launcher and both hosts, give every host two ranks (local ranks 0 and 1,
global rank = group rank * 2 + local rank) and record the agent store and
the interface. Needs root, `ip netns`, unshare and torch.distributed in the
interpreter running this file (sys.executable: torch 2.x); exits 77
(skipped) otherwise. Every process left in the namespaces is killed and the
namespaces are removed on every path, SIGTERM included; what a run killed
with SIGKILL left (namespaces, their processes, its directory) is removed
by the next."""
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "mp"))
from common import BIN, check_report, clean_env, load  # noqa: E402
from netns import BridgedHosts, sh  # noqa: E402
import netns  # noqa: E402

SKIP = 77
PREFIX = "ddt"
TAG = "%s%d" % (PREFIX, os.getpid())  # pid < 2^22: interface names fit in 15
IFACE = "ddt0"
NET = BridgedHosts(TAG, 2, "10.234.%d" % (os.getpid() % 250), IFACE)
HOSTS, ADDR = NET.hosts, NET.addr
NNODES = 2
NPROC = 2
# Every host is a network namespace of its own: no other job holds its ports.
PORT = 29500
# Both torchruns together; a job takes about 4 s here (two cores).
DEADLINE = 120
# ddpdiag's own deadline on every peer, well inside DEADLINE, so that a job
# that cannot meet fails with ddpdiag's diagnosis rather than the test's kill.
RANK_TIMEOUT = 30
TMP_PREFIX = "ddpdiag-torchrun-mn-"
SMALL = ["-b", "8", "-e", "64K", "-f", "8", "-n", "3", "-w", "1"]


def torch_missing():
    """None when sys.executable has torch 2.x with torch.distributed, else why
    not."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError as e:
        return "%s cannot import torch.distributed: %s" % (sys.executable, e)
    if not dist.is_available():
        return "%s has torch %s without torch.distributed" % (sys.executable, torch.__version__)
    if int(torch.__version__.split(".")[0]) < 2:
        return "%s has torch %s; these flags are torch 2.x's" % (sys.executable,
                                                                 torch.__version__)
    return None


def kill_in(ns):
    """SIGKILLs every process in network namespace ns: the torchrun agent and
    its workers, which run in sessions of their own."""
    for pid in sh("ip", "netns", "pids", ns, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def remove_stale():
    """Namespaces (and their processes) and directories of earlier runs whose
    test is gone (killed)."""
    listing = sh("ip", "netns", "list", check=False).stdout
    for line in listing.splitlines():
        m = re.match(r"^(%s(\d+)(?:h\d|sw|probe))\b" % PREFIX, line)
        if m and not os.path.exists("/proc/%s" % m.group(2)):
            kill_in(m.group(1))
            sh("ip", "netns", "del", m.group(1), check=False)
    for d in glob.glob(os.path.join(tempfile.gettempdir(), TMP_PREFIX + "*-*")):
        pid = os.path.basename(d)[len(TMP_PREFIX):].split("-")[0]
        if pid.isdigit() and not os.path.exists("/proc/" + pid):
            shutil.rmtree(d, ignore_errors=True)


def on_sigterm(signum, frame):
    """A test runner that gives up on this test (SIGTERM) gets no torchrun,
    rank or namespace left behind."""
    for ns in HOSTS:
        kill_in(ns)
    NET.teardown()
    for d in glob.glob(os.path.join(tempfile.gettempdir(), "%s%d-*" % (TMP_PREFIX, os.getpid()))):
        shutil.rmtree(d, ignore_errors=True)
    os._exit(128 + signum)


class TorchrunAcrossHosts(unittest.TestCase):
    def setUp(self):
        self.procs = []
        self.tmp = tempfile.mkdtemp(prefix="%s%d-" % (TMP_PREFIX, os.getpid()))
        # Cleanups run even when setUp fails half-way, in reverse order.
        self.addCleanup(shutil.rmtree, self.tmp, ignore_errors=True)
        self.addCleanup(NET.teardown)
        self.addCleanup(self.kill_all)
        remove_stale()
        NET.teardown()
        NET.setup()

    def kill_all(self):
        for ns in HOSTS:
            kill_in(ns)
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()

    def output(self, h):
        with open(os.path.join(self.tmp, "host%d.log" % h), errors="replace") as f:
            return f.read()

    def outputs(self):
        return "".join("\n--- torchrun on host%d ---\n%s" % (h, self.output(h))
                       for h in range(NNODES))

    def run_job(self, node_flags):
        """Runs torchrun on every host with node_flags(h) and waits for both;
        returns rank 0's report. torchrun's temporary files (its log
        directories) go to the test's own directory (TMPDIR)."""
        path = os.path.join(self.tmp, "report.json")
        env = clean_env(GLOO_SOCKET_IFNAME=IFACE, TMPDIR=self.tmp)
        t0 = time.monotonic()
        for h in range(NNODES):
            inner = ([sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NNODES),
                      "--nproc-per-node", str(NPROC)] + node_flags(h) +
                     ["--no-python", BIN, "allreduce-test", "--json", path, "--timeout",
                      str(RANK_TIMEOUT)] + SMALL)
            with open(os.path.join(self.tmp, "host%d.log" % h), "w") as log:
                self.procs.append(subprocess.Popen(NET.command(h, inner), env=env,
                                                   stdout=log, stderr=subprocess.STDOUT,
                                                   stdin=subprocess.DEVNULL))
        for p in self.procs:
            try:
                p.wait(timeout=max(1.0, DEADLINE - (time.monotonic() - t0)))
            except subprocess.TimeoutExpired:
                self.kill_all()
                self.fail("torchrun did not end on both hosts within %d s:%s" %
                          (DEADLINE, self.outputs()))
        for h, p in enumerate(self.procs):
            self.assertEqual(p.returncode, 0, "torchrun on host%d:%s" % (h, self.outputs()))
        self.assertTrue(os.path.exists(path), "no report from rank 0:" + self.outputs())
        return load(path)

    def check_world(self, rep):
        """What every multi-node torchrun job must show; returns the index of
        the host that ran rank 0."""
        check_report(self, rep, NNODES * NPROC)
        world = rep["world"]
        self.assertEqual(world["launcher"], "torchrun")
        self.assertEqual(sorted(world["hosts"]), ["host%d" % h for h in range(NNODES)])
        by_host = {}
        for r in world["ranks"]:
            self.assertIn(r["local_rank"], range(NPROC), r)
            by_host.setdefault(r["host"], []).append(r)
        # torchrun gives group rank g the global ranks g * nproc + local rank.
        for host, ranks in by_host.items():
            self.assertEqual(sorted(r["local_rank"] for r in ranks), list(range(NPROC)), host)
            group = min(r["rank"] for r in ranks) // NPROC
            for r in ranks:
                self.assertEqual(r["rank"], group * NPROC + r["local_rank"], ranks)
        env = rep["environment"]
        self.assertEqual(env.get("TORCHELASTIC_USE_AGENT_STORE"), "True", env)
        self.assertEqual(env.get("GLOO_SOCKET_IFNAME"), IFACE, env)
        self.assertEqual(env.get("GROUP_WORLD_SIZE"), str(NNODES), env)
        host0 = [r["host"] for r in world["ranks"] if r["rank"] == 0][0]
        first = int(host0[len("host"):])
        # The store the workers share is on rank 0's host, at its address
        # (not a loopback name the other host would resolve to itself).
        self.assertEqual(env.get("MASTER_ADDR"), ADDR[first], env)
        self.assertIn("Verdict: PASS", self.output(first))
        return first

    def test_c10d_rendezvous(self):
        run_id = "ddpdiag-%s" % TAG

        def flags(h):
            return ["--rdzv-backend", "c10d", "--rdzv-endpoint", "%s:%d" % (ADDR[0], PORT),
                    "--rdzv-id", run_id, "--rdzv-conf", "is_host=%d" % (h == 0),
                    "--local-addr", ADDR[h]]

        rep = self.run_job(flags)
        self.check_world(rep)
        # The workers use the store the agent of group rank 0 started for
        # them on a port of its own, not the rendezvous endpoint.
        self.assertNotEqual(rep["environment"].get("MASTER_PORT"), str(PORT))

    def test_static_rendezvous(self):
        def flags(h):
            return ["--node-rank", str(h), "--master-addr", ADDR[0], "--master-port", str(PORT)]

        rep = self.run_job(flags)
        # Node rank 0 (host0) hosts the store and runs global ranks 0 and 1.
        self.assertEqual(self.check_world(rep), 0)
        self.assertEqual(rep["environment"].get("MASTER_PORT"), str(PORT))


if __name__ == "__main__":
    why = netns.usable(TAG, ("ip", "unshare")) or torch_missing()
    if why:
        print("SKIP: " + why)
        sys.exit(SKIP)
    signal.signal(signal.SIGTERM, on_sigterm)
    unittest.main(verbosity=2)
