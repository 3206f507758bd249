"""`ddpdiag model` against measured runs: an allreduce-test sweep at 2 Gloo
ranks is fitted, the predictions for 3 and 4 ranks are compared with
allreduce-test measured at 3 and 4 ranks, and a fit from 2 + 3 ranks is
compared with 4. Every prediction is recomputed here from the fitted alpha
and beta and the ring formula, every error is printed, and the
bandwidth-bound sizes (>= 4 MiB, CHECK_MIN_BYTES) must be within
TOLERANCE_FACTOR of the measurement either way.

Why not from 1 MiB, the model's default: 4 Gloo ranks on 2 cores take about
5 ms a call at every size up to 1 MiB (the scheduler-tick floor of
over-subscribed ranks, the same for bare Gloo and torch), so 1 MiB at 4 ranks
measures that floor, not bandwidth: it came out 3.2x and 3.5x above a 2-rank
fit in both rounds of one CI run.

TOLERANCE_FACTOR, from what was measured on this 2-core machine while other
builds ran (load 6 to 11): 3 and 4 Gloo ranks are over-subscribed and a burst
of load can double one size's time. Over eleven rounds of sweeps the worst
point of a round was mostly 1.1x to 2.2x off, in three rounds 3.0x to 5.1x
(a quiet 2-rank sweep gives a small alpha, and 4 over-subscribed ranks then
pay milliseconds per ring step at 1 MiB); typical errors are 10 % to 50 %,
mostly under-predicted at 4 ranks. The limit is 3, and a round outside it is
measured once more (fresh sweeps at 2, 3 and 4 ranks): a model wrong in kind
fails both rounds, a burst of load rarely hits two.

Also: the planning prediction at 64 ranks on 8 hosts with given links, its
bucket caps and recommendation, the report against the schema and through
the renderer, and input that must be refused (exit 2)."""
import json
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(__file__))
from common import load, main, run, tmp_json, unused_layer_layout  # noqa: E402

TOLERANCE_FACTOR = 3.0
CHECK_MIN_BYTES = 4 << 20
SWEEP = ["-b", "4K", "-e", "16M", "-f", "4", "-n", "10", "-w", "3", "-c", "1"]


def ring_s(alpha_s, beta, p, n):
    return 2 * (p - 1) * alpha_s + 2 * (p - 1) / p * n * beta


