"""The diagnostic tools through the built-in launcher at 2, 3 and 4 Gloo
ranks: bucket-sweep, dp-vs-ring, memory and link-health. Every report is
parsed (and validated against the schema by common.load); the figures that
must be exact are checked exactly: bucket counts against `ddpdiag buckets`,
dp-vs-ring bytes against theory, memory categories against the totals, the
link-health matrix n x n and complete. Sizes are kept small: with 4 ranks on
2 cores each small message costs a scheduler tick."""
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.dirname(__file__))
from common import (BIN, SANITIZED, clean_env, free_port, load, main, run, run_ranks,  # noqa: E402
                    tmp_json, WORLDS)



def tool(testcase, args, n, expect_rc=(0,)):
    path = tmp_json()
    p = run(args + ["--nproc", str(n), "--json", path])
    testcase.assertIn(p.returncode, expect_rc, p.stdout + p.stderr)
    rep = load(path)
    os.unlink(path)
    testcase.assertEqual(rep["world"]["size"], n)
    testcase.assertEqual(rep["command"], args[0])
    return p, rep


class ErrorReports(unittest.TestCase):
    def test_single_process_commands_write_a_valid_report_when_they_fail(self):
        # buckets and sampler, like the distributed commands, write the error
        # into --json, and that report passes ddpdiag's own schema.
        for args in (["buckets", "--model", "no-such-layout.json"],
                     ["sampler", "--dataset-size", "10", "--world-size", "2", "--rank", "5"],
                     ["sampler", "--dataset-size", "100000000", "--world-size", "1", "--rank", "0"]):
            with self.subTest(args=args):
                path = tmp_json()
                p = run(args + ["--json", path])
                self.assertEqual(p.returncode, 2, p.stderr)
                rep = load(path)  # validates against the schema
                os.unlink(path)
                self.assertEqual(rep["verdict"], "ERROR")
                self.assertEqual(rep["error"]["kind"], "usage")
                self.assertEqual(rep["error"]["exit_code"], 2)
        self.assertIn("reports hold at most 10000000", p.stderr)
        self.assertIn("--count", p.stderr)

    @unittest.skipIf(SANITIZED, "no address-space limit can be set under a sanitizer")
    @unittest.skipIf(SANITIZED, "no address-space limit can be set under a sanitizer")
    def test_sampler_out_of_memory_is_a_clear_error(self):
        # 2^40 indices do not fit in 1 GiB of address space: exit 2 naming the
        # cause; the hint offers the ways out, and not "leave out --json" to
        # a user who gave none.
        def limit():
            resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
        p = subprocess.run([BIN, "sampler", "--dataset-size", str(1 << 41), "--world-size", "2",
                            "--rank", "0"], env=clean_env(), capture_output=True, text=True,
                           timeout=60, preexec_fn=limit)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("out of memory for this rank's indices", p.stderr)
        self.assertIn("--streaming", p.stderr)
        self.assertNotIn("--json", p.stderr)

    @unittest.skipIf(SANITIZED, "no address-space limit can be set under a sanitizer")
    def test_a_rank_0_refusal_under_the_launcher_ends_the_others_at_once(self):
        # Only dp-vs-ring's gather root (rank 0) holds the other rank's 1 GiB
        # buffer too: under a 3.55 GiB address-space limit it refuses, rank 1
        # does not. Rank 1 reads the launcher's note and stops at once
        # instead of waiting out --timeout for a rank 0 that is gone.
        def limit():
            resource.setrlimit(resource.RLIMIT_AS, (3550 << 20, 3550 << 20))
        t0 = time.monotonic()
        p = subprocess.run([BIN, "dp-vs-ring", "--nproc", "2", "-b", "1G", "-e", "1G", "-n", "1",
                            "-w", "0", "--timeout", "60"], env=clean_env(), capture_output=True,
                           text=True, timeout=120, preexec_fn=limit)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("[rank 0] ddpdiag: error on rank 0 during flags: buffers of 1G", p.stderr)
        self.assertRegex(p.stderr, r"\[rank 1\] ddpdiag: error on rank 1 \(peer rank 0\) during "
                         r"rendezvous: rank 0 \(pid \d+\) exited with code 2 .* before the ranks met")
        self.assertNotIn("timed out", p.stderr)
        self.assertLess(time.monotonic() - t0, 30, p.stderr)  # --timeout is 60

    def test_a_read_only_report_is_not_replaced(self):
        path = tmp_json()
        with open(path, "w") as f:
            f.write("{}")
        os.chmod(path, 0o444)
        try:
            p = run(["buckets", "--model", "mlp", "--json", path])
            self.assertEqual(p.returncode, 2, p.stderr)
            self.assertIn("is read-only", p.stderr)
            with open(path) as f:
                self.assertEqual(f.read(), "{}")
        finally:
            os.chmod(path, 0o644)
            os.unlink(path)


