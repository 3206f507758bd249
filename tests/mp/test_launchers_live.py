"""ddpdiag under the real launchers it names, and where its ranks may run.

- CPU placement: every Gloo rank's allowed CPUs are in results.rank_cpus;
  ranks squeezed onto fewer CPUs than ranks (taskset) get the
  cpu_oversubscribed warning on stderr, beside the verdict and in the
  report; ranks with CPUs to spare get none. The verdict stays PASS.
- Ranks that report different backend library versions (a test variable
  stands in for a host with another Gloo or NCCL) get the
  library_version_mismatch warning, printed before the backend starts.
- A loopback store address (localhost) in a job that spans hosts: the
  error names it and torchrun's --local-addr instead of "start rank 0".
- Open MPI's mpirun (Debian's openmpi-bin, installed by
  scripts/install-deps.sh): ranks and size come from the variables mpirun
  really sets, the report names the launcher; mpirun's default binding (one
  core per rank) gets the cpu_single warning, --bind-to none does not.
  Skipped, with the reason, where mpirun is not installed.
- Slurm's srun (Debian's slurm-wlm 22.05, installed by
  scripts/install-deps.sh): the test starts a throw-away one-node cluster
  of its own (slurmctld and slurmd as root, its own configuration file,
  ports and state directory, no munge: auth/none), runs ddpdiag under srun
  at 2 and 4 tasks, with --cpu-bind=cores (cpu_single), and a job whose
  rank 1 is killed: rank 0 names it dead within its timeout instead of
  hanging. Skipped where slurmctld is not
  installed or the test does not run as root.
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (BIN, DEADLINE_S, check_report, clean_env, free_port, load,  # noqa: E402
                    run_ranks)

CPUS = sorted(os.sched_getaffinity(0))
MPIRUN = shutil.which("mpirun")
MPIRUN_MPICH = shutil.which("mpirun.mpich")  # Debian's mpich: MPICH's Hydra, beside Open MPI
MPIRUN_OMPI = shutil.which("mpirun.openmpi")  # Open MPI by its own name
SLURMCTLD = shutil.which("slurmctld") or (os.path.exists("/usr/sbin/slurmctld") and "/usr/sbin/slurmctld")
SLURMD = shutil.which("slurmd") or (os.path.exists("/usr/sbin/slurmd") and "/usr/sbin/slurmd")
SRUN = shutil.which("srun")
SWEEP = ["-b", "4", "-e", "64K", "-f", "16", "-n", "5", "-w", "2"]


def cpu_list(cpus):
    """Our format: ascending, runs as a-b, comma-separated."""
    cpus = sorted(set(cpus))
    out, i = [], 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        out.append(str(cpus[i]) if i == j else "%d-%d" % (cpus[i], cpus[j]))
        i = j + 1
    return ",".join(out)


class Case(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="ddpdiag-launchers-")

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def run_cmd(self, cmd, env=None):
        p = subprocess.run(cmd, env=env or clean_env(), capture_output=True, text=True,
                           timeout=DEADLINE_S)
        return p

    def passed(self, p, report_path, world_size):
        self.assertEqual(p.returncode, 0, p.stdout[-3000:] + p.stderr[-3000:])
        self.assertIn("# Verdict: PASS", p.stdout)
        rep = load(report_path)
        check_report(self, rep, world_size)
        rows = rep["results"]["rank_cpus"]
        self.assertEqual(sorted(r["rank"] for r in rows), list(range(world_size)))
        for r in rows:
            self.assertEqual(r["cpu_count"], len(expand(r["cpus"])), r)
        return rep

    def warning_names(self, rep):
        return [w["name"] for w in rep["results"].get("warnings", [])]


def expand(s):
    out = []
    for part in s.split(",") if s else []:
        a, _, b = part.partition("-")
        out.extend(range(int(a), int(b or a) + 1))
    return out


class Placement(Case):
    def test_ranks_with_cpus_to_spare_get_no_warning(self):
        if len(CPUS) < 2:
            self.skipTest("this process may use %d CPU; two ranks need two" % len(CPUS))
        path = os.path.join(self.tmp, "r.json")
        p = self.run_cmd([BIN, "allreduce-test", "--nproc", "2", "--json", path] + SWEEP)
        rep = self.passed(p, path, 2)
        for r in rep["results"]["rank_cpus"]:
            self.assertEqual(r["cpus"], cpu_list(CPUS))
        self.assertEqual(self.warning_names(rep), [])
        self.assertNotIn("ddpdiag: warning", p.stderr)
        # The rank line ends with the interface Gloo listens on; one host: no
        # network warning, whatever its speed.
        self.assertRegex(p.stdout, r"#  Rank +0 Pid +\d+ on .* cpus %s net \S+ [0-9a-f.:]+( \(.*\))?\n"
                         % cpu_list(CPUS))
        for r in rep["results"]["rank_network"]:
            self.assertTrue(r["interface"] and r["address"], r)

    def test_two_ranks_on_one_cpu_are_oversubscribed(self):
        path = os.path.join(self.tmp, "r.json")
        one = str(CPUS[0])
        p = self.run_cmd(["taskset", "-c", one, BIN, "allreduce-test", "--nproc", "2", "--json",
                          path] + SWEEP)
        rep = self.passed(p, path, 2)
        for r in rep["results"]["rank_cpus"]:
            self.assertEqual((r["cpus"], r["cpu_count"]), (one, 1))
        self.assertEqual(self.warning_names(rep), ["cpu_oversubscribed"])
        detail = rep["results"]["warnings"][0]["detail"]
        self.assertIn("runs 2 ranks on 1 CPU (%s)" % one, detail)
        # On rank 0's stderr once (the launcher prefixes the rank), and beside
        # the verdict.
        self.assertEqual(p.stderr.count("ddpdiag: warning: more Gloo ranks than CPUs"), 1,
                         p.stderr)
        self.assertIn("# Warning cpu_oversubscribed", p.stdout)

    def test_slow_links_on_shared_cpus_point_at_the_warning(self):
        # Every pair is "slow" below an absolute 1000 GB/s. On one CPU the
        # links check says the ranks share too few CPUs; on their own CPUs
        # it does not.
        args = [BIN, "link-health", "--nproc", "2", "--min-bw-gbps", "1000", "-n", "2",
                "--latency-iters", "3", "--allreduce-iters", "1", "--json"]
        runs = [(["taskset", "-c", str(CPUS[0])], True)]
        if len(CPUS) >= 2:
            runs.append(([], False))
        for prefix, shared in runs:
            path = os.path.join(self.tmp, "lh.json")
            p = self.run_cmd(prefix + args + [path])
            self.assertEqual(p.returncode, 1, p.stdout[-3000:] + p.stderr[-3000:])
            rep = load(path)
            links = [c for c in rep["checks"] if c["name"] == "links"][0]
            self.assertEqual(links["status"], "fail")
            self.assertIn("0-1", links["detail"])
            self.assertEqual("warning cpu_oversubscribed" in links["detail"], shared,
                             links["detail"])

    def test_init_check_reports_the_placement_too(self):
        path = os.path.join(self.tmp, "r.json")
        p = self.run_cmd(["taskset", "-c", str(CPUS[0]), BIN, "init-check", "--nproc", "2",
                          "--json", path])
        self.assertEqual(p.returncode, 0, p.stdout[-3000:] + p.stderr[-3000:])
        rep = load(path)
        self.assertEqual(self.warning_names(rep), ["cpu_oversubscribed"])
        self.assertIn("# Warning cpu_oversubscribed", p.stdout)


class VersionSkew(Case):
    def test_a_rank_with_another_library_version_is_named(self):
        port = free_port()
        path = os.path.join(self.tmp, "r.json")
        envs = [clean_env(RANK=r, WORLD_SIZE=3, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
                for r in range(3)]
        envs[2]["DDPDIAG_TEST_LIBRARY_VERSION"] = "gloo 0.4.3"
        res = run_ranks([["allreduce-test", "--json", path] + SWEEP] * 3, envs)
        for rc, so, se, _ in res:
            self.assertEqual(rc, 0, se)
        rep = load(path)
        check_report(self, rep, 3)
        self.assertIn("library_version_mismatch", self.warning_names(rep))
        detail = [w for w in rep["results"]["warnings"]
                  if w["name"] == "library_version_mismatch"][0]["detail"]
        self.assertRegex(detail, r"different gloo libraries: gloo [0-9.]+ on ranks 0-1; "
                                 r"gloo 0\.4\.3 on rank 2")
        # Rank 0 alone prints it.
        self.assertIn("ddpdiag: warning: the ranks run different gloo libraries", res[0][2])
        self.assertNotIn("ddpdiag: warning", res[1][2] + res[2][2])


class LoopbackStoreAcrossHosts(Case):
    """A store address of localhost in a job that spans hosts (LOCAL_WORLD_SIZE
    below WORLD_SIZE), as torchrun's c10d rendezvous hands out on machines
    whose name resolves to localhost: the error says so, not "start rank 0"."""

    def env(self, rank, port):
        return clean_env(RANK=rank, WORLD_SIZE=2, LOCAL_RANK=0, LOCAL_WORLD_SIZE=1,
                         MASTER_ADDR="localhost", MASTER_PORT=port)

    def test_client_rank_names_the_loopback_address(self):
        p = self.run_cmd([BIN, "allreduce-test", "--timeout", "2"] + SWEEP,
                         self.env(1, free_port()))
        self.assertEqual(p.returncode, 3, p.stderr)
        self.assertIn("connection refused", p.stderr)
        self.assertIn("MASTER_ADDR=localhost is a loopback address, but this job spans several "
                      "hosts (2 ranks, 1 on this one)", p.stderr)
        self.assertIn("--local-addr", p.stderr)

    def test_rank0_waiting_alone_names_it_too(self):
        p = self.run_cmd([BIN, "allreduce-test", "--timeout", "2"] + SWEEP,
                         self.env(0, free_port()))
        self.assertEqual(p.returncode, 3, p.stderr)
        self.assertIn("rank(s) that never arrived: 1", p.stderr)
        self.assertIn("is a loopback address", p.stderr)

    def test_one_host_keeps_the_usual_hint(self):
        env = clean_env(RANK=1, WORLD_SIZE=2, MASTER_ADDR="localhost", MASTER_PORT=free_port())
        p = self.run_cmd([BIN, "allreduce-test", "--timeout", "2"] + SWEEP, env)
        self.assertEqual(p.returncode, 3, p.stderr)
        self.assertNotIn("loopback", p.stderr)
        self.assertIn("start rank 0", p.stderr)


@unittest.skipUnless(MPIRUN, "mpirun not found (Debian: apt-get install openmpi-bin)")
class OpenMpi(Case):
    def mpirun(self, np, binding, path, extra=()):
        env = clean_env()
        if os.geteuid() == 0:  # Open MPI refuses root without both
            env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        cmd = [MPIRUN, "-np", str(np), "--bind-to", binding] + list(extra) + [
            "-x", "MASTER_ADDR=127.0.0.1", "-x", "MASTER_PORT=%d" % free_port(),
            BIN, "allreduce-test", "--json", path] + SWEEP
        return self.run_cmd(cmd, env)

    def test_mpirun_default_binding_warns_cpu_single(self):
        if len(CPUS) < 2:
            self.skipTest("mpirun binds two ranks to two cores; this machine has %d" % len(CPUS))
        path = os.path.join(self.tmp, "r.json")
        p = self.mpirun(2, "core", path)
        rep = self.passed(p, path, 2)
        self.assertEqual(rep["world"]["launcher"], "openmpi")
        self.assertEqual(rep["environment"].get("OMPI_COMM_WORLD_SIZE"), "2")
        rows = rep["results"]["rank_cpus"]
        self.assertEqual([r["cpu_count"] for r in rows], [1, 1], rows)
        self.assertNotEqual(rows[0]["cpus"], rows[1]["cpus"], rows)
        self.assertEqual(self.warning_names(rep), ["cpu_single"])
        self.assertIn("ranks 0-1 may each use one CPU only", rep["results"]["warnings"][0]["detail"])
        self.assertIn("--bind-to none", rep["results"]["warnings"][0]["detail"])

    def test_mpirun_bind_to_none_is_clean(self):
        if len(CPUS) < 2:
            self.skipTest("two ranks need two CPUs; this machine has %d" % len(CPUS))
        path = os.path.join(self.tmp, "r.json")
        p = self.mpirun(2, "none", path)
        rep = self.passed(p, path, 2)
        self.assertEqual(rep["world"]["launcher"], "openmpi")
        self.assertEqual(self.warning_names(rep), [])

    def test_mpirun_more_ranks_than_cpus(self):
        np = len(CPUS) + 1
        if np > 4:
            self.skipTest("%d ranks are too many for a quick test" % np)
        path = os.path.join(self.tmp, "r.json")
        p = self.mpirun(np, "none", path, ["--oversubscribe"])
        rep = self.passed(p, path, np)
        self.assertEqual(self.warning_names(rep), ["cpu_oversubscribed"])



@unittest.skipUnless(MPIRUN_MPICH, "mpirun.mpich not found (Debian: apt-get install mpich)")
class Mpich(Case):
    def test_hydra_mpirun_two_ranks(self):
        # MPICH's Hydra gives PMI_RANK, PMI_SIZE, MPI_LOCALRANKID and
        # MPI_LOCALNRANKS (as Intel MPI's does), and passes MASTER_* with -genv.
        path = os.path.join(self.tmp, "r.json")
        p = self.run_cmd([MPIRUN_MPICH, "-n", "2", "-genv", "MASTER_ADDR", "127.0.0.1", "-genv",
                          "MASTER_PORT", str(free_port()), BIN, "allreduce-test", "--json", path] + SWEEP,
                         clean_env())
        rep = self.passed(p, path, 2)
        self.assertEqual(rep["world"]["launcher"], "mpich")
        self.assertEqual(rep["environment"].get("PMI_SIZE"), "2")
        self.assertEqual(sorted(r["local_rank"] for r in rep["world"]["ranks"]), [0, 1])


class SlurmCluster:
    """A one-node Slurm cluster for one test class: slurmctld and slurmd on
    this machine, configured through a file of our own (SLURM_CONF), on free
    ports, with auth/none (no munge daemon). The node advertises 16 CPUs
    (config_overrides) so that srun may start more tasks than this machine
    has cores, as a test of oversubscribed ranks needs."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="ddpdiag-slurm-")
        self.conf = os.path.join(self.dir, "slurm.conf")
        self.env = dict(os.environ, SLURM_CONF=self.conf)
        host = socket.gethostname().split(".")[0]
        mem = 1024
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem = int(int(line.split()[1]) / 1024 * 0.9)
        ports = []
        while len(ports) < 2:
            p = free_port()
            if p not in ports:
                ports.append(p)
        d = self.dir
        with open(self.conf, "w") as f:
            f.write("\n".join([
                "ClusterName=ddpdiagtest",
                "SlurmctldHost=%s(127.0.0.1)" % host,
                "SlurmctldPort=%d" % ports[0],
                "SlurmdPort=%d" % ports[1],
                "SlurmUser=root",
                "AuthType=auth/none",
                "CredType=cred/none",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/affinity",  # srun --cpu-bind works (sched_setaffinity)
                "JobAcctGatherType=jobacct_gather/none",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_CPU",
                "SlurmdParameters=config_overrides",
                "ReturnToService=2",
                "EnforcePartLimits=ALL",
                "MpiDefault=none",
                "KillWait=2",
                "StateSaveLocation=%s/ctld" % d,
                "SlurmdSpoolDir=%s/d" % d,
                "SlurmctldPidFile=%s/slurmctld.pid" % d,
                "SlurmdPidFile=%s/slurmd.pid" % d,
                "SlurmctldLogFile=%s/slurmctld.log" % d,
                "SlurmdLogFile=%s/slurmd.log" % d,
                "NodeName=%s NodeAddr=127.0.0.1 CPUs=16 RealMemory=%d State=UNKNOWN" % (host, mem),
                "PartitionName=debug Nodes=%s Default=YES MaxTime=INFINITE State=UP" % host,
            ]) + "\n")
        os.makedirs(os.path.join(d, "ctld"))
        os.makedirs(os.path.join(d, "d"))
        try:
            # Both fork into the background and write their pid files.
            subprocess.run([SLURMCTLD, "-i", "-f", self.conf], env=self.env, check=True,
                           timeout=30, capture_output=True)
            subprocess.run([SLURMD, "-f", self.conf], env=self.env, check=True, timeout=30,
                           capture_output=True)
            deadline = time.monotonic() + 30
            while True:
                p = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], env=self.env,
                                   capture_output=True, text=True, timeout=10)
                if p.stdout.strip() == "idle":
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError("the test's Slurm node did not become idle in 30 s "
                                       "(sinfo: %r); logs in %s" % (p.stdout + p.stderr, d))
                time.sleep(0.2)
        except BaseException:
            self.stop()
            raise

    def pids(self):
        out = []
        for name in ("slurmd.pid", "slurmctld.pid"):
            try:
                with open(os.path.join(self.dir, name)) as f:
                    out.append(int(f.read().strip()))
            except (OSError, ValueError):
                pass
        return out

    def stop(self):
        subprocess.run(["scancel", "--user", "root"], env=self.env, capture_output=True,
                       timeout=10)
        pids = self.pids()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        for pid in pids:
            while time.monotonic() < deadline:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
            else:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        shutil.rmtree(self.dir, ignore_errors=True)

    def srun(self, ntasks, args, extra_env=None, timeout=DEADLINE_S, cpu_bind="none"):
        """cpu_bind: srun's --cpu-bind; "none" unless a test is about binding
        (the node advertises more CPUs than this machine has, so Slurm's own
        choice of binding could name CPUs that do not exist)."""
        env = clean_env(SLURM_CONF=self.conf, **(extra_env or {}))
        t0 = time.monotonic()
        p = subprocess.run([SRUN, "-Q", "-n", str(ntasks), "--cpu-bind=" + cpu_bind, BIN] +
                           list(args), env=env, capture_output=True, text=True, timeout=timeout)
        p.elapsed = time.monotonic() - t0
        return p


