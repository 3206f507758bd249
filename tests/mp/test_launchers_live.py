"""ddpdiag under the real launchers it names, and where its ranks may run.

- CPU placement: every Gloo rank's allowed CPUs are in results.rank_cpus;
  ranks squeezed onto fewer CPUs than ranks (taskset) get the
  cpu_oversubscribed warning on stderr, beside the verdict and in the
  report; ranks with CPUs to spare get none. The verdict stays PASS.
- Open MPI's mpirun (Debian's openmpi-bin, installed by
  scripts/install-deps.sh): ranks and size come from the variables mpirun
  really sets, the report names the launcher; mpirun's default binding (one
  core per rank) gets the cpu_single warning, --bind-to none does not.
  Skipped, with the reason, where mpirun is not installed.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import BIN, DEADLINE_S, check_report, clean_env, free_port, load  # noqa: E402

CPUS = sorted(os.sched_getaffinity(0))
MPIRUN = shutil.which("mpirun")
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
        self.assertRegex(p.stdout, r"#  Rank +0 Pid +\d+ on .* cpus %s\n" % cpu_list(CPUS))

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

    def test_init_check_reports_the_placement_too(self):
        path = os.path.join(self.tmp, "r.json")
        p = self.run_cmd(["taskset", "-c", str(CPUS[0]), BIN, "init-check", "--nproc", "2",
                          "--json", path])
        self.assertEqual(p.returncode, 0, p.stdout[-3000:] + p.stderr[-3000:])
        rep = load(path)
        self.assertEqual(self.warning_names(rep), ["cpu_oversubscribed"])


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


if __name__ == "__main__":
    unittest.main(verbosity=2)