class BadInput(unittest.TestCase):
    """Inputs that once crashed (exit 70), hung or passed as a wrong value."""

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="ddpdiag-bad-input-")
        self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)

    def test_layouts_that_cannot_be_read_are_usage_errors(self):
        big = os.path.join(self.dir, "big.json")
        with open(big, "w") as f:
            f.write('[["w", [1e999]]]')  # past a double: was "internal error", exit 70
        fifo = os.path.join(self.dir, "fifo")
        os.mkfifo(fifo)  # nothing writes to it: reading it blocked for good
        cases = [(big, "number overflow"), (fifo, "nothing came through it"),
                 ("/dev/zero", "device")]
        if os.path.exists("/proc/self/mem"):
            cases.append(("/proc/self/mem", "cannot read it"))  # EIO: was exit 70
        for path, why in cases:
            with self.subTest(path=path):
                p = run(["buckets", "--model", path], timeout=60)
                self.assertEqual(p.returncode, 2, p.stderr)
                self.assertIn(why, p.stderr)
                self.assertNotIn("internal error", p.stderr)
        p = run(["report", "validate", "/dev/zero"], timeout=60)  # read until memory ran out
        self.assertEqual(p.returncode, 2, p.stderr)
        # A report may still come through a pipe, as from <(...).
        rep = os.path.join(self.dir, "r.json")
        self.assertEqual(run(["buckets", "--model", "mlp", "--json", rep]).returncode, 0)
        p = subprocess.run("cat %s | %s report validate /dev/stdin" % (rep, BIN), shell=True,
                           capture_output=True, text=True, timeout=60, env=clean_env())
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        # A FIFO no one reads is not written to for ever either.
        p = run(["sampler", "--dataset-size", "10", "--world-size", "1", "--rank", "0", "--json", fifo],
                timeout=60)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("nothing read from", p.stderr)

    def test_a_layout_through_a_pipe_reaches_every_rank(self):
        # `--model <(...)`: the commands that check the layout's memory before
        # the run read it twice, and the launcher's ranks would share one
        # pipe: every rank must get the whole layout, in one process or two.
        layout = os.path.join(self.dir, "layout.json")
        with open(layout, "w") as f:
            json.dump([["a.weight", [64, 32], "torch.float32", True], ["a.bias", [64], "torch.float32", True],
                       ["b.weight", [10, 64], "torch.float32", True]], f)
        out = os.path.join(self.dir, "r.json")
        for args in (["ddp-step", "-n", "2", "-w", "0", "--nproc", "1"],
                     ["ddp-step", "-n", "2", "-w", "0", "--nproc", "2"],
                     ["memory", "--nproc", "2", "-n", "1"],
                     ["bucket-sweep", "--caps", "1", "--no-size-sweep", "-n", "1", "--nproc", "2"],
                     ["ddp-step", "-n", "1", "-w", "0", "--rank", "0", "--world-size", "1",
                      "--master-addr", "127.0.0.1", "--master-port", str(free_port())]):
            with self.subTest(args=args):
                line = " ".join([BIN] + args + ["--timeout", "30", "--json", out, "--model",
                                                 "<(cat %s)" % layout])
                p = subprocess.run(line, shell=True, executable="/bin/bash", capture_output=True,
                                   text=True, timeout=120, env=clean_env())
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                rep = load(out)
                self.assertEqual(rep["verdict"], "PASS")
                self.assertRegex(rep["argv"][-1], r"^/dev/fd/\d+$")  # as given, not the launcher's copy
        # A layout that does not parse is named as the pipe it came through,
        # and the launcher leaves no copy behind.
        before = set(os.listdir(tempfile.gettempdir()))
        p = subprocess.run("%s ddp-step --nproc 2 --model <(echo '[bad')" % BIN, shell=True,
                           executable="/bin/bash", capture_output=True, text=True, timeout=60,
                           env=clean_env())
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertRegex(p.stderr, r"model layout /dev/fd/\d+: invalid JSON at byte 1")
        self.assertEqual([f for f in set(os.listdir(tempfile.gettempdir())) - before
                          if f.startswith("ddpdiag-model-")], [])

    def test_a_report_over_the_layout_is_refused(self):
        # --json or --markdown naming the --model file would replace the
        # layout with the report (a failed run's too): refused before the run.
        layout = os.path.join(self.dir, "layout.json")
        with open(layout, "w") as f:
            json.dump([["w", [4, 4]]], f)
        with open(layout) as f:
            before = f.read()
        for args in (["buckets", "--json", layout], ["buckets", "--markdown", layout, "--bucket-cap-mb", "1"],
                     ["ddp-step", "--nproc", "1", "--json", os.path.join(self.dir, ".", "layout.json")],
                     ["memory", "--nproc", "1", "--markdown", layout],
                     ["bucket-sweep", "--nproc", "1", "--json", layout],
                     ["broadcast-test", "--nproc", "1", "--json", layout]):
            with self.subTest(args=args):
                p = run(args + ["--model", layout], timeout=60)
                self.assertEqual(p.returncode, 2, p.stderr)
                self.assertRegex(p.stderr, r"--(json|markdown) \S+ is also the file --model reads \(%s\): "
                                 r"writing the report would replace it" % re.escape(layout))
                with open(layout) as f:
                    self.assertEqual(f.read(), before)

    def test_sizes_whose_buffers_overflow_64_bits_are_refused_before_the_run(self):
        # Three buffers of 2^64/3 bytes, two of 2^63: the memory check adds
        # them up without wrapping to a small number, and every rank refuses
        # before the rendezvous.
        for args in (["link-health", "--bytes", "6148914691236517206"],
                     ["dp-vs-ring", "-b", "9223372036854775808", "-e", "9223372036854775808"]):
            with self.subTest(args=args):
                p = run(args + ["--nproc", "2", "-n", "1", "-w", "0", "--timeout", "30"])
                self.assertEqual(p.returncode, 2, p.stderr)
                self.assertIn("[rank 1] ddpdiag: error on rank 1 during flags: buffers of", p.stderr)
                self.assertRegex(p.stderr, r"take about [0-9]{8,}\.\d GiB per rank")
                self.assertNotIn("allocate", p.stderr)
                self.assertLess(p.elapsed, 20, p.stderr)

    def test_an_empty_option_value_is_refused(self):
        for args in (["buckets", "--model", "mlp", "--first-bucket-mb", ""],
                     ["ddp-step", "--nproc", "2", "--model", "mlp", "--hook", ""],
                     ["store", "serve", "--port", ""],
                     # read by a check of several flags together, which
                     # must not take it for 0
                     ["allreduce-test", "--nproc", "2", "-f", ""],
                     ["dp-vs-ring", "--nproc", "2", "--stepfactor", ""]):
            with self.subTest(args=args):
                p = run(args, timeout=30)
                self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
                self.assertIn("an empty value", p.stderr)
        # An empty positional value is a value (store set KEY '').
        p = run(["store", "set", "--addr", "127.0.0.1:1", "--timeout", "0.2", "k", ""], timeout=30)
        self.assertNotIn("an empty value", p.stderr)

    def test_output_that_standard_output_cannot_take_fails_the_run(self):
        if not os.path.exists("/dev/full"):
            self.skipTest("no /dev/full")
        args = ["sampler", "--dataset-size", "100000", "--world-size", "1", "--rank", "0"]
        with open("/dev/full", "w") as full:
            p = subprocess.run([BIN] + args, stdout=full, stderr=subprocess.PIPE, text=True,
                               timeout=60, env=clean_env())
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("cannot write the output to standard output: No space left on device", p.stderr)
        # Closed: the same, and nothing else of the process takes its number.
        p = subprocess.run("%s %s >&-" % (BIN, " ".join(args)), shell=True, stderr=subprocess.PIPE,
                           text=True, timeout=60, env=clean_env())
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("Bad file descriptor", p.stderr)
        # A reader that stops early (| head) is no error.
        p = subprocess.run("%s %s | head -c 10 >/dev/null; exit ${PIPESTATUS[0]}" % (BIN, " ".join(args)),
                           shell=True, executable="/bin/bash", stderr=subprocess.PIPE, text=True,
                           timeout=60, env=clean_env())
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(p.stderr, "")
        # --help is output asked for too.
        for help_args in (["--help"], ["buckets", "--help"]):
            with open("/dev/full", "w") as full:
                p = subprocess.run([BIN] + help_args, stdout=full, stderr=subprocess.PIPE, text=True,
                                   timeout=60, env=clean_env())
            self.assertEqual(p.returncode, 2, p.stderr)
            p = subprocess.run("%s %s | head -c 10 >/dev/null; exit ${PIPESTATUS[0]}" % (BIN, " ".join(help_args)),
                               shell=True, executable="/bin/bash", stderr=subprocess.PIPE, text=True,
                               timeout=60, env=clean_env())
            self.assertEqual(p.returncode, 0, p.stderr)

    def test_a_launcher_size_without_its_rank_is_refused(self):
        # As WORLD_SIZE without RANK: ddpdiag started a world of its own.
        for size_var, rank_var in (("WORLD_SIZE", "RANK"), ("PMI_SIZE", "PMI_RANK"),
                                   ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"),
                                   ("MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK")):
            with self.subTest(size_var=size_var):
                p = run(["allreduce-test", "-b", "8", "-e", "8"], env=clean_env(**{size_var: "2"}),
                        timeout=60)
                self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
                self.assertIn("%s=2 is set but %s is not" % (size_var, rank_var), p.stderr)

    def test_a_line_refused_before_any_rank_starts_writes_its_report(self):
        # --nproc with --master-port is refused by the launcher, before any
        # rank: the report still says why (init-check too, which runs its
        # own phases). A rank other than 0 of a launcher's job writes none.
        for cmd in ("init-check", "allreduce-test"):
            with self.subTest(cmd=cmd):
                path = tmp_json()
                p = run([cmd, "--nproc", "2", "--master-port", "29999", "--json", path])
                self.assertEqual(p.returncode, 2, p.stderr)
                rep = load(path)  # validates against the schema
                os.unlink(path)
                self.assertEqual(rep["command"], cmd)
                self.assertEqual(rep["verdict"], "ERROR")
                self.assertEqual((rep["error"]["kind"], rep["error"]["phase"]), ("usage", "flags"))
                self.assertIn("--nproc 2 cannot be combined with --master-port",
                              rep["error"]["message"])
        path = tmp_json()  # a name only
        p = run(["allreduce-test", "--nproc", "2", "--json", path],
                env=clean_env(RANK="1", WORLD_SIZE="2"))
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertFalse(os.path.exists(path))

    def test_master_addr_forms_no_resolver_takes_are_refused_at_once(self):
        for addr, why in (("127.0.0.1:29500", "holds a port"), ("[::1]:29500", "holds a port"),
                          ("[::1", "unbalanced brackets"), ("http://node0", "is a URL"),
                          ("node 0", "a space")):
            with self.subTest(addr=addr):
                env = clean_env(RANK="1", WORLD_SIZE="2", MASTER_ADDR=addr, MASTER_PORT="29614")
                p = run(["allreduce-test", "-b", "8", "-e", "8", "--timeout", "60"], env=env, timeout=30)
                self.assertEqual(p.returncode, 2, p.stderr)
                self.assertIn(why, p.stderr)
                self.assertLess(p.elapsed, 10)