@unittest.skipUnless(SLURMCTLD and SLURMD and SRUN,
                     "Slurm not installed (Debian: apt-get install slurm-wlm)")
@unittest.skipUnless(os.geteuid() == 0, "a throw-away Slurm cluster needs root (slurmd)")
class Slurm(Case):
    @classmethod
    def setUpClass(cls):
        cls.cluster = SlurmCluster()

    @classmethod
    def tearDownClass(cls):
        cls.cluster.stop()

    def test_srun_two_tasks(self):
        path = os.path.join(self.tmp, "r.json")
        p = self.cluster.srun(2, ["allreduce-test", "--json", path] + SWEEP,
                              {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": free_port()})
        rep = self.passed(p, path, 2)
        self.assertEqual(rep["world"]["launcher"], "slurm")
        self.assertEqual(rep["environment"].get("SLURM_NTASKS"), "2")
        self.assertEqual(sorted(r["local_rank"] for r in rep["world"]["ranks"]), [0, 1])

    def test_srun_cpu_bind_cores_warns_cpu_single(self):
        if len(CPUS) < 2:
            self.skipTest("binding two tasks to two cores needs two CPUs; there are %d" % len(CPUS))
        path = os.path.join(self.tmp, "r.json")
        p = self.cluster.srun(2, ["allreduce-test", "--json", path] + SWEEP,
                              {"MASTER_PORT": free_port()}, cpu_bind="cores")
        rep = self.passed(p, path, 2)
        rows = rep["results"]["rank_cpus"]
        self.assertEqual([r["cpu_count"] for r in rows], [1, 1], rows)
        self.assertEqual(self.warning_names(rep), ["cpu_single"])
        self.assertIn("srun --cpu-bind=none", rep["results"]["warnings"][0]["detail"])

    def test_srun_four_tasks(self):
        path = os.path.join(self.tmp, "r.json")
        # No MASTER_ADDR: one node, so 127.0.0.1 (the port is still ours).
        p = self.cluster.srun(4, ["allreduce-test", "--json", path] + SWEEP,
                              {"MASTER_PORT": free_port()})
        rep = self.passed(p, path, 4)
        self.assertEqual(rep["world"]["launcher"], "slurm")
        want = ["cpu_oversubscribed"] if len(CPUS) < 4 else []
        self.assertEqual(self.warning_names(rep), want)

    def test_a_batch_script_runs_ddpdiag_and_mpirun_in_its_allocation(self):
        # sbatch -n 2: the script's shell has SLURM_PROCID=0 and
        # SLURM_NTASKS=2 but is no task srun started. ddpdiag run there starts
        # its own 2 local ranks (before, it waited as rank 0 of 2 for a rank 1
        # that never came), and mpirun's ranks, which inherit the shell's
        # SLURM_PROCID=0, take Open MPI's ranks (before, both were rank 0).
        script = os.path.join(self.tmp, "job.sh")
        out = os.path.join(self.tmp, "out.txt")
        own, mpi = os.path.join(self.tmp, "own.json"), os.path.join(self.tmp, "mpi.json")
        lines = ["#!/bin/bash",
                 "env | grep -c '^SLURM_STEP_ID=' ; echo steps-listed",
                 "%s allreduce-test --timeout 20 --json %s %s; echo own-rc=$?" % (
                     BIN, own, " ".join(SWEEP))]
        if MPIRUN_OMPI:
            lines.append("%s --allow-run-as-root --oversubscribe --bind-to none -np 2 -x "
                         "MASTER_PORT=%d %s allreduce-test --timeout 20 --json %s %s; "
                         "echo mpi-rc=$?" % (MPIRUN_OMPI, free_port(), BIN, mpi, " ".join(SWEEP)))
        with open(script, "w") as f:
            f.write("\n".join(lines) + "\n")
        os.chmod(script, 0o755)
        p = subprocess.run(["sbatch", "-Q", "-n", "2", "-o", out, "--wait", script],
                           env=clean_env(SLURM_CONF=self.cluster.conf), capture_output=True,
                           text=True, timeout=DEADLINE_S)
        with open(out) as f:
            text = f.read()
        self.assertEqual(p.returncode, 0, p.stderr + text[-3000:])
        self.assertIn("0\nsteps-listed", text)  # the shell has no SLURM_STEP_ID
        self.assertIn("own-rc=0", text, text[-3000:])
        self.assertIn("this shell is not a task srun started", text)
        rep = load(own)
        self.assertEqual(rep["world"]["launcher"], "ddpdiag")
        self.assertEqual(rep["world"]["size"], 2)
        if MPIRUN_OMPI:
            self.assertIn("mpi-rc=0", text, text[-3000:])
            rep = load(mpi)
            self.assertEqual(rep["world"]["launcher"], "openmpi")
            self.assertEqual(sorted(r["rank"] for r in rep["world"]["ranks"]), [0, 1])

    def test_srun_killed_task_is_named_not_waited_for(self):
        timeout = 6
        path = os.path.join(self.tmp, "r.json")
        p = self.cluster.srun(2, ["allreduce-test", "--timeout", str(timeout), "--json", path,
                                  "--inject-fault", "exit@seq=6,rank=1", "-b", "1K", "-e", "1K",
                                  "-n", "20", "-w", "1"],
                              {"MASTER_PORT": free_port()}, timeout=timeout + 60)
        self.assertNotEqual(p.returncode, 0)
        self.assertLess(p.elapsed, timeout + 15, p.stderr[-3000:])
        self.assertIn("Rank 1 did not publish its state: it is dead", p.stderr)
        rep = load(path)
        self.assertEqual(rep["verdict"], "ERROR")
        self.assertEqual(rep["error"]["exit_code"], 5)
        self.assertEqual(rep["error"]["peer"], 1)
        self.assertEqual(rep["results"]["watchdog"]["diagnosis"]["gone_ranks"], [1])


if __name__ == "__main__":
    unittest.main(verbosity=2)