class ModelVsMeasured(unittest.TestCase):
    sweeps = {}

    @classmethod
    def measure(cls):
        for n in (2, 3, 4):
            path = cls.sweeps.get(n) or tmp_json()
            p = run(["allreduce-test", "--nproc", str(n), "--json", path] + SWEEP)
            if p.returncode != 0:
                raise AssertionError("allreduce-test --nproc %d: exit %d\n%s%s"
                                     % (n, p.returncode, p.stdout, p.stderr))
            cls.sweeps[n] = path

    @classmethod
    def setUpClass(cls):
        cls.measure()

    @classmethod
    def tearDownClass(cls):
        for path in cls.sweeps.values():
            if os.path.exists(path):
                os.unlink(path)

    def model(self, args, expect_rc=(0,)):
        path = tmp_json()
        p = run(["model"] + args + ["--json", path])
        print(p.stdout, end="")
        self.assertIn(p.returncode, expect_rc, p.stdout + p.stderr)
        rep = load(path)
        os.unlink(path)
        self.assertEqual(rep["command"], "model")
        return p, rep

    def measured(self, n, min_bytes):
        """(bytes, time_s) per size >= min_bytes of the n-rank sweep: the
        faster of the out-of-place and in-place blocks, as the model reads
        them."""
        with open(self.sweeps[n]) as f:
            rep = json.load(f)
        out = []
        for row in rep["results"]["sizes"]:
            times = [row[b]["time_us"] for b in ("out_of_place", "in_place") if row[b] is not None]
            if row["bytes"] >= min_bytes:
                out.append((row["bytes"], min(times) * 1e-6))
        return out

    def one_round(self, fit_from, predict):
        """Fits, predicts, checks the report's figures exactly; returns the
        worst error factor and whether the model's own check passed."""
        args = [self.sweeps[n] for n in fit_from]
        for n in predict:
            args += ["--check-against", self.sweeps[n]]
        p, rep = self.model(args + ["--max-error-factor", str(TOLERANCE_FACTOR),
                                    "--check-min-bytes", str(CHECK_MIN_BYTES)], expect_rc=(0, 1))
        res = rep["results"]
        fits = {f["series"]: f for f in res["fits"]}
        self.assertEqual(list(fits), ["backend"])
        fit = fits["backend"]
        self.assertEqual(fit["formula"], "ring")
        self.assertEqual(fit["world_sizes"], list(fit_from))
        self.assertEqual(fit["points"], 7 * len(fit_from))  # 4K .. 16M
        self.assertGreater(fit["bandwidth_gbps"], 0)
        self.assertGreaterEqual(fit["alpha_us"], 0)
        alpha_s, beta = fit["alpha_us"] * 1e-6, fit["beta_s_per_byte"]
        print("fit from %s ranks: alpha %.1f us, %.3f GB/s, R^2 %.4f, rms relative error %.1f%%"
              % ("+".join(map(str, fit_from)), fit["alpha_us"], fit["bandwidth_gbps"],
                 fit["r_squared"], fit["rms_rel_error_pct"]))

        rows = res["validation"]
        expected = [(n, b, t) for n in predict for (b, t) in self.measured(n, CHECK_MIN_BYTES)]
        self.assertEqual(len(rows), len(expected))
        worst = 1.0
        for row, (n, b, t) in zip(rows, expected):
            self.assertEqual((row["world_size"], row["bytes"]), (n, b))
            pred = ring_s(alpha_s, beta, n, b)
            self.assertAlmostEqual(row["predicted_us"], pred * 1e6, delta=1e-6 * pred * 1e6)
            self.assertAlmostEqual(row["measured_us"], t * 1e6, delta=1e-9 * t * 1e6)
            factor = max(pred / t, t / pred)
            self.assertAlmostEqual(row["error_factor"], factor, places=6)
            self.assertEqual(row["within_tolerance"], factor <= TOLERANCE_FACTOR)
            worst = max(worst, factor)
            print("fit from %s, predict %d ranks, %8d B: measured %9.1f us, predicted %9.1f us, "
                  "error %+6.1f%% (factor %.2f)"
                  % ("+".join(map(str, fit_from)), n, b, t * 1e6, pred * 1e6,
                     100 * (pred / t - 1), factor))
        self.assertAlmostEqual(res["validation_worst_error_factor"], worst, places=6)
        check = [c for c in rep["checks"] if c["name"] == "prediction_error"][0]
        self.assertEqual(check["status"], "pass" if worst <= TOLERANCE_FACTOR else "fail", check)
        return worst

    def check_predictions(self, fit_from, predict):
        worst = self.one_round(fit_from, predict)
        if worst > TOLERANCE_FACTOR:
            print("worst factor %.2f is over %g: measuring the sweeps once more" % (worst, TOLERANCE_FACTOR))
            type(self).measure()
            worst = self.one_round(fit_from, predict)
        self.assertLessEqual(worst, TOLERANCE_FACTOR,
                             "predictions from %s ranks off by %.2fx in two rounds of sweeps"
                             % (fit_from, worst))

    def test_fit_2_predict_3_4(self):
        self.check_predictions((2,), (3, 4))

    def test_fit_2_3_predict_4(self):
        self.check_predictions((2, 3), (4,))

    def test_the_check_can_fail(self):
        # No two measurements agree to 0.01 %: with that tolerance over every
        # size the comparison must fail, and say where.
        p, rep = self.model([self.sweeps[2], "--check-against", self.sweeps[4],
                             "--max-error-factor", "1.0001", "--check-min-bytes", "4K"],
                            expect_rc=(1,))
        check = [c for c in rep["checks"] if c["name"] == "prediction_error"][0]
        self.assertEqual(check["status"], "fail")
        self.assertEqual(rep["verdict"], "FAIL")
        self.assertIn("OUTSIDE", p.stdout)
        self.assertTrue(any(not v["within_tolerance"] for v in rep["results"]["validation"]))

    def test_plan_64_ranks_on_8_hosts(self):
        args = [self.sweeps[2], "--world-size", "64", "--ranks-per-host", "8",
                "--inter-gbps", "1.25", "--inter-latency-us", "50", "-b", "1M", "-e", "64M",
                "--model", "resnet50", "--caps", "1,5,25,100", "--compute-gbps", "1",
                "--max-fit-error", "1000"]  # the fit's quality gate is not under test here
        p, rep = self.model(args)
        res = rep["results"]
        self.assertEqual(rep["verdict"], "PASS")
        self.assertEqual(res["prediction"]["hosts"], 8)
        links = {l["algorithm"]: l for l in res["prediction"]["links"]}
        self.assertEqual(sorted(links), ["gather", "ring", "tree"])
        self.assertEqual(links["ring"]["fit_series"], "backend")
        self.assertTrue(links["ring"]["measured"])
        self.assertFalse(links["tree"]["measured"])
        self.assertAlmostEqual(links["ring"]["inter"]["bandwidth_gbps"], 1.25)
        self.assertAlmostEqual(links["ring"]["inter"]["alpha_us"], 50)
        self.assertEqual(links["ring"]["inter"]["source"], "flags")
        self.assertEqual(links["ring"]["intra"]["source"], "fit")
        fit = res["fits"][0]
        self.assertAlmostEqual(links["ring"]["intra"]["alpha_us"], fit["alpha_us"])
        # Ring at 64 MiB: 126 steps of 1 MiB, each at the slower link's pace.
        n = 64 << 20
        intra = fit["alpha_us"] * 1e-6 + n / 64 * fit["beta_s_per_byte"]
        inter = 50e-6 + n / 64 / 1.25e9
        ring = [s for s in res["sizes"] if s["algorithm"] == "ring" and s["bytes"] == n][0]
        self.assertAlmostEqual(ring["time_us"], 126 * max(intra, inter) * 1e6, delta=1e-3)
        self.assertEqual(sorted({s["algorithm"] for s in res["sizes"]}), ["gather", "ring", "tree"])
        self.assertEqual(len(res["sizes"]), 3 * 4)  # 1M, 4M, 16M, 64M
        # The bucket caps: ResNet-50's buckets as `ddpdiag buckets` builds
        # them, and the recommendation is the least exposed time.
        caps = res["caps"]
        self.assertEqual([c["bucket_cap_mb"] for c in caps], [1, 5, 25, 100])
        for c in caps:
            self.assertEqual(sum(c["bucket_bytes"]), res["total_bytes"])
            self.assertGreater(c["exposed_comm_time_us"], 0)
            self.assertLessEqual(c["exposed_comm_time_us"], c["comm_time_us"] + 1e-6)
        best = min(caps, key=lambda c: c["exposed_comm_time_us"])
        self.assertEqual(res["recommended_cap_mb"], best["bucket_cap_mb"])
        self.assertIn("# Recommendation: bucket_cap_mb=%g" % best["bucket_cap_mb"], p.stdout)
        path = tmp_json()
        bk = run(["buckets", "--model", "resnet50", "--bucket-cap-mb", "25", "--json", path])
        self.assertEqual(bk.returncode, 0, bk.stderr)
        with open(path) as f:
            expect = [b["bytes"] for b in json.load(f)["results"]["buckets"]]
        os.unlink(path)
        self.assertEqual([c for c in caps if c["bucket_cap_mb"] == 25][0]["bucket_bytes"], expect)

    def test_predictions_for_other_worlds_are_not_compared(self):
        # The world a model run predicts for is a setting: a run for 512
        # ranks is not a regression of a run for 8.
        a, b = tmp_json(), tmp_json()
        for path, extra in ((a, ["--world-size", "8"]),
                            (b, ["--world-size", "512", "--ranks-per-host", "8"])):
            p = run(["model", self.sweeps[2], "--model", "mlp", "--max-fit-error", "1000",
                     "--json", path] + extra)
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        r = run(["report", "compare", a, b])
        self.assertIn("predicted_world_size 8 (base) vs 512 (new)", r.stdout)
        self.assertIn("0 regressed", r.stdout)
        self.assertEqual(r.returncode, 0, r.stdout)
        os.unlink(a)
        os.unlink(b)

    def test_a_report_over_an_input_is_refused(self):
        # --json naming a report model reads would destroy it: refused, the
        # input kept, also when the line has a typo.
        with open(self.sweeps[2]) as f:
            before = f.read()
        same = os.path.join(os.path.dirname(self.sweeps[2]), ".", os.path.basename(self.sweeps[2]))
        for extra in (["--world-size", "8"], ["--world-size", "x"],
                      ["--check-against", self.sweeps[3], "--world-size", "8"]):
            with self.subTest(extra=extra):
                p = run(["model", self.sweeps[2], "--json", same] + extra)
                self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
                with open(self.sweeps[2]) as f:
                    self.assertEqual(f.read(), before)
        p = run(["model", self.sweeps[2], "--markdown", self.sweeps[2], "--world-size", "8"])
        self.assertIn("--markdown %s is also an input model reads" % self.sweeps[2], p.stderr)
        p = run(["model", self.sweeps[2], "--check-against", self.sweeps[3], "--json", self.sweeps[3],
                 "--world-size", "8"])
        self.assertIn("--json %s is also the file --check-against reads" % self.sweeps[3], p.stderr)

    def test_checked_runs_are_placed_as_they_ran(self):
        # A world of one does no all_reduce: its points are left out, not
        # predicted as 0 us and failed.
        one = tmp_json()
        p = run(["allreduce-test", "--nproc", "1", "-b", "1M", "-e", "4M", "-n", "2", "-w", "1",
                 "--json", one])
        self.assertEqual(p.returncode, 0, p.stderr)
        self.addCleanup(os.unlink, one)
        p, rep = self.model([self.sweeps[2], "--check-against", one, "--max-fit-error", "1000"])
        self.assertIn("point(s) at world size 1 left out", p.stdout)
        check = [c for c in rep["checks"] if c["name"] == "prediction_error"][0]
        self.assertEqual(check["status"], "skip", check)
        self.assertEqual(rep["results"]["validation_skipped"][0]["reason"], "world size 1")
        # The 4-rank run as if on two hosts: 0,1 on a and 2,3 on b is 2 hosts
        # of 2; 0,1,2 on a and 3 on b is not a layout the model predicts.
        with open(self.sweeps[4]) as f:
            doc = json.load(f)
        for hosts, expect in ((["a", "a", "b", "b"], 2), (["a", "a", "a", "b"], None)):
            with self.subTest(hosts=hosts):
                doc["world"]["hosts"] = sorted(set(hosts))
                for r in doc["world"]["ranks"]:
                    r["host"] = hosts[r["rank"]]
                moved = tmp_json()
                with open(moved, "w") as f:
                    json.dump(doc, f)
                self.addCleanup(os.unlink, moved)
                p, rep = self.model([self.sweeps[2], "--check-against", moved, "--max-fit-error", "1000",
                                     "--check-min-bytes", "1M"], expect_rc=(0, 1))
                if expect:
                    self.assertTrue(rep["results"]["validation"])
                    self.assertEqual({v["hosts"] for v in rep["results"]["validation"]}, {expect})
                else:
                    self.assertEqual(rep["results"].get("validation"), [])
                    self.assertIn("ranks 0..3 sit unevenly (3 on a, 1 on b)",
                                  rep["results"]["validation_skipped"][0]["reason"])

    def test_checked_against_its_own_input_or_two_paces_is_refused(self):
        import shutil
        copy = tmp_json()
        shutil.copy(self.sweeps[2], copy)
        for other in (self.sweeps[2], copy):
            p = run(["model", self.sweeps[2], "--world-size", "8", "--check-against", other])
            self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
            self.assertIn("can only pass", p.stderr)
            # Refused before the fit is printed, as if a result followed.
            self.assertNotIn("# predictions", p.stdout)
            self.assertNotIn("alpha", p.stdout)
        os.unlink(copy)
        for extra in (["--compute-gbps", "5", "--backward-ms", "100"],
                      ["--compute-gbps", "5", "--backward-ms", "0"], ["--backward-ms", "1e30"],
                      ["--compute-gbps", "1e-12"]):
            p = run(["model", self.sweeps[2], "--world-size", "8", "--model", "mlp"] + extra)
            self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        # A link of absurd speed or latency (a unit or an exponent mistyped)
        # is refused by name, not turned into predictions of 300 digits.
        for flag, value, why in (("--inter-latency-us", "1e300", "over 10 s"),
                                 ("--intra-gbps", "1e-300", "slower than"),
                                 ("--inter-gbps", "1e30", "faster than")):
            p = run(["model", self.sweeps[2], "--world-size", "16", "--ranks-per-host", "8",
                     "--model", "mlp", flag, value])
            self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
            self.assertIn(flag, p.stderr)
            self.assertIn(why, p.stderr)

    def test_backward_ms_alone_sets_the_pace(self):
        # --backward-ms on its own (--compute-gbps keeps its default): the
        # rate is the model's bytes over that duration.
        p, rep = self.model([self.sweeps[2], "--world-size", "8", "--model", "mlp",
                             "--backward-ms", "200", "--max-fit-error", "1000"])
        res = rep["results"]
        self.assertAlmostEqual(res["compute_gbps"], res["total_bytes"] / 0.2 / 1e9, places=9)
        p, rep = self.model([self.sweeps[2], "--world-size", "8", "--model", "mlp",
                             "--compute-gbps", "0", "--backward-ms", "200",
                             "--max-fit-error", "1000"])
        self.assertAlmostEqual(rep["results"]["compute_gbps"],
                               rep["results"]["total_bytes"] / 0.2 / 1e9, places=9)
        # --backward-ms 0 is an instant backward, as --compute-gbps 0: the
        # same plan, not the default 1 GB/s.
        plans = []
        for pace in (["--backward-ms", "0"], ["--compute-gbps", "0"]):
            p, rep = self.model([self.sweeps[2], "--world-size", "8", "--model", "mlp",
                                 "--max-fit-error", "1000"] + pace)
            self.assertEqual(rep["results"]["compute_gbps"], 0, pace)
            plans.append(rep["results"]["caps"])
        self.assertEqual(plans[0], plans[1])

    def test_a_model_with_an_unused_layer_needs_its_ddp_setting(self):
        # aux is never reached by backward: refused as DDP without
        # find_unused_parameters would stop; with either setting, the plan
        # has DDP's buckets for it, and the setting is recorded.
        layout = unused_layer_layout()
        try:
            args = [self.sweeps[2], "--world-size", "8", "--model", layout, "--caps", "0.05",
                    "--first-bucket-mb", "0.05", "--max-fit-error", "1000"]
            p = run(["model"] + args)
            self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
            self.assertIn("2 ('aux.weight'), 3 ('aux.bias')", p.stderr)
            self.assertIn("--static-graph", p.stderr)
            comm = {}
            for flag in ("--find-unused-parameters", "--static-graph"):
                p, rep = self.model(args + [flag])
                res = rep["results"]
                self.assertEqual((res["find_unused_parameters"], res["static_graph"]),
                                 (flag == "--find-unused-parameters", flag == "--static-graph"))
                cap = res["caps"][0]
                # the buckets `buckets` shows for the same flags
                path = tmp_json()
                b = run(["buckets", "--model", layout, "--bucket-cap-mb", "0.05", "--first-bucket-mb", "0.05",
                         "--json", path, flag])
                self.assertEqual(b.returncode, 0, b.stderr)
                self.assertEqual(cap["bucket_bytes"], [x["bytes"] for x in load(path)["results"]["buckets"]])
                os.unlink(path)
                comm[flag] = cap["comm_time_us"]
            # find_unused_parameters all-reduces its used map too.
            self.assertGreater(comm["--find-unused-parameters"], comm["--static-graph"])
            p = run(["model", self.sweeps[2], "--world-size", "8", "--static-graph"])
            self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
            self.assertIn("--static-graph needs --model", p.stderr)
        finally:
            os.unlink(layout)

    def test_torch2_bucket_cap_mb_list_and_skip_all_reduce_unused_params(self):
        # A bucket_cap_mb_list is one more candidate, planned on the buckets
        # `buckets --bucket-cap-mb-list` shows; skip_all_reduce_unused_params
        # takes the unused layer's buckets out of the communication.
        layout = unused_layer_layout()
        try:
            args = [self.sweeps[2], "--world-size", "8", "--model", layout, "--caps", "0.05,25",
                    "--first-bucket-mb", "0.05", "--max-fit-error", "1000", "--static-graph",
                    "--bucket-cap-mb-list", "0.0001", "--bucket-cap-mb-list", "0.001,0.2"]
            p, rep = self.model(args)
            res = rep["results"]
            caps = res["caps"]
            self.assertEqual([c.get("bucket_cap_mb_list") for c in caps], [None, None, [0.0001], [0.001, 0.2]])
            self.assertEqual([c["bucket_cap_mb"] for c in caps], [0.05, 25, 0.0001, 0.2])
            for c in caps[2:]:
                path = tmp_json()
                b = run(["buckets", "--model", layout, "--static-graph", "--json", path, "--bucket-cap-mb-list",
                         ",".join(repr(x) for x in c["bucket_cap_mb_list"])])
                self.assertEqual(b.returncode, 0, b.stderr)
                self.assertEqual(c["bucket_bytes"], [x["bytes"] for x in load(path)["results"]["buckets"]])
                os.unlink(path)
            self.assertIn("  bucket_cap_mb_list [0.001, 0.2]", p.stdout)
            best = min(caps, key=lambda c: (c["exposed_comm_time_us"], "bucket_cap_mb_list" in c))
            self.assertEqual(res["recommended_cap_mb_list"], best.get("bucket_cap_mb_list"))
            # With the skip: a bucket a tensor at 0.0001 MiB, the two of aux
            # (unused, last with static_graph) take no all_reduce.
            p, skipped = self.model(args + ["--skip-all-reduce-unused-params"])
            s = skipped["results"]
            self.assertTrue(s["skip_all_reduce_unused_params"])
            one_each, one_each_skipped = caps[2], s["caps"][2]
            self.assertEqual(one_each_skipped["bucket_bytes"], one_each["bucket_bytes"])
            self.assertLess(one_each_skipped["comm_time_us"], one_each["comm_time_us"])
            p = run(["model", self.sweeps[2], "--world-size", "8", "--bucket-cap-mb-list", "1,25"])
            self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
            self.assertIn("--bucket-cap-mb-list needs --model", p.stderr)
            # DDP_SET_LAST_BUCKET_CAP=1: planned on the buckets
            # `buckets --set-last-bucket-cap` shows, for a cap and a list.
            p, last = self.model(args + ["--set-last-bucket-cap"])
            self.assertTrue(last["results"]["set_last_bucket_cap"])
            self.assertIn("DDP_SET_LAST_BUCKET_CAP=1", p.stdout)
            moved = 0
            for c, plain in zip(last["results"]["caps"], caps):
                path = tmp_json()
                sizes = (["--bucket-cap-mb-list", ",".join(repr(x) for x in c["bucket_cap_mb_list"])]
                         if "bucket_cap_mb_list" in c else
                         ["--bucket-cap-mb", repr(c["bucket_cap_mb"]), "--first-bucket-mb", "0.05"])
                b = run(["buckets", "--model", layout, "--static-graph", "--set-last-bucket-cap", "--json", path] +
                        sizes)
                self.assertEqual(b.returncode, 0, b.stderr)
                self.assertEqual(c["bucket_bytes"], [x["bytes"] for x in load(path)["results"]["buckets"]])
                os.unlink(path)
                moved += c["bucket_bytes"] != plain["bucket_bytes"]
            self.assertGreater(moved, 0)
            p = run(["model", self.sweeps[2], "--world-size", "8", "--set-last-bucket-cap"])
            self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
            self.assertIn("--set-last-bucket-cap needs --model", p.stderr)
        finally:
            os.unlink(layout)

    def test_fits_float_sums_only(self):
        # allreduce-test -d all: the other dtypes move other element sizes at
        # other speeds; the fit keeps the float sums, and a report without
        # them is refused by name.
        every, ints = tmp_json(), tmp_json()
        # Sizes where time grows with the size even on a loaded machine.
        p = run(["allreduce-test", "--nproc", "2", "-b", "256K", "-e", "16M", "-f", "4", "-n", "3",
                 "-w", "1", "-d", "all", "--json", every])
        self.assertEqual(p.returncode, 0, p.stderr)
        p = run(["allreduce-test", "--nproc", "2", "-b", "4K", "-e", "256K", "-f", "4", "-n", "3",
                 "-w", "1", "-d", "int8", "--json", ints])
        self.assertEqual(p.returncode, 0, p.stderr)
        path = tmp_json()
        p = run(["model", every, "--world-size", "8", "--max-fit-error", "1000", "--json", path])
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        fits = load(path)["results"]["fits"]
        self.assertEqual(fits[0]["points"], 4)  # 256K, 1M, 4M, 16M of float, no other dtype
        p = run(["model", ints, "--world-size", "8"])
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        self.assertIn("no float sum all_reduce rows", p.stderr)
        for f in (every, ints, path):
            os.unlink(f)

    def test_report_renders(self):
        path, html = tmp_json(), tmp_json() + ".html"
        p = run(["model", self.sweeps[2], "--world-size", "16", "--model", "mlp",
                 "--max-fit-error", "1000", "--json", path])
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        load(path)
        r = run(["report", "render", path, "--html", html])
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(html) as f:
            page = f.read()
        self.assertIn("ddpdiag model", page)
        self.assertIn("Bucket sweep", page)  # the caps chart
        # The page over the report it renders is refused; the report stays.
        for flag in ("--html", "--markdown"):
            r = run(["report", "render", path, flag, path])
            self.assertEqual(r.returncode, 2, r.stderr)
            self.assertIn("is the report to render", r.stderr)
            load(path)
        os.unlink(path)
        os.unlink(html)

    def test_refusals(self):
        # One size only: latency and bandwidth cannot be told apart.
        one = tmp_json()
        p = run(["allreduce-test", "--nproc", "2", "-b", "64K", "-e", "64K", "-n", "2", "-w", "1",
                 "--no-in-place", "--json", one])
        self.assertEqual(p.returncode, 0, p.stderr)
        path = tmp_json()
        p = run(["model", one, "--world-size", "8", "--json", path])
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        self.assertIn("1 measured point(s), at least 3 are needed", p.stderr)
        rep = load(path)  # the error is in the report too
        self.assertEqual(rep["verdict"], "ERROR")
        self.assertEqual(rep["error"]["kind"], "usage")
        os.unlink(path)
        # Four points, all of one size at one world size: four reports (as of
        # four runs; the same one given four times is refused below).
        with open(one) as f:
            doc = json.load(f)
        copies = []
        for i in range(3):
            copies.append(tmp_json())
            doc["duration_s"] = doc["duration_s"] + 1
            with open(copies[-1], "w") as f:
                json.dump(doc, f)
        p = run(["model", one] + copies + ["--world-size", "8"])
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        self.assertIn("cannot separate latency from bandwidth", p.stderr)
        # The same report twice must not count twice, by path or by content:
        # one.json + one3.json + one.json would otherwise pass "fewer than 3".
        same_content = tmp_json()
        with open(one) as src, open(same_content, "w") as dst:
            dst.write(src.read())
        for args, message in (
                ([one, copies[0], one], f"{one} is given twice (also as {one})"),
                ([one, copies[0], os.path.join(os.path.dirname(one), ".", os.path.basename(one))],
                 "is given twice"),
                ([one, copies[0], same_content], f"{same_content} has the same content as {one}"),
        ):
            with self.subTest(args=args):
                p = run(["model"] + args + ["--world-size", "8"])
                self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
                self.assertIn(message, p.stderr)
                self.assertIn("its points would count twice", p.stderr)
        for f in [one, same_content] + copies:
            os.unlink(f)
        for args, message in (
                ([self.sweeps[2], "--world-size", "10", "--ranks-per-host", "4"],
                 "--ranks-per-host 4 does not divide the world size 10"),
                ([self.sweeps[2], "--world-size", "5000"], "is not in 2..4096"),
                ([self.sweeps[2], "--world-size", "0"], "--world-size 0 is not in 2..4096"),
                ([self.sweeps[2], "--world-size", "-8"], "--world-size -8 is not in 2..4096"),
                ([self.sweeps[2]], "nothing to predict"),
                # The best cap is predicted at --world-size only: not ignored.
                ([self.sweeps[2], "--check-against", self.sweeps[3], "--model", "resnet50"],
                 "--model needs --world-size"),
                ([self.sweeps[2], "--world-size", "8", "-b", "1M", "-e", "1K"],
                 "--maxbytes 1K is below --minbytes 1M (swap them)"),
                ([self.sweeps[2], "--world-size", "8", "-b", "0"],
                 "--minbytes 0 is below one float element (4 bytes)"),
                ([self.sweeps[2], "--world-size", "8", "-b", "0", "-e", "2"],
                 "--minbytes 0 is below one float element (4 bytes)"),
                (["/nonexistent/report.json", "--world-size", "8"], "/nonexistent/report.json"),
        ):
            with self.subTest(args=args):
                p = run(["model"] + args)
                self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
                self.assertIn(message, p.stderr)
        # The bucket part's flags are checked before any table is printed.
        for args, message in (
                ([self.sweeps[2], "--world-size", "8", "--model", "nonsense"],
                 "--model 'nonsense' is neither a built-in preset"),
                ([self.sweeps[2], "--world-size", "8", "--model", "mlp", "--caps", "0,-1"],
                 "--caps: '0' is not a positive number"),
                ([self.sweeps[2], "--world-size", "8", "--caps", "1,25"], "--caps needs --model"),
                ([self.sweeps[2], "--world-size", "8", "--max-fit-error", "-5"],
                 "--max-fit-error: must be a number >= 0"),
        ):
            with self.subTest(args=args):
                p = run(["model"] + args)
                self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
                self.assertIn(message, p.stderr)
                self.assertEqual(p.stdout, "")