class BucketSweep(unittest.TestCase):
    CAPS = [1, 5, 25]

    def expected_buckets(self, cap, extra=()):
        path = tmp_json()
        p = run(["buckets", "--model", "mlp", "--bucket-cap-mb", str(cap), "--json", path] + list(extra))
        self.assertEqual(p.returncode, 0, p.stderr)
        rep = load(path)
        os.unlink(path)
        return rep["results"]["bucket_count"], [b["bytes"] for b in rep["results"]["buckets"]]

    def test_caps_at_2_3_4_ranks(self):
        expected = {cap: self.expected_buckets(cap) for cap in self.CAPS}
        for n in WORLDS:
            with self.subTest(ranks=n):
                p, rep = tool(self, ["bucket-sweep", "--model", "mlp", "--caps",
                                     ",".join(map(str, self.CAPS)), "-n", "2", "-w", "1",
                                     "--compute-gbps", "2", "--sweep-minbytes", "64K",
                                     "--sweep-maxbytes", "1M", "--sweep-iters", "2"], n)
                res = rep["results"]
                self.assertEqual(rep["verdict"], "PASS")
                self.assertEqual([c["bucket_cap_mb"] for c in res["caps"]], self.CAPS)
                for c in res["caps"]:
                    count, sizes = expected[c["bucket_cap_mb"]]
                    self.assertEqual(c["bucket_count"], count)
                    self.assertEqual(c["bucket_bytes"], sizes)
                    self.assertEqual(c["wrong"], 0)
                    self.assertGreaterEqual(c["exposed_comm_time_us"], 0)
                    self.assertGreater(c["comm_time_us"], 0)
                    self.assertGreater(c["busbw_gbps"], 0)
                # Caps that build the same buckets are one configuration:
                # the recommendation is the default of its group if there,
                # else the smallest, for the group's least exposed time.
                best = min(res["caps"], key=lambda c: c["exposed_comm_time_us"])
                group = [c["bucket_cap_mb"] for c in res["caps"]
                         if c["bucket_bytes"] == best["bucket_bytes"]]
                self.assertEqual(res["recommended_cap_mb"], 25 if 25 in group else min(group))
                self.assertEqual(res["equivalent_caps"], [group] if len(group) > 1 else
                                 res["equivalent_caps"])
                rec = res["recommendation"]
                dflt = [c for c in res["caps"] if c["bucket_cap_mb"] == 25][0]
                # The default's figure is its group's (the same buckets).
                dflt_exposed = min(c["exposed_comm_time_us"] for c in res["caps"]
                                   if c["bucket_bytes"] == dflt["bucket_bytes"])
                self.assertAlmostEqual(rec["saving_us"],
                                       dflt_exposed - best["exposed_comm_time_us"])
                self.assertIn("# Recommendation: bucket_cap_mb=", p.stdout)
                self.assertEqual([s["bytes"] for s in res["sizes"]], [64 << 10, 256 << 10, 1 << 20])

    def test_find_unused_parameters_runs_the_buckets_ddp_keeps(self):
        # The buckets `buckets --find-unused-parameters` shows (DDP never
        # rebuilds them then), not the rebuilt ones; gradients still right.
        flag = ["--find-unused-parameters"]
        p, rep = tool(self, ["bucket-sweep", "--model", "mlp", "--caps", "1,25", "-n", "2", "-w", "1",
                             "--no-size-sweep"] + flag, 2)
        res = rep["results"]
        self.assertEqual(rep["verdict"], "PASS")
        self.assertIs(res["find_unused_parameters"], True)
        for c in res["caps"]:
            kept = self.expected_buckets(c["bucket_cap_mb"], flag)
            self.assertEqual((c["bucket_count"], c["bucket_bytes"]), kept)
            self.assertNotEqual(c["bucket_bytes"], self.expected_buckets(c["bucket_cap_mb"])[1])
            self.assertEqual(c["wrong"], 0)

    def test_printed_median_is_the_reports(self):
        # With an even bucket count the median is the mean of the middle two,
        # in the table as in median_bucket_bytes.
        p, rep = tool(self, ["bucket-sweep", "--model", "mlp", "--caps",
                             ",".join(map(str, self.CAPS)), "-n", "1", "-w", "0",
                             "--no-size-sweep"], 2)
        caps = rep["results"]["caps"]
        self.assertTrue([c for c in caps if c["bucket_count"] % 2 == 0], "no even bucket count")
        printed = {}
        for line in p.stdout.splitlines():
            cols = line.split()
            if line.startswith("  ") and len(cols) == 11:
                printed[float(cols[0])] = float(cols[3])  # cap, buckets, min, median (MiB)
        for c in caps:
            with self.subTest(cap=c["bucket_cap_mb"]):
                self.assertAlmostEqual(printed[c["bucket_cap_mb"]], c["median_bucket_bytes"] / 2**20,
                                       delta=0.0006)


