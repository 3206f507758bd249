"""`ddpdiag store` subcommands as a user runs them: what they say and the exit
codes when the store is not there, speaks the other protocol, or a key never
comes, and the flags they refuse. One process per case, on loopback, each
bounded by a short --timeout; no torch needed (a 1.13 store is played by a
socket that closes the connection on the 2.x handshake, as 1.13's daemon
does). Standard library only."""
import calendar
import ctypes
import signal
import os
import socket
import struct
import subprocess
import sys
import threading
import time
import unittest

sys.path.insert(0, os.path.dirname(__file__))
from common import BIN, clean_env, free_port, load, main, readline_within, run, tmp_json  # noqa: E402

SO_ATTACH_FILTER = 26  # linux/filter.h; not in Python's socket module


def silent_socket():
    """A bound loopback socket with a filter that drops every packet: it
    refuses connections until listen() is called, then drops their SYNs (a
    firewall that drops packets), so connecting to it times out."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    insn = ctypes.create_string_buffer(struct.pack("HBBI", 0x06, 0, 0, 0))  # BPF_RET|BPF_K 0
    # The kernel copies the program during the call.
    s.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER,
                 struct.pack("HL", 1, ctypes.addressof(insn)))
    return s


class Torch113Like:
    """Accepts connections and closes each after its first bytes: what torch
    1.13's daemon does with the 2.x handshake (it reads a SET whose key length
    is absurd and drops the connection)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            c.settimeout(5)
            try:
                c.recv(64)
            except OSError:
                pass
            c.close()

    def close(self):
        self.sock.close()


class StoreServe:
    """`ddpdiag store serve` on a free port, stopped on exit."""

    def __enter__(self):
        self.proc = subprocess.Popen([BIN, "store", "serve", "--host", "127.0.0.1", "--port", "0"],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=clean_env())
        line = readline_within(self.proc, 30)
        if " serving on " not in line:
            self.proc.kill()
            raise AssertionError("ddpdiag store serve did not start: %r %r" %
                                 (line, self.proc.communicate()[1]))
        self.addr = line.split(" serving on ")[1].split()[0]
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.communicate(timeout=10)


