"""The HTML report in headless Chromium: every report renders, validates
against the schema, loads with no console error, and its screenshot is not
blank (also at phone width). Standard library only; exits 77 (skip) when
Chromium is not installed.

Environment: DDPDIAG_BIN (the ddpdiag binary), DDPDIAG_CHROMIUM (the browser,
default: chromium on PATH), DDPDIAG_EXAMPLES_DIR (when set, the generated
report, its HTML and screenshot are copied there: reports/examples/).
"""
import glob
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import unittest
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from validate_hook import validate  # noqa: E402

BIN = os.environ.get("DDPDIAG_BIN", "ddpdiag")
CHROMIUM = os.environ.get("DDPDIAG_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
FIXTURES = sorted(glob.glob(os.path.join(HERE, "fixtures", "*.json")))

# Flags that keep the browser off the network and quiet: every host name
# resolves to nothing and every proxied request goes to a closed port.
CHROMIUM_FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                  "--disable-extensions", "--disable-background-networking", "--disable-sync",
                  "--disable-component-update", "--host-resolver-rules=MAP * ~NOTFOUND",
                  "--proxy-server=127.0.0.1:9", "--disable-dev-shm-usage",
                  "--enable-logging=stderr", "--v=0", "--hide-scrollbars"]


def read_png(path):
    """(width, height, rows of pixel tuples) of an 8-bit RGB/RGBA PNG."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, width = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            width, height, depth, ctype, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and ctype in (2, 6) and interlace == 0, (depth, ctype, interlace)
            bpp = 3 if ctype == 2 else 4
        elif kind == b"IDAT":
            idat += body
        elif kind == b"IEND":
            break
    raw = zlib.decompress(idat)
    stride = width * bpp
    rows, prev, i = [], bytearray(stride), 0
    for _ in range(height):
        ftype, line = raw[i], bytearray(raw[i + 1:i + 1 + stride])
        i += 1 + stride
        for x in range(stride):
            a = line[x - bpp] if x >= bpp else 0
            b = prev[x]
            c = prev[x - bpp] if x >= bpp else 0
            if ftype == 1:
                line[x] = (line[x] + a) & 0xFF
            elif ftype == 2:
                line[x] = (line[x] + b) & 0xFF
            elif ftype == 3:
                line[x] = (line[x] + (a + b) // 2) & 0xFF
            elif ftype == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                line[x] = (line[x] + pred) & 0xFF
        rows.append(bytes(line))
        prev = line
    return width, height, bpp, rows


def pixel_stats(path):
    """(distinct colours, fraction of pixels that are not near-white)."""
    width, height, bpp, rows = read_png(path)
    colours, dark, total = set(), 0, 0
    for row in rows[::2]:
        for x in range(0, width * bpp, bpp * 2):
            px = row[x:x + 3]
            colours.add(px)
            total += 1
            if min(px) < 235:
                dark += 1
    return len(colours), dark / max(1, total)


def screenshot(html, png, width, height, workdir):
    args = [CHROMIUM] + CHROMIUM_FLAGS + [
        "--user-data-dir=" + os.path.join(workdir, "profile"),
        "--screenshot=" + png, "--window-size=%d,%d" % (width, height), "file://" + html]
    p = subprocess.run(args, capture_output=True, text=True, timeout=120)
    return p


def generate_report(workdir):
    """A real report from the binary, or None when it cannot run here."""
    out = os.path.join(workdir, "allreduce-test.json")
    try:
        p = subprocess.run([BIN, "allreduce-test", "--nproc", "2", "-b", "8", "-e", "1M", "-f", "4",
                            "--json", out], capture_output=True, text=True, timeout=180)
    except (OSError, subprocess.TimeoutExpired) as e:
        print("allreduce-test could not run (%s); using the committed fixture" % e)
        return None
    if p.returncode != 0 or not os.path.exists(out):
        print("allreduce-test exited %d; using the committed fixture\n%s" % (p.returncode, p.stderr[-2000:]))
        return None
    return out


class HtmlReportInChromium(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.workdir = tempfile.mkdtemp(prefix="ddpdiag-html-")
        real = generate_report(cls.workdir)
        cls.generated = real is not None
        cls.reports = ([real] if real else []) + FIXTURES

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.workdir, ignore_errors=True)

    def test_every_report_validates(self):
        for path in self.reports:
            with self.subTest(report=os.path.basename(path)):
                validate(path, BIN)

    def test_pages_load_without_console_errors_and_are_not_blank(self):
        for path in self.reports:
            name = os.path.splitext(os.path.basename(path))[0] + ("-generated" if path not in FIXTURES else "")
            with self.subTest(report=name):
                html = os.path.join(self.workdir, name + ".html")
                md = os.path.join(self.workdir, name + ".md")
                p = subprocess.run([BIN, "report", "render", path, "--html", html, "--markdown", md],
                                   capture_output=True, text=True, timeout=60)
                self.assertEqual(p.returncode, 0, p.stderr)
                with open(html) as f:
                    page = f.read()
                self.assertNotIn("<script", page)
                self.assertIn("<svg", page)
                with open(md) as f:
                    self.assertIn("## ddpdiag ", f.read())
                for width, height, label in ((1000, 1400, "desktop"), (390, 1400, "phone")):
                    png = os.path.join(self.workdir, "%s-%s.png" % (name, label))
                    r = screenshot(html, png, width, height, self.workdir)
                    self.assertEqual(r.returncode, 0, r.stderr[-3000:])
                    log = r.stderr
                    console = [l for l in log.splitlines() if "CONSOLE" in l or "Uncaught" in l]
                    self.assertEqual(console, [], "console messages:\n" + "\n".join(console))
                    self.assertTrue(os.path.exists(png), "no screenshot written:\n" + log[-3000:])
                    colours, ink = pixel_stats(png)
                    # A blank or broken page is one or two colours; the report has
                    # text, tables and charts in several colours.
                    self.assertGreater(colours, 40, "%s: only %d colours" % (png, colours))
                    self.assertGreater(ink, 0.01, "%s: nearly all white" % png)
                if path not in FIXTURES or not self.generated and name == "allreduce-test":
                    self.save_example(path, html, os.path.join(self.workdir, name + "-desktop.png"))

    def test_the_checks_would_catch_a_broken_page(self):
        # The two assertions above are only worth something if this browser
        # reports console errors on stderr and a blank page counts as blank.
        bad = os.path.join(self.workdir, "broken.html")
        with open(bad, "w") as f:
            f.write("<!DOCTYPE html><html><body><script>console.error('boom'); no_such_fn();"
                    "</script></body></html>")
        png = os.path.join(self.workdir, "broken.png")
        r = screenshot(bad, png, 400, 300, self.workdir)
        self.assertEqual(r.returncode, 0, r.stderr[-3000:])
        console = [l for l in r.stderr.splitlines() if "CONSOLE" in l or "Uncaught" in l]
        self.assertTrue(any("boom" in l for l in console), r.stderr[-3000:])
        self.assertTrue(any("Uncaught" in l for l in console), r.stderr[-3000:])
        colours, ink = pixel_stats(png)
        self.assertLessEqual(colours, 40)
        self.assertLessEqual(ink, 0.01)

    def save_example(self, json_path, html, png):
        dest = os.environ.get("DDPDIAG_EXAMPLES_DIR")
        if not dest:
            return
        os.makedirs(dest, exist_ok=True)
        for src, ext in ((json_path, ".json"), (html, ".html"), (png, ".png")):
            shutil.copyfile(src, os.path.join(dest, "allreduce-test" + ext))


if __name__ == "__main__":
    if not CHROMIUM:
        print("SKIP: chromium is not installed (scripts/install-deps.sh installs it)")
        sys.exit(77)
    unittest.main(verbosity=2)