def synthetic_sweep(path, world_size, alpha_s=10e-6, gbps=1.0, sizes=(4096, 16384, 65536, 262144,
                                                                    1 << 20, 4 << 20),
                    command="allreduce-test", rows_world_sizes=None):
    """A report whose times are exactly the ring formula on one link (alpha,
    bandwidth), at the world size given (or, as dp-vs-ring writes, at each of
    rows_world_sizes): the fit must recover the link, and a prediction of a
    run on the same link must match it."""
    rows = []
    for w in rows_world_sizes or [world_size]:
        for n in sizes:
            t_us = (ring_s(alpha_s, 1e-9 / gbps, w, n) if w > 1 else 1.0 + n * 1e-6) * 1e6
            row = {"bytes": n, "count": n // 4, "dtype": "float", "op": "sum",
                   "out_of_place": {"time_us": t_us, "wrong": 0}}
            if rows_world_sizes:
                row["world_size"] = w
                row["algorithm"] = "backend"
            rows.append(row)
    doc = {"schema": "ddpdiag.report/1", "command": command,
           "world": {"size": world_size, "hosts": ["h"],
                     "ranks": [{"rank": r, "host": "h"} for r in range(world_size)]},
           "results": {"collective": "all_reduce", "sizes": rows}}
    with open(path, "w") as f:
        json.dump(doc, f)
    return doc