class DpVsRing(unittest.TestCase):
    def test_bad_names_are_refused_once_before_any_rank_starts(self):
        # Were refused by every rank after the launch: the error once per
        # rank, then the launcher's lines.
        for args, message in ((["-d", "foo"], "-d: unknown dtype 'foo'"),
                              (["--algorithms", "ring,rign"], "unknown algorithm 'rign'")):
            with self.subTest(args=args):
                p = run(["dp-vs-ring", "--nproc", "2"] + args)
                self.assertEqual(p.returncode, 2, p.stderr)
                self.assertEqual(p.stderr.count(message), 1, p.stderr)
                self.assertNotIn("[rank", p.stderr)

    def test_a_repeated_algorithm_is_measured_once(self):
        p, rep = tool(self, ["dp-vs-ring", "-b", "64", "-e", "64", "-n", "1", "-w", "0",
                             "--algorithms", "ring,ring,gather"], 2)
        self.assertEqual([r["algorithm"] for r in rep["results"]["sizes"]], ["ring", "gather"])

    def test_bytes_equal_theory_at_2_3_4_ranks(self):
        for n in WORLDS:
            with self.subTest(ranks=n):
                # 12K and 48K are multiples of n * 4 bytes for n = 2, 3, 4.
                p, rep = tool(self, ["dp-vs-ring", "-b", "12K", "-e", "48K", "-f", "4", "-n", "2",
                                     "-w", "1"], n)
                self.assertEqual(rep["verdict"], "PASS", rep["checks"])
                rows = rep["results"]["sizes"]
                self.assertEqual(len(rows), 2 * 3)
                for row in rows:
                    S = row["bytes"]
                    self.assertEqual(row["in_place"]["wrong"], 0)
                    self.assertEqual(len(row["ranks"]), n)
                    if row["algorithm"] == "backend":
                        self.assertIsNone(row["ranks"][0]["bytes_sent"])
                        continue
                    for r in row["ranks"]:
                        if row["algorithm"] == "ring":
                            want = 2 * (n - 1) * S // n
                            self.assertEqual(2 * (n - 1) * S % n, 0)
                            self.assertEqual(r["bytes_sent"], want)
                            self.assertEqual(r["bytes_received"], want)
                            self.assertEqual(r["extra_bytes"], S // n)
                        elif r["rank"] == 0:
                            self.assertEqual(r["bytes_sent"] + r["bytes_received"], 2 * (n - 1) * S)
                            self.assertEqual(r["extra_bytes"], (n - 1) * S)
                        else:
                            self.assertEqual(r["bytes_sent"], S)
                            self.assertEqual(r["bytes_received"], S)
                            self.assertEqual(r["extra_bytes"], 0)
                        self.assertEqual(r["bytes_sent"], r["theory_bytes_sent"])
                    self.assertTrue(row["traffic_matches_theory"])

    def test_readme_states_the_bytes_moved_the_tool_reports(self):
        # README's dp-vs-ring section states "moved" as sent + received, with
        # a worked example at n = 3, S = 768 KiB: the tool must report exactly it.
        readme = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")
        with open(readme, encoding="utf-8") as f:
            text = f.read()
        section = text[text.index("### `dp-vs-ring`"):text.index("### `memory`")]
        self.assertIn("| ring, every rank | 2(n−1)/n·S | 2(n−1)/n·S | 2·2(n−1)/n·S |", section)
        self.assertIn("| gather root (rank 0) | (n−1)·S | (n−1)·S | 2(n−1)·S |", section)
        self.assertIn("gather root moves 3,145,728", section)
        self.assertIn("ring rank 2,097,152", section)
        p, rep = tool(self, ["dp-vs-ring", "-b", "768K", "-e", "768K", "-n", "1", "-w", "0",
                             "--algorithms", "ring,gather"], 3)
        self.assertEqual(rep["verdict"], "PASS", rep["checks"])
        moved = {row["algorithm"]: row for row in rep["results"]["sizes"]}
        self.assertEqual(moved["gather"]["bytes"], 786432)
        self.assertEqual(moved["gather"]["rank0_bytes_moved"], 3145728)
        self.assertEqual(moved["gather"]["max_other_bytes_moved"], 2 * 786432)
        self.assertEqual(moved["ring"]["rank0_bytes_moved"], 2097152)
        self.assertEqual(moved["ring"]["max_other_bytes_moved"], 2097152)

    def test_sizes_not_divisible_and_smaller_worlds(self):
        # 13 floats over 3 ranks: per rank exact by the chunking rule, the sum 2(n-1)S.
        p, rep = tool(self, ["dp-vs-ring", "-b", "52", "-e", "52", "-n", "1", "-w", "0",
                             "--world-sizes", "2,3", "--algorithms", "ring,gather"], 3)
        self.assertEqual(rep["verdict"], "PASS", rep["checks"])
        rows = rep["results"]["sizes"]
        self.assertEqual(sorted({r["world_size"] for r in rows}), [2, 3])
        for row in rows:
            if row["algorithm"] == "ring":
                k = row["world_size"]
                self.assertEqual(sum(r["bytes_sent"] for r in row["ranks"]), 2 * (k - 1) * 52)


class Memory(unittest.TestCase):
    def test_communication_peak_is_the_larger_phase_not_their_sum(self):
        # Mixed dtypes: the parameter broadcast stages the float32 group
        # (100,000 + 5,000 elements: 420,000 bytes), freed before the reducer
        # allocates the used-parameter map (5,002 parameters x 4 bytes). The
        # two never coexist: the category's peak is 420,000, not their sum.
        d = tempfile.mkdtemp(prefix="ddpdiag-mem-peak-")
        self.addCleanup(shutil.rmtree, d, ignore_errors=True)
        layout = os.path.join(d, "layout.json")
        tensors = ([{"name": "p0", "shape": [100000]}, {"name": "h", "shape": [10], "dtype": "torch.bfloat16"}]
                   + [{"name": "s%d" % i, "shape": [1]} for i in range(5000)])
        with open(layout, "w") as f:
            json.dump({"name": "mixed", "tensors": tensors}, f)
        p, rep = tool(self, ["memory", "--model", layout, "--find-unused-parameters", "-n", "1",
                             "--no-comm-probe"], 2)
        for r in rep["results"]["ranks"]:
            self.assertEqual(r["categories"]["communication_buffers"], 5002 * 4)
            self.assertEqual(r["category_peak_bytes"]["communication_buffers"], 420000)

    def test_categories_sum_to_totals_at_2_3_4_ranks(self):
        for n in WORLDS:
            with self.subTest(ranks=n):
                p, rep = tool(self, ["memory", "--model", "mlp", "-n", "1", "--imbalance-pct",
                                     "1000"], n)
                self.assertEqual(rep["verdict"], "PASS", rep["checks"])
                res = rep["results"]
                self.assertEqual(len(res["ranks"]), n)
                for r in res["ranks"]:
                    cats = r["categories"]
                    self.assertEqual(set(cats), {"parameters", "gradients", "buckets",
                                                 "communication_buffers", "workspace"})
                    self.assertEqual(sum(cats.values()), r["total_bytes"])
                    self.assertGreaterEqual(r["peak_bytes"], r["total_bytes"])
                    self.assertEqual(cats["parameters"], res["model_bytes"])
                    self.assertGreater(r["rss_bytes"], 0)
                    self.assertGreaterEqual(r["peak_rss_bytes"], r["rss_bytes"])

    def test_imbalance_names_the_rank(self):
        p, rep = tool(self, ["memory", "--model", "mlp", "-n", "1", "--inject-extra", "1:32"], 3,
                      expect_rc=(1,))
        self.assertEqual(rep["verdict"], "FAIL")
        flagged = {(f["rank"], f["metric"]) for f in rep["results"]["imbalanced_ranks"]}
        self.assertIn((1, "total_bytes"), flagged)
        self.assertNotIn(0, {r for r, _ in flagged})
        self.assertIn("rank 1", [c for c in rep["checks"] if c["name"] == "imbalance"][0]["detail"])
        # At 2 ranks: rank 0 about 18% over rank 1 (mlp's 22 MiB + 4) is
        # named, judged against the other rank rather than a median (the
        # mean of the two) that holds its own figure.
        p, rep = tool(self, ["memory", "--model", "mlp", "-n", "1", "--inject-extra", "0:4",
                             "--no-comm-probe"], 2, expect_rc=(1,))
        flagged = {(f["rank"], f["metric"]) for f in rep["results"]["imbalanced_ranks"]}
        self.assertIn((0, "total_bytes"), flagged)
        self.assertNotIn(1, {r for r, _ in flagged})

    def test_wrong_gradients_name_their_rank_and_a_failed_run_judges_what_it_can(self):
        p, rep = tool(self, ["memory", "--model", "mlp", "-n", "2", "--inject-fault",
                             "corrupt@rank=1"], 2, expect_rc=(1,))
        check = [c for c in rep["checks"] if c["name"] == "correctness"][0]
        self.assertEqual(check["status"], "fail")
        self.assertIn("summed over 2 rank(s) (rank 1: ", check["detail"])
        self.assertNotIn("rank 0:", check["detail"])
        # Rank 1 gone after one step: the report still holds both checks,
        # judged as far as rank 0 can.
        path = tmp_json()
        p = run(["memory", "--model", "mlp", "-n", "2", "--nproc", "2", "--timeout", "10",
                 "--inject-fault", "exit@seq=6,rank=1", "--json", path])
        self.assertEqual(p.returncode, 5, p.stderr)
        rep = load(path)
        os.unlink(path)
        checks = {c["name"]: c for c in rep["checks"]}
        self.assertEqual(checks["imbalance"]["status"], "skip")
        self.assertEqual(checks["correctness"]["status"], "skip")
        self.assertIn("rank 0 alone: 0 wrong gradient element(s) over", checks["correctness"]["detail"])

    def test_balanced_run_names_no_rank(self):
        # The default --imbalance-pct (10) on ranks doing the same work: the
        # check passes, nobody is named, and the report validates.
        path = tmp_json()
        p = run(["memory", "--model", "mlp", "-n", "1", "--nproc", "2", "--json", path])
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        rep = load(path)
        self.assertEqual(rep["results"]["imbalanced_ranks"], [])
        self.assertEqual([c["status"] for c in rep["checks"] if c["name"] == "imbalance"], ["pass"])
        v = run(["report", "validate", path])
        os.unlink(path)
        self.assertEqual(v.returncode, 0, v.stdout + v.stderr)

    def test_bad_flags_are_usage_errors(self):
        # A negative --inject-extra MB once wrapped to a 16 EiB allocation
        # (exit 3, "could not allocate"); a huge cap overflowed to 0 bytes.
        for args in (["--inject-extra", "0:-5"], ["--inject-extra", "x:1"], ["--inject-extra", "0:1MB"],
                     ["--bucket-cap-mb", "1e300"], ["--first-bucket-mb", "1e13"]):
            with self.subTest(args=args):
                p = run(["memory", "--model", "mlp", "-n", "1", "--nproc", "1", "--no-comm-probe"] + args)
                self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
                self.assertIn(args[0], p.stderr)

    def test_gradients_without_views(self):
        # DDP's default (gradient_as_bucket_view=False) is memory's too.
        for extra in ([], ["--no-gradient-views"]):
            p, rep = tool(self, ["memory", "--model", "mlp", "-n", "1", "--imbalance-pct", "1000"]
                          + extra, 2)
            self.assertFalse(rep["results"]["gradient_as_bucket_view"])
            for r in rep["results"]["ranks"]:
                self.assertEqual(r["categories"]["gradients"], rep["results"]["model_bytes"])
                self.assertGreaterEqual(r["categories"]["buckets"], rep["results"]["model_bytes"])

    def test_gradients_as_bucket_views(self):
        p, rep = tool(self, ["memory", "--model", "mlp", "-n", "1", "--gradient-as-bucket-view",
                             "--imbalance-pct", "1000"], 2)
        self.assertTrue(rep["results"]["gradient_as_bucket_view"])
        for r in rep["results"]["ranks"]:
            self.assertEqual(r["categories"]["gradients"], 0)


class LinkHealth(unittest.TestCase):
    def test_matrix_complete_at_2_3_4_ranks(self):
        for n in WORLDS:
            with self.subTest(ranks=n):
                p, rep = tool(self, ["link-health", "--bytes", "256K", "-n", "2",
                                     "--latency-iters", "5", "--allreduce-bytes", "64K",
                                     "--allreduce-iters", "2"], n, expect_rc=(0, 1))
                res = rep["results"]
                self.assertEqual(res["ranks"], n)
                for key in ("busbw_gbps", "latency_us"):
                    m = res[key]
                    self.assertEqual(len(m), n)
                    for a in range(n):
                        self.assertEqual(len(m[a]), n)
                        for b in range(n):
                            if a == b:
                                self.assertIsNone(m[a][b])
                            else:
                                self.assertGreater(m[a][b], 0)
                                self.assertEqual(m[a][b], m[b][a])
                self.assertEqual(len(res["pairs"]), n * (n - 1) // 2)
                seen = set()
                for rnd in res["rounds"]:
                    ranks = [x for pair in rnd for x in pair]
                    self.assertEqual(len(ranks), len(set(ranks)))
                    seen.update(tuple(pair) for pair in rnd)
                self.assertEqual(len(seen), n * (n - 1) // 2)
                self.assertEqual(len(res["allreduce"]), n)
                rechecked = {tuple(p) for p in res["rechecked_pairs"]}
                for q in res["pairs"]:
                    self.assertEqual(q["measurements"] > 1, (q["src"], q["dst"]) in rechecked, q)
                slow = {tuple(p) for p in res["slow_pairs"]}
                self.assertEqual(slow, {(q["src"], q["dst"]) for q in res["pairs"] if q["slow"]})
                self.assertEqual(rep["verdict"], "PASS" if not slow else "FAIL")
                self.assertTrue(all(q["transport"] == ["TCP"] for q in res["pairs"]))

    def test_absolute_threshold_names_every_pair(self):
        p, rep = tool(self, ["link-health", "--bytes", "64K", "-n", "1", "--latency-iters", "2",
                             "--min-bw-gbps", "1e9"], 2, expect_rc=(1,))
        self.assertEqual(rep["results"]["slow_pairs"], [[0, 1]])
        self.assertIn("0-1", [c for c in rep["checks"] if c["name"] == "links"][0]["detail"])
        # Found slow, the pair was measured again twice (the default
        # --rechecks 2) and stayed slow.
        self.assertEqual(rep["results"]["recheck_passes"], 2)
        self.assertEqual(rep["results"]["rechecked_pairs"], [[0, 1]])
        self.assertEqual(rep["results"]["pairs"][0]["measurements"], 3)

    def test_rechecks_0_judges_the_first_measurement(self):
        p, rep = tool(self, ["link-health", "--bytes", "64K", "-n", "1", "--latency-iters", "2",
                             "--min-bw-gbps", "1e9", "--rechecks", "0"], 3, expect_rc=(1,))
        res = rep["results"]
        self.assertEqual(res["recheck_passes"], 0)
        self.assertEqual(res["rechecked_pairs"], [])
        self.assertEqual([q["measurements"] for q in res["pairs"]], [1, 1, 1])
        self.assertEqual(res["slow_pairs"], [[0, 1], [0, 2], [1, 2]])

    SMALL = ["--bytes", "64K", "-n", "1", "--latency-iters", "2", "--allreduce-bytes", "64K",
             "--allreduce-iters", "1"]

    def test_wrong_data_fails_on_every_rank_and_names_the_rank(self):
        # corrupt@rank=1 inverts the middle byte of every buffer rank 1
        # receives and puts its all_reduce result off by one. Each rank, run
        # as a process of its own, exits 1; rank 0's report names rank 1, the
        # pair, the first wrong byte and the count in data_correct.
        n, port, path = 3, free_port(), tmp_json()
        args = ["link-health"] + self.SMALL + ["--rechecks", "0", "--inject-fault", "corrupt@rank=1",
                                               "--json", path]
        envs = [clean_env(RANK=r, WORLD_SIZE=n, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
                for r in range(n)]
        out = run_ranks([args] * n, envs)
        for r, (rc, so, se, _) in enumerate(out):
            self.assertEqual(rc, 1, "rank %d: %s%s" % (r, so, se))
        stdout = out[0][1]
        self.assertIn("# Verdict: FAIL", stdout)
        self.assertIn("# Check data_correct", stdout)
        rep = load(path)
        os.unlink(path)
        self.assertEqual(rep["verdict"], "FAIL")
        check = [c for c in rep["checks"] if c["name"] == "data_correct"]
        self.assertEqual(len(check), 1, rep["checks"])
        self.assertEqual(check[0]["status"], "fail")
        detail = check[0]["detail"]
        # An exchange and a ping from each of its two peers; the middle of
        # 64 KiB is byte 32768.
        self.assertRegex(detail, r"rank 1 received 4 wrong byte\(s\) in 4 payload\(s\), the first from "
                                 r"rank ([02]) \(pair (0-1|1-2)\) at byte 32768 of its 65536-byte exchange")
        self.assertIn("rank 1's all_reduce result had 1 of 16384 element(s) wrong, the first at element 0",
                      detail)
        self.assertNotIn("rank 0 received", detail)
        self.assertNotIn("rank 2 received", detail)
        res = rep["results"]
        errors = res["data_errors"]
        self.assertEqual({e["rank"] for e in errors}, {1})
        # From both peers, in the exchange (its middle byte) and the ping.
        self.assertEqual({(e["peer"], e["payload"]) for e in errors},
                         {(0, "exchange"), (0, "ping"), (2, "exchange"), (2, "ping")})
        for e in errors:
            self.assertEqual(e["wrong_bytes"], 1, e)
            self.assertEqual(e["first_wrong_byte"], e["bytes"] // 2, e)
        self.assertEqual([a["wrong_elements"] for a in res["allreduce"]], [0, 1, 0])
        self.assertEqual(res["allreduce"][1]["first_wrong_element"], 0)

    def test_clean_run_checks_the_data_and_passes(self):
        # Two ranks: one pair, with no other to be found slow against.
        p, rep = tool(self, ["link-health"] + self.SMALL, 2)
        self.assertEqual(rep["verdict"], "PASS", p.stdout)
        check = [c for c in rep["checks"] if c["name"] == "data_correct"][0]
        self.assertEqual(check["status"], "pass", check)
        self.assertIn("every byte of 4 pair payload(s)", check["detail"])
        self.assertEqual(rep["results"]["data_errors"], [])
        self.assertEqual([a["wrong_elements"] for a in rep["results"]["allreduce"]], [0, 0])




def run_bounded(args, stdout=subprocess.PIPE, env=None, timeout=120):
    """Runs ddpdiag with at most 1 GiB of address space (a renderer that
    allocates without end fails with bad_alloc instead of eating the machine;
    not under a sanitizer, where the deadline alone bounds it) and a
    deadline; stdout may be a file (/dev/full)."""
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
    return subprocess.run([BIN] + list(args), stdout=stdout, stderr=subprocess.PIPE, text=True,
                          env=env or clean_env(), timeout=timeout,
                          preexec_fn=None if SANITIZED else limit)


class ReportCommand(unittest.TestCase):
    """ddpdiag report validate / compare / render / schema on what the
    measuring commands write, and on reports edited by hand."""

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="ddpdiag-report-cmd-")
        self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)
        self.base = self.path("base.json")
        p = run(["buckets", "--model", "mlp", "--json", self.base])
        self.assertEqual(p.returncode, 0, p.stderr)

    def path(self, name):
        return os.path.join(self.dir, name)

    def write_json(self, name, doc):
        path = self.path(name)
        with open(path, "w") as f:
            json.dump(doc, f)
        return path

    def test_render_ends_on_a_bucket_sweep_whose_caps_a_tick_step_cannot_separate(self):
        for caps in ("25,25.000000000000004", "999999.9999999999,1000000"):
            with self.subTest(caps=caps):
                rep = self.path("bs.json")
                p = run(["bucket-sweep", "--nproc", "2", "--model", "mlp", "--caps", caps, "-n", "2",
                         "-w", "1", "--no-size-sweep", "--json", rep])
                self.assertIn(p.returncode, (0, 1), p.stderr)
                out = self.path("bs.html")
                r = run_bounded(["report", "render", rep, "--html", out, "--markdown", self.path("bs.md")])
                self.assertEqual(r.returncode, 0, r.stderr)
                with open(out) as f:
                    self.assertIn("Bucket sweep: exposed comm time vs bucket cap", f.read())

    def test_render_skips_link_health_pairs_of_ranks_outside_the_run(self):
        lh = self.path("lh.json")
        p = run(["link-health", "--nproc", "2", "--bytes", "1M", "-n", "1", "--latency-iters", "2",
                 "--allreduce-bytes", "64K", "--allreduce-iters", "1", "--json", lh])
        self.assertIn(p.returncode, (0, 1), p.stderr)
        with open(lh) as f:
            doc = json.load(f)
        del doc["results"]["busbw_gbps"]  # the heat map is then drawn from the pairs
        for field, value in (("src", -1), ("dst", 2147483647), ("dst", 200000)):
            with self.subTest(field=field, value=value):
                edited = json.loads(json.dumps(doc))
                # The measured pair stays, and a copy of it names a rank the
                # run does not have.
                bad = dict(edited["results"]["pairs"][0])
                bad[field] = value
                edited["results"]["pairs"].insert(0, bad)
                path = self.write_json("lh-edited.json", edited)
                out = self.path("lh.html")
                r = run_bounded(["report", "render", path, "--html", out, "--markdown", self.path("lh.md")])
                self.assertEqual(r.returncode, 0, r.stderr)
                with open(out) as f:
                    html = f.read()
                self.assertTrue("Link health: bandwidth between ranks" in html, "no heat map")
                self.assertTrue("from rank 0 -&gt; 1:" in html or "from rank 0 -> 1:" in html, "no 0 -> 1 cell")
                self.assertFalse("-> 2:" in html, "a third rank drawn")
                v = run(["report", "validate", path])
                if value < 0:
                    self.assertEqual(v.returncode, 1, v.stdout + v.stderr)
                    self.assertIn("/results/pairs/0/src", v.stdout)
                else:
                    self.assertEqual(v.returncode, 0, v.stdout + v.stderr)

    def test_output_to_a_full_stdout_is_an_error(self):
        if not os.path.exists("/dev/full"):
            self.skipTest("no /dev/full")
        for args in (["report", "render", self.base, "--markdown", "-"],
                     ["report", "render", self.base],
                     ["report", "render", self.base, "--html", "-"],
                     ["report", "schema"],
                     ["report", "validate", self.base],
                     ["report", "compare", self.base, self.base]):
            with self.subTest(args=args[1:]):
                with open("/dev/full", "w") as full:
                    r = run_bounded(args, stdout=full)
                self.assertEqual(r.returncode, 2, r.stderr)
                self.assertIn("cannot write", r.stderr)
                self.assertIn("standard output", r.stderr)
                self.assertIn("No space left on device", r.stderr)

    def test_a_report_of_a_million_rows_is_read_in_one_pass(self):
        # Reading grew with the square of an array's length of objects (2M
        # rows: minutes); one linear pass reads it in about a second here.
        with open(self.base) as f:
            doc = json.load(f)
        doc["results"]["extra_rows"] = [{"a": i} for i in range(1000000)]
        big = self.write_json("big.json", doc)
        t0 = time.monotonic()
        p = run_bounded(["report", "validate", big], timeout=60)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("valid", p.stdout)
        self.assertLess(time.monotonic() - t0, 30)

    def test_a_reader_that_stops_early_keeps_the_exit_code(self):
        # `... | head`, `... | grep -q`: standard output is a pipe whose reader
        # has gone. The command keeps its own exit code (a CI gate reads it):
        # 0, or validate's 1 for a report that breaks the schema.
        with open(self.base) as f:
            doc = json.load(f)
        doc["verdict"] = "MAYBE"
        bad = self.write_json("bad.json", doc)
        for args, rc in ((["report", "schema"], 0), (["report", "render", self.base], 0),
                         (["report", "compare", self.base, self.base], 0),
                         (["report", "validate", self.base], 0),
                         (["report", "validate", bad], 1)):
            with self.subTest(args=args[1:]):
                r, w = os.pipe()
                os.close(r)
                try:
                    p = run_bounded(args, stdout=w)
                finally:
                    os.close(w)
                self.assertEqual(p.returncode, rc, p.stderr)
                self.assertNotIn("cannot write", p.stderr)

    def test_compare_refuses_a_report_it_cannot_read_naming_the_file(self):
        cases = (('{"schema": 1}', "not a string"),
                 ('{"schema": null}', "not a string"),
                 ('[1, 2]', "not a JSON object"),
                 ('{"schema": "ddpdiag.report/1", "duration_s": 1e400}', "cannot be read"))
        for text, why in cases:
            with self.subTest(text=text):
                bad = self.path("s.json")
                with open(bad, "w") as f:
                    f.write(text)
                for args in ([self.base, bad], [bad, self.base]):
                    r = run(["report", "compare"] + args)
                    self.assertEqual(r.returncode, 2, r.stderr)
                    self.assertIn(bad, r.stderr)
                    self.assertIn(why, r.stderr)
                    self.assertNotIn("internal error", r.stderr)
                r = run(["report", "render", bad])
                self.assertNotIn("internal error", r.stderr)

    def test_render_and_compare_do_not_replace_a_read_only_file(self):
        for name, args in (("kept.html", lambda t: ["report", "render", self.base, "--html", t]),
                           ("kept.md", lambda t: ["report", "render", self.base, "--markdown", t]),
                           ("kept-compare.md", lambda t: ["report", "compare", self.base, self.base,
                                                          "--markdown", t])):
            with self.subTest(name=name):
                target = self.path(name)
                with open(target, "w") as f:
                    f.write("kept")
                os.chmod(target, 0o444)
                r = run(args(target))
                self.assertEqual(r.returncode, 2, r.stderr)
                self.assertIn("is read-only", r.stderr)
                with open(target) as f:
                    self.assertEqual(f.read(), "kept")
                self.assertEqual(os.stat(target).st_mode & 0o777, 0o444)
                os.chmod(target, 0o644)
        # A file that may be replaced is, and keeps its mode.
        private = self.path("private.html")
        with open(private, "w") as f:
            f.write("old")
        os.chmod(private, 0o600)
        r = run(["report", "render", self.base, "--html", private])
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(os.stat(private).st_mode & 0o777, 0o600)
        with open(private) as f:
            self.assertIn("<!DOCTYPE html>", f.read())
        # GitHub's step summary is still appended to.
        summary = self.path("summary.md")
        with open(summary, "w") as f:
            f.write("earlier step\n")
        r = run(["report", "compare", self.base, self.base, "--markdown", summary],
                env=clean_env(GITHUB_STEP_SUMMARY=summary))
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(summary) as f:
            text = f.read()
        self.assertTrue(text.startswith("earlier step\n"), text)
        self.assertIn("## ddpdiag report compare", text)

    def test_a_report_nested_thousands_deep_is_refused_not_a_crash(self):
        with open(self.base) as f:
            doc = json.load(f)
        del doc["results"]  # given again below (a key given twice is refused on its own)
        text = json.dumps(doc)
        # 20,000 levels inside results: the schema lets results hold anything.
        deep = text[:-1] + ', "results": ' + "[" * 20000 + "]" * 20000 + "}"
        bad = self.path("deep.json")
        with open(bad, "w") as f:
            f.write(deep)
        for args in (["report", "validate", bad], ["report", "render", bad],
                     ["report", "compare", self.base, bad], ["report", "compare", bad, self.base]):
            with self.subTest(args=args[:2]):
                r = run_bounded(args)
                self.assertEqual(r.returncode, 2, r.stdout + r.stderr)
                self.assertIn("more than 64 levels deep", r.stderr)

    def test_long_strings_are_checked_against_their_patterns(self):
        with open(self.base) as f:
            doc = json.load(f)
        # A check name of 50,000 letters fits its pattern; with a capital it
        # does not. std::regex overflowed the stack on either.
        doc["checks"].append({"name": "a" * 50000, "status": "pass", "detail": "long"})
        good = self.write_json("long-good.json", doc)
        doc["checks"][-1]["name"] = "a" * 50000 + "B"
        bad = self.write_json("long-bad.json", doc)
        r = run_bounded(["report", "validate", good])
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        r = run_bounded(["report", "validate", bad])
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertIn("/checks/%d/name" % (len(doc["checks"]) - 1), r.stdout)
        r = run_bounded(["report", "compare", self.base, bad])
        self.assertEqual(r.returncode, 2, r.stdout + r.stderr)

    def test_a_step_summary_append_that_fails_part_way_is_taken_back(self):
        summary = self.path("summary.md")
        with open(summary, "w") as f:
            f.write("earlier step\n")

        def one_kib_files():
            # Writes past 100 bytes more fail with EFBIG (SIGXFSZ ignored,
            # as a runner's shell may leave it): the table is longer.
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            limit = len("earlier step\n") + 100
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        r = subprocess.run([BIN, "report", "compare", self.base, self.base, "--markdown", summary],
                           env=clean_env(GITHUB_STEP_SUMMARY=summary), capture_output=True,
                           text=True, timeout=60, preexec_fn=one_kib_files)
        self.assertIn("taken back", r.stderr)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("cannot append to", r.stderr)
        with open(summary) as f:
            self.assertEqual(f.read(), "earlier step\n")
        # A read-only summary is refused, as a read-only report is, even by root.
        os.chmod(summary, 0o444)
        r = run(["report", "compare", self.base, self.base, "--markdown", summary],
                env=clean_env(GITHUB_STEP_SUMMARY=summary))
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("read-only", r.stderr)
        with open(summary) as f:
            self.assertEqual(f.read(), "earlier step\n")

    def test_a_file_size_limit_is_an_error_not_a_signal(self):
        # With SIGXFSZ at its default (death), as most shells leave it: the
        # write past ulimit -f fails, the command exits 2 naming the limit,
        # and nothing half-written stays behind.
        def small_files():
            # 100 bytes past what the summary holds: less than either page.
            limit = len("earlier step\n") + 100
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        summary = self.path("limited-summary.md")
        with open(summary, "w") as f:
            f.write("earlier step\n")
        for args, env in ((["report", "compare", self.base, self.base, "--markdown", summary],
                           clean_env(GITHUB_STEP_SUMMARY=summary)),
                          (["report", "render", self.base, "--markdown", self.path("limited.md")],
                           clean_env())):
            with self.subTest(args=args[:2]):
                r = subprocess.run([BIN] + args, env=env, capture_output=True, text=True, timeout=60,
                                   preexec_fn=small_files)
                self.assertEqual(r.returncode, 2, r.stderr)
                self.assertIn("File too large", r.stderr)
                self.assertIn("file size limit", r.stderr)
        with open(summary) as f:
            self.assertEqual(f.read(), "earlier step\n")
        self.assertFalse(os.path.exists(self.path("limited.md")))
        self.assertEqual([n for n in os.listdir(os.path.dirname(summary)) if n.endswith(".tmp")], [])

    def test_step_summary_appends_start_on_a_line_of_their_own(self):
        summary = self.path("open-summary.md")
        with open(summary, "w") as f:
            f.write("earlier step, no newline")
        for _ in range(2):
            r = run(["report", "compare", self.base, self.base, "--markdown", summary],
                    env=clean_env(GITHUB_STEP_SUMMARY=summary))
            self.assertEqual(r.returncode, 0, r.stderr)
        with open(summary) as f:
            text = f.read()
        self.assertTrue(text.startswith("earlier step, no newline\n## ddpdiag report compare"), text[:200])
        # The second comparison's heading follows a blank line, not the
        # first one's closing HTML block.
        self.assertEqual(text.count("\n## ddpdiag report compare"), 2)
        second = text.index("## ddpdiag report compare", 30)
        self.assertEqual(text[second - 2:second], "\n\n")

    def test_a_baseline_that_measured_nothing_never_passes_the_gate(self):
        # A run interrupted at once and a line refused for its flags end in
        # ERROR with no row: against them every row of NEW would be new and
        # the gate would pass, even with --fail-on-missing.
        new, usage, killed = self.path("new.json"), self.path("usage.json"), self.path("killed.json")
        p = run(["allreduce-test", "-b", "8", "-e", "1K", "-n", "1", "-w", "0", "--json", new])
        self.assertEqual(p.returncode, 0, p.stderr)
        p = run(["allreduce-test", "-b", "1M", "-e", "1K", "--json", usage])
        self.assertEqual(p.returncode, 2, p.stderr)
        proc = subprocess.Popen([BIN, "allreduce-test", "-n", "200", "--json", killed], env=clean_env(),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(2.5)
        proc.send_signal(signal.SIGTERM)
        self.assertEqual(proc.wait(timeout=60), 128 + signal.SIGTERM)
        with open(killed) as f:
            self.assertEqual(json.load(f)["error"]["kind"], "interrupted")
        for base, kind in ((killed, "interrupted"), (usage, "usage")):
            for extra in ([], ["--fail-on-missing"]):
                with self.subTest(base=kind, extra=extra):
                    r = run(["report", "compare"] + extra + [base, new])
                    self.assertEqual(r.returncode, 2, r.stdout + r.stderr)
                    self.assertIn("baseline %s measured nothing to compare against" % base, r.stderr)
                    self.assertIn("its verdict is ERROR (error %s: " % kind, r.stderr)
                    self.assertIn("record the baseline again from a run that passed", r.stderr)
                    self.assertNotIn("no regression", r.stdout)
        # Among several baselines it is refused by name.
        r = run(["report", "compare", new, killed, new])
        self.assertEqual(r.returncode, 2, r.stdout + r.stderr)
        self.assertIn("baseline %s measured nothing" % killed, r.stderr)
        self.assertIn("leave %s out of the baselines" % killed, r.stderr)
        # A baseline that failed but measured its rows compares as before.
        with open(new) as f:
            doc = json.load(f)
        doc["verdict"] = "FAIL"
        doc["checks"][0]["status"] = "fail"
        failed = self.write_json("failed.json", doc)
        r = run(["report", "compare", failed, new])
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("verdict: FAIL -> PASS", r.stdout)

    def test_memory_workspace_is_a_setting(self):
        a, b = self.path("ws1.json"), self.path("ws64.json")
        for path, extra in ((a, []), (b, ["--workspace-mb", "64"])):
            p = run(["memory", "--model", "mlp", "--no-comm-probe", "--json", path] + extra)
            self.assertEqual(p.returncode, 0, p.stderr)
        with open(b) as f:
            self.assertEqual(json.load(f)["results"]["workspace_mb"], 64)
        r = run(["report", "compare", a, b])
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("settings differ: workspace_mb 1 (base) vs 64 (new)", r.stdout)
        self.assertIn("0 regressed", r.stdout)
        self.assertEqual(run(["report", "compare", "--fail-on-missing", a, b]).returncode, 1)

    def test_desync_check_is_a_setting(self):
        a, b = self.path("plain.json"), self.path("desync.json")
        for path, extra in ((a, []), (b, ["--desync-check"])):
            p = run(["allreduce-test", "-b", "8", "-e", "1K", "-n", "1", "-w", "0", "--json", path] + extra)
            self.assertEqual(p.returncode, 0, p.stderr)
        with open(b) as f:
            self.assertIs(json.load(f)["world"]["desync_check"], True)
        r = run(["report", "compare", a, b])
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("settings differ: desync check no (base) vs yes (new)", r.stdout)

    def test_a_step_summary_that_cannot_be_appended_to_is_refused_first(self):
        summary = os.path.join(self.dir, "missing", "s.md")
        r = run(["report", "compare", self.base, self.base, "--markdown", summary],
                env=clean_env(GITHUB_STEP_SUMMARY=summary))
        self.assertEqual(r.returncode, 2, r.stdout + r.stderr)
        self.assertEqual(r.stdout, "")
        self.assertIn("--markdown %s: cannot append there" % summary, r.stderr)
        self.assertIn("does not exist", r.stderr)
        os.mkdir(self.path("dir.md"))
        r = run(["report", "compare", self.base, self.base, "--markdown", self.path("dir.md")],
                env=clean_env(GITHUB_STEP_SUMMARY=self.path("dir.md")))
        self.assertEqual(r.returncode, 2, r.stdout + r.stderr)
        self.assertEqual(r.stdout, "")
        self.assertIn("is a directory", r.stderr)

    def test_compare_markdown_to_stdout_is_markdown_alone(self):
        r = run(["report", "compare", self.base, self.base, "--markdown", "-"])
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertTrue(r.stdout.startswith("## ddpdiag report compare"), r.stdout[:200])
        self.assertNotIn("result: ", r.stdout)
        self.assertIn("result: no regression", r.stderr)

    def test_a_tolerance_of_hundreds_of_digits_is_out_of_range(self):
        r = run(["report", "compare", self.base, self.base, "--max-regression", "9" * 400])
        self.assertEqual(r.returncode, 2, r.stdout + r.stderr)
        self.assertIn("out of range", r.stderr)
        self.assertNotIn("not a percentage", r.stderr)

    def test_control_characters_of_a_report_are_escaped(self):
        with open(self.base) as f:
            doc = json.load(f)
        # A row named by a report string, a check's detail, the command line.
        doc["results"]["extra"] = [{"name": "\x1b]0;title\x07\u009b", "time_us": 1.0}]
        doc["checks"].append({"name": "bell", "status": "pass", "detail": "\x1b[2J cleared\x7f"})
        doc["argv"].append("\x1b[31mred")
        evil = self.write_json("evil.json", doc)
        for args in (["report", "compare", self.base, evil], ["report", "compare", evil, evil, "--markdown", "-"],
                     ["report", "render", evil]):
            with self.subTest(args=args[:2]):
                r = run(args)
                self.assertEqual(r.returncode, 0, r.stderr)
                for out in (r.stdout, r.stderr):
                    for ch in "\x1b\x07\x7f\u009b":
                        self.assertNotIn(ch, out)
                self.assertIn("\\x1b]0;title\\x07\\u009b", (r.stdout + r.stderr).replace("\\]", "]"))
        r = run(["report", "render", evil, "--html", "-"])
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("cleared", r.stdout)

    def test_a_key_repeated_in_one_object_is_refused(self):
        with open(self.base) as f:
            text = f.read()
        self.assertIn('"verdict": "PASS"', text)
        dup = self.path("dup.json")
        with open(dup, "w") as f:
            f.write(text.replace('"verdict": "PASS"', '"verdict": "FAIL", "verdict": "PASS"', 1))
        r = run(["report", "validate", dup])
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertIn("/verdict: the key appears twice in one object", r.stdout)
        for args in (["report", "compare", self.base, dup], ["report", "compare", dup, self.base],
                     ["report", "render", dup]):
            with self.subTest(args=args):
                r = run(args)
                self.assertEqual(r.returncode, 2, r.stdout + r.stderr)
                self.assertIn("the key at /verdict appears twice in one object", r.stderr)
                self.assertEqual(r.stdout, "")

    def test_render_refuses_one_file_for_both_pages_under_two_spellings(self):
        page = self.path("page.md")
        with open(page, "w") as f:
            f.write("old")
        os.symlink(page, self.path("link.md"))
        for md in ("./" + os.path.relpath(page), self.path("link.md")):
            with self.subTest(markdown=md):
                r = run(["report", "render", self.base, "--html", page, "--markdown", md])
                self.assertEqual(r.returncode, 2, r.stderr)
                self.assertIn("both name", r.stderr)
                with open(page) as f:
                    self.assertEqual(f.read(), "old")

    def test_markdown_escapes_the_command_and_verdict_of_a_report(self):
        with open(self.base) as f:
            doc = json.load(f)
        doc["command"] = "buckets<script>x</script>[a](javascript:b)"
        doc["verdict"] = "<b>PASS</b>"
        bad = self.write_json("cmd.json", doc)
        r = run(["report", "render", bad])
        self.assertEqual(r.returncode, 0, r.stderr)
        heading = r.stdout.splitlines()[0]
        self.assertNotIn("<script>", heading)
        self.assertNotIn("<b>", heading)
        self.assertNotIn("[a](", heading)
        self.assertIn("&lt;script&gt;", heading)

    def test_a_report_name_of_250_bytes_is_written(self):
        long_json = self.path("r" * 245 + ".json")
        p = run(["buckets", "--model", "mlp", "--json", long_json])
        self.assertEqual(p.returncode, 0, p.stderr)
        load(long_json)
        long_html = self.path("h" * 245 + ".html")
        r = run(["report", "render", long_json, "--html", long_html])
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertTrue(os.path.isfile(long_html))
        self.assertEqual(sorted(os.listdir(self.dir)),
                         sorted(["base.json", os.path.basename(long_json), os.path.basename(long_html)]))


if __name__ == "__main__":
    main()
