"""torch's TCPStore for the rendezvous comparison in bench/compare_peers.sh.

  serve    host torch.distributed.TCPStore(is_master=True) on --port, print
           "ready PORT" on stdout, serve until stdin closes.
  clients  the same rendezvous as ddpdiag_rendezvous_bench, with torch's own
           client: N threads, each opens a TCPStore(is_master=False), SETs
           its key, ADDs 1 to a counter; the one that reaches N SETs "done";
           all WAIT for "done". The threads are started first and parked
           at a gate (as a job's ranks run before they meet); time from the
           gate's opening to the last WAIT's return; one JSON object on stdout:
           {"clients":N,"times_s":[...],"connect_s":[...]}.

Usage: /usr/bin/python3 bench/rendezvous_torch.py serve --port P
       /usr/bin/python3 bench/rendezvous_torch.py clients --port P [--clients 1024]
           [--repeats 3] [--prefix KEY]
"""
import argparse
import datetime
import json
import resource
import sys
import threading
import time


def raise_fd_limit(need):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))


def serve(a):
    import torch.distributed as dist

    # torch's client opens two connections per client.
    raise_fd_limit(4 * 1024 + 256)
    store = dist.TCPStore(a.host, a.port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=a.timeout))
    print("ready %d" % a.port)
    sys.stdout.flush()
    sys.stdin.read()  # until the driver closes our stdin
    del store


def clients(a):
    import torch.distributed as dist

    raise_fd_limit(2 * a.clients + 256)
    timeout = datetime.timedelta(seconds=a.timeout)
    times, connects = [], []
    for rep in range(a.repeats):
        base = "%s/%d/" % (a.prefix, rep)
        connected = [0.0] * a.clients
        done = [0.0] * a.clients
        held = [None] * a.clients
        errors = []

        gate = threading.Event()

        def client(i):
            gate.wait()
            try:
                s = dist.TCPStore(a.host, a.port, is_master=False, timeout=timeout)
                connected[i] = time.perf_counter()
                s.set(base + "client/%d" % i, "1")
                if s.add(base + "arrived", 1) == a.clients:
                    s.set(base + "done", "1")
                s.wait([base + "done"])
                done[i] = time.perf_counter()
                held[i] = s  # closed after the clock stops
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append("client %d: %s" % (i, e))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(a.clients)]
        for i, t in enumerate(threads):
            try:
                t.start()
            except RuntimeError as e:  # out of threads: let the started ones go, then fail
                gate.set()
                for u in threads[:i]:
                    u.join()
                raise SystemExit("rendezvous_torch: could not start client thread %d of %d: %s"
                                 % (i, a.clients, e))
        t0 = time.perf_counter()
        gate.set()
        for t in threads:
            t.join()
        if errors:
            raise SystemExit("rendezvous_torch: %s" % errors[0])
        times.append(max(done) - t0)
        connects.append(max(connected) - t0)
        del held
    print(json.dumps({"clients": a.clients, "times_s": times, "connect_s": connects}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=["serve", "clients"])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--clients", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prefix", default="rdzv_torch")
    ap.add_argument("--timeout", type=int, default=120)
    a = ap.parse_args()
    serve(a) if a.mode == "serve" else clients(a)


if __name__ == "__main__":
    main()
