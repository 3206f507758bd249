"""The benchmark programs of build/bench/ as a script runs them:
ddpdiag_bench_device on a machine without a GPU says "no GPU" and exits 77
(skipped), not 1 (failed) nor a crash; ddpdiag_bench_allreduce_overhead,
which forks its two ranks, has only rank 0 write the --benchmark_out file
(both ranks opening one path let rank 1's figures end up in it).

The programs: DDPDIAG_BENCH_DEVICE and DDPDIAG_BENCH_OVERHEAD, else
bench/ beside the folder of DDPDIAG_BIN (build/diag/ddpdiag ->
build/bench/). A program not built is skipped."""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(__file__))
from common import BIN, clean_env, main  # noqa: E402

BENCH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(BIN))), "bench")
DEVICE = os.environ.get("DDPDIAG_BENCH_DEVICE", os.path.join(BENCH_DIR, "ddpdiag_bench_device"))
OVERHEAD = os.environ.get("DDPDIAG_BENCH_OVERHEAD",
                          os.path.join(BENCH_DIR, "ddpdiag_bench_allreduce_overhead"))


def has_gpu():
    smi = shutil.which("nvidia-smi")
    if not smi:
        return False
    try:
        p = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return p.returncode == 0 and "GPU" in p.stdout


class BenchPrograms(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="ddpdiag-bench-test-")

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    @unittest.skipUnless(os.access(DEVICE, os.X_OK), "ddpdiag_bench_device is not built (no CUDA)")
    @unittest.skipIf(has_gpu(), "this machine has a GPU (scripts/gpu-check.sh runs the program)")
    def test_device_bench_without_a_gpu_says_so_and_exits_77(self):
        out = os.path.join(self.dir, "device.json")
        p = subprocess.run([DEVICE, "--json", out], capture_output=True, text=True, timeout=120,
                           env=clean_env())
        self.assertEqual(p.returncode, 77, p.stdout + p.stderr)
        self.assertRegex(p.stderr, r"^ddpdiag_bench_device: no GPU \(.+\); nothing measured\n$")
        self.assertEqual(p.stdout, "")
        with open(out) as f:
            doc = json.load(f)
        self.assertEqual(list(doc), ["no_gpu"])
        self.assertTrue(doc["no_gpu"])
        # A bad flag is a usage error (2), told apart from no GPU, and so is
        # a --json FILE that cannot be written.
        p = subprocess.run([DEVICE, "--bogus"], capture_output=True, text=True, timeout=120)
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        self.assertIn("unknown flag --bogus", p.stderr)
        p = subprocess.run([DEVICE, "--json", os.path.join(self.dir, "no", "such", "dir.json")],
                           capture_output=True, text=True, timeout=120, env=clean_env())
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        self.assertIn("failed", p.stderr)

    @unittest.skipUnless(os.access(OVERHEAD, os.X_OK), "ddpdiag_bench_allreduce_overhead is not built")
    @unittest.skipUnless(shutil.which("strace"), "no strace to see which rank opens the file")
    def test_only_rank_0_writes_the_benchmark_out_file(self):
        out = os.path.join(self.dir, "out.json")
        # As a flag, and as Google Benchmark's environment variable.
        for how, args, env in (("flag", ["--benchmark_out=" + out], {}),
                               ("environment", [], {"BENCHMARK_OUT": out})):
            with self.subTest(how=how):
                trace = os.path.join(self.dir, "trace-" + how)
                p = subprocess.run(["strace", "-f", "-qq", "-e", "trace=openat,open,creat", "-o", trace,
                                    OVERHEAD, "--benchmark_filter=^paired/4/"] + args,
                                   capture_output=True, text=True, timeout=300,
                                   env=clean_env(**env))
                if p.returncode != 0 and "ptrace" in p.stderr:
                    self.skipTest("strace cannot trace here: " + p.stderr.strip())
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                openers = set()
                with open(trace) as f:
                    for line in f:
                        if '"%s"' % out in line and re.search(r"O_WRONLY|O_RDWR|creat\(", line):
                            openers.add(line.split()[0])
                self.assertEqual(len(openers), 1, "processes that opened %s: %s" % (out, openers))
                with open(out) as f:
                    doc = json.load(f)
                self.assertEqual([b["name"] for b in doc["benchmarks"]],
                                 ["paired/4/iterations:21/manual_time"])
                os.unlink(out)


if __name__ == "__main__":
    main()