class ModelOfSyntheticReports(unittest.TestCase):
    """Exact reports made here (no measurement): what the model does with
    flags and inputs that are about other parts of the run."""

    def setUp(self):
        self.files = []

    def tearDown(self):
        for f in self.files:
            if os.path.exists(f):
                os.unlink(f)

    def sweep(self, *args, **kwargs):
        path = tmp_json()
        self.files.append(path)
        synthetic_sweep(path, *args, **kwargs)
        return path

    def test_the_check_against_a_run_here_uses_the_fitted_link_not_the_planned_cluster(self):
        # The links given for the cluster at --world-size describe that
        # cluster; the check predicts a run on the hosts it ran on, whose
        # link is the fitted one. A run exactly on the fitted link passes.
        two, three, out = self.sweep(2), self.sweep(3), tmp_json()
        self.files.append(out)
        p = run(["model", two, "--world-size", "64", "--ranks-per-host", "8", "--intra-gbps", "100",
                 "--intra-latency-us", "1", "--inter-gbps", "12.5", "--check-against", three,
                 "--json", out])
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        res = load(out)["results"]
        self.assertTrue(res["validation"])
        for v in res["validation"]:
            self.assertAlmostEqual(v["predicted_us"], v["measured_us"], delta=1e-6 * v["measured_us"])
        # The planned cluster does use the given links: its prediction at 64
        # ranks is not the fitted link's.
        p2 = run(["model", two, "--world-size", "64", "--ranks-per-host", "8", "--json", out])
        self.assertEqual(p2.returncode, 0, p2.stdout + p2.stderr)
        self.assertNotEqual(load(out)["results"]["sizes"], res["sizes"])
        self.assertEqual(res["prediction"]["links"][0]["intra"]["source"], "flags")

    def test_link_flags_fit_range_and_bucket_algorithm_are_settings(self):
        # Predictions made with other links, another fit range or another
        # bucket all_reduce are not a regression of the default run: the
        # settings are named and the rows listed as missing and new.
        base = tmp_json()
        self.files.append(base)
        common = ["model", self.sweep(2), "--model", "mlp", "--max-fit-error", "1000", "--world-size", "16",
                  "--ranks-per-host", "8"]
        p = run(common + ["--json", base])
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        rep = load(base)
        for field in ("intra_gbps", "intra_latency_us", "inter_gbps", "inter_latency_us", "fit_max_bytes"):
            self.assertIsNone(rep["results"][field], field)
        self.assertEqual(rep["results"]["fit_min_bytes"], 0)
        for extra, note in ((["--inter-gbps", "0.001"], "inter_gbps not given (base) vs 0.001 (new)"),
                            (["--intra-latency-us", "5000"], "intra_latency_us not given (base) vs 5000 (new)"),
                            (["--bucket-algorithm", "gather"], "bucket_algorithm ring (base) vs gather (new)"),
                            (["--fit-max-bytes", "64K"], "fit_max_bytes not given (base) vs 64 KiB (new)")):
            with self.subTest(extra=extra):
                new = tmp_json()
                self.files.append(new)
                p = run(common + extra + ["--json", new])
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                r = run(["report", "compare", base, new])
                self.assertIn(note, r.stdout)
                self.assertIn("0 regressed", r.stdout)
                self.assertEqual(r.returncode, 0, r.stdout)
                self.assertEqual(run(["report", "compare", "--fail-on-missing", base, new]).returncode, 1)

    def test_link_and_size_flags_without_a_world_size_are_refused(self):
        two, three = self.sweep(2), self.sweep(3)
        for flag, value in (("--intra-gbps", "100"), ("--inter-latency-us", "5"),
                            ("--ranks-per-host", "8"), ("-e", "1G")):
            with self.subTest(flag=flag):
                p = run(["model", two, "--check-against", three, flag, value])
                self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
                self.assertIn("needs --world-size", p.stderr)
        for flag, value in (("--compute-gbps", "3"), ("--first-bucket-mb", "2"),
                            ("--bucket-algorithm", "tree"), ("--backward-ms", "5")):
            with self.subTest(flag=flag):
                p = run(["model", two, "--world-size", "8", flag, value])
                self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
                self.assertIn("%s needs --model" % flag, p.stderr)

    def test_points_at_world_size_1_are_left_out_of_the_fit(self):
        # dp-vs-ring --world-sizes 1,2 writes rows at a world of one.
        mixed = self.sweep(2, command="dp-vs-ring", rows_world_sizes=[1, 2])
        out = tmp_json()
        self.files.append(out)
        p = run(["model", mixed, "--world-size", "8", "--json", out])
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn("6 point(s) at world size 1 left out of the fit", p.stdout)
        res = load(out)["results"]
        self.assertEqual(res["inputs"][0]["points_world_size_1"], 6)
        self.assertEqual(res["fits"][0]["points"], 6)
        self.assertEqual(res["fits"][0]["world_sizes"], [2])
        self.assertAlmostEqual(res["fits"][0]["alpha_us"], 10.0, places=6)
        only_one = self.sweep(2, command="dp-vs-ring", rows_world_sizes=[1])
        p = run(["model", only_one, "--world-size", "8"])
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        self.assertIn("every measured point is at world size 1", p.stderr)

    def test_damaged_numbers_are_refused_not_wrapped(self):
        for change, message in (
                (lambda d: d["world"].__setitem__("size", 10 ** 10),
                 "world.size 10000000000 is not a world size"),
                (lambda d: d["world"].__setitem__("size", -2), "world.size -2 is not a world size"),
                (lambda d: d["results"]["sizes"][-1].__setitem__("bytes", 1e30),
                 "no all_reduce moves more than"),
                (lambda d: d["results"]["sizes"][0].__setitem__("world_size", 7),
                 "a row at world size 7, outside the run's world of 1..2 ranks"),
        ):
            path = self.sweep(2)
            with open(path) as f:
                doc = json.load(f)
            change(doc)
            with open(path, "w") as f:
                json.dump(doc, f)
            with self.subTest(message=message):
                p = run(["model", path, "--world-size", "8"])
                self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
                self.assertIn(message, p.stderr)

    def test_rows_it_cannot_read_are_named_not_dropped_silently(self):
        # An edited report: a negative size, a null row, a zero time. The
        # fit goes on without them, and says so (it once fitted 4 points
        # of 6 without a word).
        path = self.sweep(2)
        with open(path) as f:
            doc = json.load(f)
        rows = doc["results"]["sizes"]
        total = len(rows)
        rows[0]["bytes"] = -4096
        rows[1] = None
        for block in ("out_of_place", "in_place"):
            if block in rows[2]:
                rows[2][block]["time_us"] = 0
        with open(path, "w") as f:
            json.dump(doc, f)
        out = tmp_json()
        self.files.append(out)
        p = run(["model", path, "--world-size", "8", "--json", out])
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn("3 row(s) left out of the fit: 2 without a positive bytes, 1 without a "
                      "positive time_us", p.stdout)
        res = load(out)["results"]
        self.assertEqual(res["inputs"][0]["rows_left_out"], 3)
        self.assertEqual(res["fits"][0]["points"], total - 3)

    def test_outputs_and_check_reports_are_refused_before_the_fit_prints(self):
        two = self.sweep(2)
        same = tmp_json()
        self.files.append(same)
        p = run(["model", two, "--world-size", "8", "--json", same, "--markdown", same])
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        self.assertIn("name the same file", p.stderr)
        self.assertFalse(os.path.exists(same))
        kept = tmp_json()
        self.files.append(kept)
        with open(kept, "w") as f:
            f.write("{}")
        os.chmod(kept, 0o444)
        p = run(["model", two, "--world-size", "8", "--json", kept])
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        self.assertIn("read-only", p.stderr)
        with open(kept) as f:
            self.assertEqual(f.read(), "{}")
        # A report with no all_reduce rows to check against: refused before
        # the fit's table is printed, naming --check-against.
        other = tmp_json()
        self.files.append(other)
        with open(other, "w") as f:
            json.dump({"command": "buckets", "world": {"size": 2}, "results": {}}, f)
        p = run(["model", two, "--check-against", other])
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        self.assertIn("--check-against %s: a 'buckets' report has no all_reduce timings" % other,
                      p.stderr)
        self.assertIn("during model.check", p.stderr)
        self.assertEqual(p.stdout, "")

    def test_a_sweep_whose_time_does_not_grow_is_refused(self):
        # Equal times at every size: rounding leaves beta a tiny number,
        # negative (777.7 us) or positive (333.3 us); neither is a link (the
        # positive one would be 1.5e17 GB/s).
        for t_us in (333.3, 777.7):
            path = tmp_json()
            self.files.append(path)
            with open(path, "w") as f:
                json.dump({"command": "allreduce-test", "world": {"size": 2},
                           "results": {"sizes": [{"bytes": 1024 * 4 ** i, "in_place": {"time_us": t_us}}
                                                 for i in range(8)]}}, f)
            with self.subTest(t_us=t_us):
                p = run(["model", path, "--world-size", "64", "--ranks-per-host", "8", "-b", "1G",
                         "-e", "1G"])
                self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
                self.assertIn("time does not grow with message size", p.stderr)
                self.assertNotIn("prediction", p.stdout)

    def test_flags_of_parts_not_asked_for_are_refused_before_the_fit_prints(self):
        two, three = self.sweep(2), self.sweep(3)
        for args, message in (
                (["--world-size", "8", "--max-error-factor", "3"],
                 "--max-error-factor needs --check-against"),
                (["--world-size", "8", "--check-min-bytes", "4M"],
                 "--check-min-bytes needs --check-against"),
                (["--world-size", "12", "--ranks-per-host", "5"],
                 "--ranks-per-host 5 does not divide the world size 12"),
                (["--world-size", "4", "--ranks-per-host", "8"],
                 "--ranks-per-host 8 exceeds the world size 4"),
                (["--check-against", three, "--ranks-per-host", "8"],
                 "--ranks-per-host needs --world-size"),
        ):
            with self.subTest(args=args):
                p = run(["model", two] + args)
                self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
                self.assertIn(message, p.stderr)
                self.assertEqual(p.stdout, "")
                self.assertNotIn("--ranks-per-host 8 --ranks-per-host", p.stderr)

    def test_each_half_of_a_link_says_where_it_came_from(self):
        two, out = self.sweep(2), tmp_json()
        self.files.append(out)
        p = run(["model", two, "--world-size", "16", "--ranks-per-host", "8", "--inter-gbps", "12.5",
                 "--intra-latency-us", "2", "--json", out])
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        for link in load(out)["results"]["prediction"]["links"]:
            self.assertEqual((link["inter"]["source"], link["inter"]["bandwidth_source"],
                              link["inter"]["latency_source"]), ("flags+fit", "flags", "fit"))
            self.assertEqual((link["intra"]["source"], link["intra"]["bandwidth_source"],
                              link["intra"]["latency_source"]), ("flags+fit", "fit", "flags"))
            self.assertAlmostEqual(link["inter"]["bandwidth_gbps"], 12.5)
            self.assertAlmostEqual(link["inter"]["alpha_us"], 10.0, places=6)  # the fit's
        p = run(["model", two, "--world-size", "16", "--ranks-per-host", "8", "--inter-gbps", "12.5",
                 "--inter-latency-us", "5", "--json", out])
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        for link in load(out)["results"]["prediction"]["links"]:
            self.assertEqual(link["inter"]["source"], "flags")
            self.assertEqual(link["intra"]["source"], "fit")

    def test_refusals_say_what_to_change(self):
        two, three = self.sweep(2), self.sweep(3)
        # One size at several world sizes: the gather and tree formulas
        # cannot separate alpha from beta; the message says why.
        one_size = [self.sweep(w, sizes=(1 << 20,)) for w in (2, 3, 4)]
        p = run(["model"] + one_size + ["--world-size", "8", "--backend-as", "tree"])
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        self.assertIn("every point has the same message size (1048576 B) (the tree formula", p.stderr)
        no_sweep = self.sweep(2, command="bucket-sweep", sizes=())
        p = run(["model", no_sweep, "--world-size", "8"])
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        self.assertIn("rerun bucket-sweep without --no-size-sweep", p.stderr)
        for args, message in (
                (["--max-error-factor", "inf"], "--max-error-factor must be a finite number >= 1"),
                (["--check-against", three], "--check-against %s is given twice" % three),
        ):
            with self.subTest(args=args):
                p = run(["model", two, "--check-against", three] + args)
                self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
                self.assertIn(message, p.stderr)


if __name__ == "__main__":
    main()