class Ping(unittest.TestCase):
    def test_refused_says_nothing_listens(self):
        port = free_port()
        p = run(["store", "ping", "127.0.0.1:%d" % port, "--timeout", "0.5"], timeout=30)
        self.assertEqual(p.returncode, 3, p.stdout + p.stderr)
        self.assertIn("unreachable", p.stdout)
        self.assertIn("connection refused: nothing listens on 127.0.0.1:%d" % port, p.stdout)
        self.assertRegex(p.stdout, r"after \d+ attempt\(s\) in \d+ ms")
        self.assertIn("not up yet", p.stdout)
        self.assertNotIn("firewall may drop", p.stdout)

    def test_report_times_cover_the_ping(self):
        # Nothing listens: the ping retries for the whole --timeout, and the
        # report's start and duration must cover that wait, not the writing.
        port = free_port()
        path = tmp_json()
        t0 = time.time()
        p = run(["store", "ping", "127.0.0.1:%d" % port, "--timeout", "2", "--json", path], timeout=30)
        wall = time.time() - t0
        self.assertEqual(p.returncode, 3, p.stdout + p.stderr)
        rep = load(path)
        os.unlink(path)
        self.assertGreaterEqual(rep["duration_s"], 1.5, rep["duration_s"])
        self.assertLessEqual(rep["duration_s"], wall + 0.05)
        started = calendar.timegm(time.strptime(rep["started_at"][:19], "%Y-%m-%dT%H:%M:%S")) + \
            float(rep["started_at"][19:-1] or 0)
        self.assertLess(started - t0, 1.0, rep["started_at"])  # not at the end, 2 s later
        # The attempts the message counts are the report's too.
        import re
        said = re.search(r"after (\d+) attempt\(s\)", p.stdout + p.stderr)
        self.assertTrue(said, p.stdout + p.stderr)
        self.assertGreater(rep["results"]["connect_attempts"], 1)
        self.assertEqual(rep["results"]["connect_attempts"], int(said.group(1)))

    def test_refused_then_out_of_time_is_still_refused(self):
        # Refused for 2 s, then SYNs dropped until the 4 s deadline: the last
        # attempt times out, as one that starts with ~0 ms left does against
        # a remote host that refuses. (2 s: ample for the process to start
        # and make its first attempt on a loaded machine.)
        s = silent_socket()
        port = s.getsockname()[1]
        timer = threading.Timer(2.0, lambda: s.listen(8))
        timer.start()
        try:
            p = run(["store", "ping", "127.0.0.1:%d" % port, "--timeout", "4"], timeout=30)
        finally:
            timer.join()
            s.close()
        self.assertEqual(p.returncode, 3, p.stdout + p.stderr)
        self.assertIn("connection refused: nothing listens on 127.0.0.1:%d" % port, p.stdout)
        self.assertNotIn("timed out", p.stdout)
        self.assertNotIn("firewall may drop", p.stdout)

    def test_dropped_packets_are_a_timeout_with_the_firewall_hint(self):
        s = silent_socket()
        s.listen(8)
        try:
            p = run(["store", "ping", "127.0.0.1:%d" % s.getsockname()[1], "--timeout", "0.5"],
                    timeout=30)
        finally:
            s.close()
        self.assertEqual(p.returncode, 3, p.stdout + p.stderr)
        self.assertIn("unreachable", p.stdout)
        self.assertIn("connection timed out", p.stdout)
        self.assertIn("firewall", p.stdout)

    def test_other_protocol_is_reachable_not_unreachable(self):
        srv = Torch113Like()
        path = tmp_json()
        try:
            p = run(["store", "ping", "127.0.0.1:%d" % srv.port, "--protocol", "2.x", "--timeout", "2",
                     "--json", path], timeout=30)
            self.assertEqual(p.returncode, 3, p.stdout + p.stderr)
            self.assertNotIn("unreachable", p.stdout)
            self.assertIn("127.0.0.1:%d: reachable, but it does not speak the torch-2.x store protocol"
                          % srv.port, p.stdout)
            self.assertIn("--protocol 1.13", p.stdout)
            rep = load(path)
            self.assertTrue(rep["results"]["reachable"])
            self.assertFalse(rep["results"]["answered"])
            self.assertIsNone(rep["results"]["protocol"])
            self.assertEqual(rep["error"]["phase"], "store.handshake")
        finally:
            srv.close()
            if os.path.exists(path):
                os.unlink(path)

    def test_a_listener_that_never_answers_times_out_under_a_second(self):
        # A store answers at once: silence through --timeout 1 s or more is a
        # program that is not a store (exit 3); under a second it is a
        # timeout (exit 4), as store get and set take it.
        with socket.socket() as srv:
            srv.bind(("127.0.0.1", 0))
            srv.listen(64)  # never accepts: room for every connection the runs make
            port = srv.getsockname()[1]
            path = tmp_json()
            try:
                p = run(["store", "ping", "127.0.0.1:%d" % port, "--timeout", "0.5", "--json", path],
                        timeout=30)
                self.assertEqual(p.returncode, 4, p.stdout + p.stderr)
                self.assertIn("reachable, but it did not answer within --timeout 0.5 s", p.stdout)
                self.assertEqual(load(path)["error"]["exit_code"], 4)
                g = run(["store", "get", "k", "--addr", "127.0.0.1:%d" % port, "--timeout", "0.5"],
                        timeout=30)
                self.assertEqual(g.returncode, 4, g.stdout + g.stderr)
                p = run(["store", "ping", "127.0.0.1:%d" % port, "--timeout", "1.5"], timeout=30)
                self.assertEqual(p.returncode, 3, p.stdout + p.stderr)
                self.assertIn("speaks neither", p.stdout)
                # The same with a protocol forced. 2.x: silence is no sign of
                # the other version (a 1.13 store closes the connection). 1.13
                # has no handshake: a torch 2.x store may stay silent on its
                # requests, so that protocol is named as the suspect.
                for proto in ("2.x", "1.13"):
                    with self.subTest(protocol=proto):
                        p = run(["store", "ping", "127.0.0.1:%d" % port, "--timeout", "0.5",
                                 "--protocol", proto], timeout=30)
                        self.assertEqual(p.returncode, 4, p.stdout + p.stderr)
                        self.assertIn("reachable, but it did not answer within --timeout 0.5 s", p.stdout)
                        p = run(["store", "ping", "127.0.0.1:%d" % port, "--timeout", "1.5",
                                 "--protocol", proto], timeout=30)
                        self.assertEqual(p.returncode, 3, p.stdout + p.stderr)
                        if proto == "2.x":
                            self.assertIn("another program probably holds this port", p.stdout)
                            self.assertNotIn("is it a torch", p.stdout)
                        else:
                            self.assertIn("on the torch 1.13 protocol that --protocol 1.13 asked for",
                                          p.stdout)
            finally:
                if os.path.exists(path):
                    os.unlink(path)

    def test_a_server_that_answers_garbage_is_no_store_under_a_forced_protocol(self):
        # 1.13 has no handshake: with --protocol 1.13 the client still asks
        # one request and checks the reply, so a program that answers with
        # bytes no store sends is named (exit 3), not pinged as a store with
        # -1 keys, nor written to with `store set` (exit 0).
        for reply in (b"\xff" * 64, b"SSH-2.0-OpenSSH_9.2\r\n"):
            srv = socket.socket()
            srv.bind(("127.0.0.1", 0))
            srv.listen(8)
            port = srv.getsockname()[1]

            def serve():
                while True:
                    try:
                        c, _ = srv.accept()
                    except OSError:
                        return
                    c.settimeout(5)
                    try:
                        c.recv(64)
                        c.sendall(reply)
                    except OSError:
                        pass
                    c.close()

            threading.Thread(target=serve, daemon=True).start()
            try:
                with self.subTest(reply=reply[:8]):
                    for args in (["store", "ping", "127.0.0.1:%d" % port],
                                 ["store", "set", "k", "v", "--addr", "127.0.0.1:%d" % port]):
                        p = run(args + ["--protocol", "1.13", "--timeout", "2"], timeout=30)
                        self.assertEqual(p.returncode, 3, p.stdout + p.stderr)
                        self.assertIn("speaks neither the torch 2.x nor the torch 1.13 store protocol",
                                      p.stdout + p.stderr)
            finally:
                srv.close()

    def test_a_store_frozen_while_get_waits_ends_near_the_timeout(self):
        # The wait runs out, and the cancel of it meets a frozen store: it
        # gets a second, not another --timeout.
        with StoreServe() as s:
            p = subprocess.Popen([BIN, "store", "get", "k", "--addr", s.addr, "--timeout", "3"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env())
            t0 = time.monotonic()
            time.sleep(1)
            os.kill(s.proc.pid, signal.SIGSTOP)
            try:
                _, err = p.communicate(timeout=30)
            finally:
                os.kill(s.proc.pid, signal.SIGCONT)
            self.assertEqual(p.returncode, 4, err)
            self.assertLess(time.monotonic() - t0, 5.5, err)

    def test_keys_refuses_the_1_13_protocol_under_each_of_its_names(self):
        # ddpdiag's server speaks both protocols: the refusal is of the one
        # asked for, however it is spelt, and says so.
        with StoreServe() as s:
            for name in ("1.13", "v1", "torch-1.13"):
                p = run(["store", "keys", "--addr", s.addr, "--protocol", name], timeout=30)
                self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
                self.assertIn("--protocol %s: the torch 1.13 protocol has no way to list keys"
                              % name, p.stderr)

    def test_answering_store_is_reachable(self):
        with StoreServe() as s:
            path = tmp_json()
            p = run(["store", "ping", s.addr, "--count", "3", "--json", path], timeout=30)
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            self.assertIn("%s: reachable\n" % s.addr, p.stdout)
            rep = load(path)
            os.unlink(path)
            self.assertTrue(rep["results"]["reachable"])
            self.assertTrue(rep["results"]["answered"])


class GetAndServe(unittest.TestCase):
    def test_get_of_a_key_never_set(self):
        with StoreServe() as s:
            t0 = time.monotonic()
            p = run(["store", "get", "--addr", s.addr, "missing", "--timeout", "1"], timeout=30)
            self.assertEqual(p.returncode, 4, p.stdout + p.stderr)
            self.assertLess(time.monotonic() - t0, 10)
            self.assertIn("key 'missing' was not set in the store at %s within 1 s" % s.addr, p.stderr)
            self.assertIn("hint:", p.stderr)
            self.assertIn("ddpdiag store set", p.stderr)
            for word in ("WORLD_SIZE", "ranks", "missing: missing"):
                self.assertNotIn(word, p.stderr)
            # The key is still fetched once it is set.
            self.assertEqual(run(["store", "set", "--addr", s.addr, "k", "v"], timeout=30).returncode, 0)
            p = run(["store", "get", "--addr", s.addr, "k", "--timeout", "5"], timeout=30)
            self.assertEqual((p.returncode, p.stdout), (0, "v\n"), p.stderr)
            # A key over 8 KiB (torch 2.x's limit) is refused by name, up front.
            p = run(["store", "set", "--addr", s.addr, "k" * 9000, "v"], timeout=30)
            self.assertEqual(p.returncode, 2, p.stderr)
            self.assertIn("the key is 9000 bytes", p.stderr)
            # 8192 characters are 8193 bytes on the wire with torch's '/'.
            p = run(["store", "set", "--addr", s.addr, "k" * 8192, "v"], timeout=30)
            self.assertEqual(p.returncode, 2, p.stderr)
            self.assertIn("at most 8191 (8192 with the '/'", p.stderr)
            p = run(["store", "set", "--addr", s.addr, "k" * 8191, "v"], timeout=30)
            self.assertEqual(p.returncode, 0, p.stderr)
            # torch 1.13's protocol has no such limit: a key of 9000 bytes
            # goes out and comes back.
            p = run(["store", "set", "--addr", s.addr, "--protocol", "1.13", "k" * 9000, "v9"], timeout=30)
            self.assertEqual(p.returncode, 0, p.stderr)
            p = run(["store", "get", "--addr", s.addr, "--protocol", "1.13", "k" * 9000], timeout=30)
            self.assertEqual((p.returncode, p.stdout), (0, "v9\n"), p.stderr)
            # An IPv6 address with a port glued on is refused, not dialled
            # as a host name on the default port for --timeout.
            p = run(["store", "ping", "::1:29615"], timeout=30)
            self.assertEqual(p.returncode, 2, p.stderr)
            self.assertIn("[::1]:29500", p.stderr)

    def test_serve_out_of_file_descriptors_neither_spins_nor_hangs(self):
        # 40 clients against a store whose process may hold 24 files: it
        # says so once, does not spin on the listening socket, serves again
        # once they close, and stops on SIGTERM. (It spun at 100% CPU and
        # ignored SIGTERM.)
        import resource
        port = free_port()

        def low_limit():
            resource.setrlimit(resource.RLIMIT_NOFILE, (24, 24))

        proc = subprocess.Popen([BIN, "store", "serve", "--port", str(port)], env=clean_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=low_limit)
        try:
            self.assertIn("serving", readline_within(proc, 10))
            clients = []
            for _ in range(40):
                c = socket.socket()
                c.settimeout(2)
                try:
                    c.connect(("127.0.0.1", port))
                except OSError:
                    pass
                clients.append(c)
            time.sleep(1)

            def cpu_ticks():
                with open(f"/proc/{proc.pid}/stat") as f:
                    return sum(int(x) for x in f.read().rsplit(")", 1)[1].split()[11:13])

            t0 = cpu_ticks()
            time.sleep(2)
            # 100 ticks a second is one core spinning.
            self.assertLess(cpu_ticks() - t0, 40)
            for c in clients:
                c.close()
            time.sleep(0.5)
            p = run(["store", "ping", "127.0.0.1:%d" % port, "--timeout", "5"], timeout=30)
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            proc.terminate()
            _, err = proc.communicate(timeout=10)
            self.assertEqual(proc.returncode, 0, err)
            self.assertIn("run out of file descriptors", err)
            self.assertIn("ulimit -n is 24", err)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()

    def test_serve_keeps_serving_when_its_log_cannot_be_written(self):
        # stderr on a full disk (or a log pipe whose reader ended): a refused
        # request is logged as well as it can be, and the store goes on
        # serving. It used to end (exit 5) at the first refusal.
        with open("/dev/full", "w") as full:
            proc = subprocess.Popen([BIN, "store", "serve", "--host", "127.0.0.1", "--port", "0"],
                                    stdout=subprocess.PIPE, stderr=full, text=True, env=clean_env())
        try:
            line = readline_within(proc, 30)
            self.assertIn(" serving on ", line)
            port = int(line.split(" serving on ")[1].split()[0].rsplit(":", 1)[1])
            # A 2.x handshake, then an op code no protocol has: refused.
            with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
                c.sendall(b"\x00" + struct.pack("<I", 0x3C85F7CE) + b"\x63")
                self.assertEqual(c.recv(1), b"")
            time.sleep(0.2)
            self.assertIsNone(proc.poll(), "the store ended after a refusal it could not log")
            p = run(["store", "ping", "127.0.0.1:%d" % port, "--timeout", "5"], timeout=30)
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        finally:
            proc.terminate()
            proc.communicate(timeout=10)

    def test_serve_refuses_ports_outside_0_to_65535(self):
        for port in ("70000", "-1", "65536"):
            with self.subTest(port=port):
                proc = subprocess.Popen([BIN, "store", "serve", "--host", "127.0.0.1", "--port", port],
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        env=clean_env())
                try:
                    out, err = proc.communicate(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    out, err = proc.communicate()
                    self.fail("store serve --port %s kept serving: %s" % (port, out))
                self.assertEqual(proc.returncode, 2, out + err)
                self.assertIn("--port=%s is not a valid TCP port (0..65535" % port, err)
                self.assertIn("hint:", err)
                self.assertNotIn("serving", out)

    def test_client_ports_are_checked_too(self):
        p = run(["store", "ping", "127.0.0.1:99999"], timeout=30)
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        self.assertIn("bad port", p.stderr)


if __name__ == "__main__":
    if not BIN or not os.access(BIN, os.X_OK):
        print("DDPDIAG_BIN=%r is not an executable ddpdiag" % BIN)
        sys.exit(2)
    main()
