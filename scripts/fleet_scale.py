#!/usr/bin/env python3
"""The mesh at fleet scale, simulated on one machine (issue 19, BENCHMARKS.md
"Fleet scale"): real etcd, R real routers, W real synthetic worker
processes, and N worker registrations multiplexed over those W processes.

Plaintext only, and that is the point of the method: a router checks a
worker's identity through the worker's TLS certificate (its name must be the
registration's worker_id), and one process has one certificate, so under
mTLS the N-W extra registrations would rightly stay unhealthy. In plaintext
the router dials each registration's address and trusts the Status answer (it
does not compare StatusResponse.worker_id with the registration), so each id
gets its own channel, its own Status poller and its own place in P2C, which is
what a router does for N real workers. What this does not simulate: N worker
leases (the W processes' registrations share W leases) and N separate hosts.

For each N it measures, per router: the time from a registration's etcd put
to the first request routed to it (a Generate pinned to a version only that
worker serves, retried every 2 ms); the time from a deregistration (key
deleted) and from a SIGKILL of a worker process until the router no longer
lists the worker as ready; router RSS and CPU at rest; the Status polls the
workers answer per second (their llm_status_requests_total) and those each
router makes and puts off (its llm_router_status_polls_total), at rest and
under load (--load-clients streams per router, --load-s seconds); etcd's gRPC
traffic by method.

Usage: fleet_scale.py --bin target/release --sizes 100,500,1000 --routers 4
           [--status-poll-budget B] [--label after] [--plot-dir DIR [--compare old.json]]
       fleet_scale.py --plot-only a.json b.json --plot-dir DIR
Prints a table and writes JSON to --out; with --plot-dir, a PNG of each
figure against N (needs matplotlib; without it the plot is skipped, saying so).
"""
import argparse
import base64
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

MODEL = "fleet"
PREFIX = "/tokenmesh"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(what, check, timeout=60.0, every=0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(every)
    raise RuntimeError(f"timed out waiting for {what}")


def http_ok(url):
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def scrape(url):
    """Prometheus text -> {series: value}."""
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


def stubs(repo):
    """Generated Python stubs of proto/tokenmesh/v1, in a temporary folder."""
    out = tempfile.mkdtemp(prefix="fleet-stubs-")
    from grpc_tools import protoc

    rc = protoc.main([
        "protoc", f"-I{repo}/proto", f"--python_out={out}", f"--grpc_python_out={out}",
        "tokenmesh/v1/tokenmesh.proto",
    ])
    if rc != 0:
        raise RuntimeError("protoc failed")
    sys.path.insert(0, out)
    from tokenmesh.v1 import tokenmesh_pb2, tokenmesh_pb2_grpc

    return out, tokenmesh_pb2, tokenmesh_pb2_grpc


class Etcd:
    """A single-node etcd on free loopback ports, spoken to through its JSON
    gateway (no etcd client library in the test venv)."""

    def __init__(self, tmp):
        self.port, peer = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(os.path.join(tmp, "etcd.log"), "w")
        self.proc = subprocess.Popen([
            shutil.which("etcd") or "etcd", "--name", "fleet",
            "--data-dir", os.path.join(tmp, "etcd"),
            "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
            "--listen-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-cluster", f"fleet=http://127.0.0.1:{peer}",
        ], stdout=self.log, stderr=subprocess.STDOUT)
        self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        self.lock = threading.Lock()
        wait_until("etcd", lambda: http_ok(self.url + "/health"))

    def call(self, path, body):
        with self.lock:
            self.conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            resp = self.conn.getresponse()
            data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"etcd {path}: {resp.status} {data[:200]!r}")
        return json.loads(data)

    @staticmethod
    def b64(s):
        return base64.b64encode(s.encode()).decode()

    def grant(self, ttl):
        return self.call("/v3/lease/grant", {"TTL": ttl})["ID"]

    def keepalive(self, lease):
        self.call("/v3/lease/keepalive", {"ID": lease})

    def put(self, key, value, lease=None):
        body = {"key": self.b64(PREFIX + key), "value": self.b64(value)}
        if lease:
            body["lease"] = lease
        self.call("/v3/kv/put", body)

    def delete(self, key):
        self.call("/v3/kv/deleterange", {"key": self.b64(PREFIX + key)})

    def metrics(self):
        return scrape(self.url + "/metrics")

    def stop(self):
        self.proc.kill()
        self.proc.wait()


class Proc:
    """A mesh binary, started with a free --listen and --metrics-listen, up
    once its plaintext `probe` answers 200 (a router's /readyz waits for a
    ready worker, so routers are probed on /healthz)."""

    def __init__(self, tmp, name, argv, probe="/readyz"):
        self.name = name
        self.port, self.mport = free_port(), free_port()
        self.addr = f"127.0.0.1:{self.port}"
        self.log = open(os.path.join(tmp, f"{name}.log"), "w")
        self.proc = subprocess.Popen(
            argv + ["--listen", self.addr, "--metrics-listen", f"127.0.0.1:{self.mport}"],
            stdout=self.log, stderr=subprocess.STDOUT)
        wait_until(f"{name} ready", lambda: self.alive() and http_ok(self.metrics_url(probe)))

    def alive(self):
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited: see {self.log.name}")
        return True

    def metrics_url(self, path="/metrics"):
        return f"http://127.0.0.1:{self.mport}{path}"

    def rss_mib(self):
        with open(f"/proc/{self.proc.pid}/status") as f:
            kb = int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))
        return kb / 1024

    def cpu_s(self):
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def kill(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()


def record(addr):
    return json.dumps({"addr": f"http://{addr}", "accelerator": "cpu", "device": "cpu",
                       "capacity": 8, "labels": {"sim": "fleet"}, "started_at": ""})


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round((len(xs) - 1) * q)))] if xs else float("nan")


class Mesh:
    def __init__(self, args, pb, pb_grpc):
        import grpc

        self.args, self.pb, self.pb_grpc, self.grpc = args, pb, pb_grpc, grpc
        self.tmp = tempfile.mkdtemp(prefix="fleet-")
        self.procs, self.keep, self.etcd = [], threading.Event(), None
        try:
            self.start()
        except BaseException:
            self.close()
            raise

    def start(self):
        args, pb_grpc, grpc = self.args, self.pb_grpc, self.grpc
        self.etcd = Etcd(self.tmp)
        self.etcd.put(f"/models/{MODEL}/policy",
                      json.dumps({"stable": "v1", "sticky": True, "pin_allowed": True}))
        worker = os.path.join(args.bin, "tokenmesh-worker")
        self.workers = [self.start_worker(worker, f"proc-{i}") for i in range(args.worker_procs)]
        self.leases = [self.etcd.grant(args.lease_ttl) for _ in self.workers]
        threading.Thread(target=self.keep_alive, daemon=True).start()
        router = os.path.join(args.bin, "tokenmesh-router")
        self.routers = []
        budget = [] if args.status_poll_budget is None else [
            "--status-poll-budget", str(args.status_poll_budget)]
        for i in range(args.routers):
            r = Proc(self.tmp, f"router-{i}", [router, "--insecure", "--etcd", self.etcd.url,
                                                "--router-id", f"router-{i}", *budget],
                     probe="/healthz")
            self.procs.append(r)
            r.stub = pb_grpc.InferenceStub(grpc.insecure_channel(r.addr))
            self.routers.append(r)
        self.registered = 0

    def start_worker(self, binary, name):
        w = Proc(self.tmp, name, [binary, "--insecure", "--engine", "synthetic",
                                  "--synthetic-tokens-per-sec", "2000", "--model-name", MODEL,
                                  "--worker-id", name])
        self.procs.append(w)
        return w

    def keep_alive(self):
        while not self.keep.wait(self.args.lease_ttl / 3):
            for lease in self.leases:
                self.etcd.keepalive(lease)

    def ready(self, router, version):
        resp = router.stub.ListModels(self.pb.ListModelsRequest(), timeout=5)
        for m in resp.models:
            if m.name == MODEL:
                for v in m.versions:
                    if v.version == version:
                        return v.ready_workers
        return 0

    def grow(self, n):
        """Registers sim ids up to n and waits until every router has them
        ready; returns the seconds that took and etcd's watch traffic per
        registration (watch messages sent to all routers together)."""
        e0, t0 = self.etcd.metrics(), time.monotonic()
        added = n - self.registered
        for i in range(self.registered, n):
            w = i % len(self.workers)
            self.etcd.put(f"/workers/{MODEL}/v1/sim-{i:05}", record(self.workers[w].addr),
                          self.leases[w])
        self.registered = n
        for r in self.routers:
            wait_until(f"{n} ready on {r.name}", lambda: self.ready(r, "v1") >= n,
                       timeout=120, every=0.1)
        converge, e1 = time.monotonic() - t0, self.etcd.metrics()
        watch = lambda e: sum(v for k, v in e.items() if k.startswith("grpc_server_msg_sent_total")
                              and 'grpc_method="Watch"' in k)
        sent = "etcd_network_client_grpc_sent_bytes_total"
        return converge, {
            "watch_msgs_per_registration": round((watch(e1) - watch(e0)) / added, 2),
            "etcd_sent_bytes_per_registration": round((e1.get(sent, 0) - e0.get(sent, 0)) / added, 1),
        }

    def polls(self):
        """Status calls answered by all worker processes; per router, the
        polls it made and those it put off (in-band load was fresh)."""
        answered = sum(v for w in self.workers for k, v in scrape(w.metrics_url()).items()
                       if k.startswith("llm_status_requests_total"))
        made, deferred = [], []
        for r in self.routers:
            m = scrape(r.metrics_url())
            made.append(sum(v for k, v in m.items() if k.startswith("llm_router_status_polls_total")
                            and 'outcome="deferred"' not in k))
            deferred.append(sum(v for k, v in m.items()
                                if k.startswith("llm_router_status_polls_total")
                                and 'outcome="deferred"' in k))
        return answered, made, deferred

    def rest(self, seconds, load_clients=0):
        """Router RSS and CPU, Status polls answered and made and etcd
        traffic over a window, with no requests or with `load_clients`
        streams per router kept going."""
        cpu0 = [r.cpu_s() for r in self.routers]
        (a0, m0, d0), e0, t0 = self.polls(), self.etcd.metrics(), time.monotonic()
        stop, served = threading.Event(), [0] * (load_clients * len(self.routers))

        def client(i, r):
            k = 0
            while not stop.is_set():
                # A prompt of its own each time: identical ones would all go
                # to the one worker the cache-aware choice prefers for them.
                k += 1
                req = self.pb.GenerateRequest(model=MODEL, prompt=f"fleet {i} {k}", max_tokens=4)
                try:
                    for _ in r.stub.Generate(req, timeout=10):
                        pass
                    served[i] += 1
                except self.grpc.RpcError:
                    pass

        threads = [threading.Thread(target=client, args=(i, r))
                   for i, r in enumerate(self.routers * load_clients)]
        for t in threads:
            t.start()
        time.sleep(seconds)  # the measurement window itself, not a wait for readiness
        stop.set()
        for t in threads:
            t.join()
        cpu1 = [r.cpu_s() for r in self.routers]
        (a1, m1, d1), e1, dt = self.polls(), self.etcd.metrics(), time.monotonic() - t0
        etcd = {}
        for k, v in e1.items():
            if k.startswith(("grpc_server_msg_received_total", "grpc_server_msg_sent_total")):
                rate = (v - e0.get(k, 0.0)) / dt
                if rate > 0:
                    m = re.search(r'grpc_method="(\w+)"', k).group(1)
                    kind = "recv" if "received" in k else "sent"
                    etcd[f"{m}.{kind}"] = round(etcd.get(f"{m}.{kind}", 0) + rate, 2)
        sent = "etcd_network_client_grpc_sent_bytes_total"
        out = {
            "router_rss_mib": [round(r.rss_mib(), 1) for r in self.routers],
            "router_cpu_pct": [round(100 * (b - a) / dt, 2) for a, b in zip(cpu0, cpu1)],
            "status_rpcs_per_s_all_workers": round((a1 - a0) / dt, 1),
            "status_rpcs_per_s_per_router": round((a1 - a0) / dt / len(self.routers), 1),
            "router_polls_per_s": [round((b - a) / dt, 1) for a, b in zip(m0, m1)],
            "router_polls_deferred_per_s": [round((b - a) / dt, 1) for a, b in zip(d0, d1)],
            "etcd_msgs_per_s": etcd,
            "etcd_sent_bytes_per_s": round((e1.get(sent, 0) - e0.get(sent, 0)) / dt, 1),
        }
        if load_clients:
            out["requests_per_s"] = round(sum(served) / dt, 1)
        return out

    def on_every_router(self, until):
        """Per router, seconds from now until `until(router)` holds (checked
        every 2 ms, concurrently on all routers)."""
        t0 = time.monotonic()
        out = [None] * len(self.routers)

        def watch(i, r):
            deadline = t0 + 60
            while time.monotonic() < deadline:
                if until(r):
                    out[i] = time.monotonic() - t0
                    return
                time.sleep(0.002)

        threads = [threading.Thread(target=watch, args=(i, r)) for i, r in enumerate(self.routers)]
        return t0, threads, out

    def routed(self, router, version, worker_id):
        req = self.pb.GenerateRequest(model=MODEL, version=version, prompt="x", max_tokens=1)
        try:
            for msg in router.stub.Generate(req, timeout=2):
                return msg.WhichOneof("event") == "accepted" and msg.accepted.worker_id == worker_id
        except self.grpc.RpcError:
            return False
        return False

    def probe_join_leave(self, n, k):
        """A new registration: seconds until each router routes to it, then,
        after its key is deleted, until each router stops listing it ready."""
        wid = version = f"probe-{n}-{k}"
        w = k % len(self.workers)
        _, threads, first = self.on_every_router(lambda r: self.routed(r, version, wid))
        t0 = time.monotonic()
        self.etcd.put(f"/workers/{MODEL}/{version}/{wid}", record(self.workers[w].addr),
                      self.leases[w])
        put_s = time.monotonic() - t0
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        _, threads, gone = self.on_every_router(lambda r: self.ready(r, version) == 0)
        self.etcd.delete(f"/workers/{MODEL}/{version}/{wid}")
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return first, gone, put_s

    def probe_dead(self, n):
        """A worker process of its own, SIGKILLed once every router routes to
        it: seconds until each router stops listing it ready."""
        wid = version = f"dead-{n}"
        w = self.start_worker(os.path.join(self.args.bin, "tokenmesh-worker"), wid)
        lease = self.etcd.grant(self.args.lease_ttl)
        self.etcd.put(f"/workers/{MODEL}/{version}/{wid}", record(w.addr), lease)
        for r in self.routers:
            wait_until(f"{wid} routed on {r.name}", lambda: self.routed(r, version, wid),
                       timeout=30, every=0.01)
        _, threads, gone = self.on_every_router(lambda r: self.ready(r, version) == 0)
        w.kill()  # its lease is never kept alive again, as for a dead process
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return gone

    def close(self):
        self.keep.set()
        for p in self.procs:
            p.kill()
        if self.etcd:
            self.etcd.stop()


FIGURES = [
    # (title, unit, how to read one row: a number or None)
    ("join → first routed, p50", "ms", lambda r: r["join_to_first_routed_ms"]["p50"]),
    ("join → first routed, p99", "ms", lambda r: r["join_to_first_routed_ms"]["p99"]),
    ("deregistered → unready, p50", "ms", lambda r: r["deregistered_to_unready_ms"]["p50"]),
    ("killed → unready, p50", "ms", lambda r: r["killed_to_unready_ms"]["p50"]),
    ("router RSS (mean of routers)", "MiB", lambda r: sum(r["router_rss_mib"]) / len(r["router_rss_mib"])),
    ("router CPU at rest (mean)", "% of a core", lambda r: sum(r["router_cpu_pct"]) / len(r["router_cpu_pct"])),
    ("Status RPCs/s per router, at rest", "RPCs/s", lambda r: r["status_rpcs_per_s_per_router"]),
    ("Status RPCs/s per router, under load", "RPCs/s",
     lambda r: r["loaded"]["status_rpcs_per_s_per_router"] if "loaded" in r else None),
    ("Status RPCs/s on each registration, at rest", "RPCs/s",
     lambda r: r["status_rpcs_per_s_all_workers"] / r["n"]),
    ("etcd watch msgs per registration", "messages", lambda r: r["watch_msgs_per_registration"]),
    ("converge (register N, all routers ready)", "s", lambda r: r["converge_s"]),
    ("etcd sent bytes/s at rest", "bytes/s", lambda r: r["etcd_sent_bytes_per_s"]),
]


def plot(runs, out_dir):
    """One PNG, a panel per figure against N, a line per run ((label,
    results) pairs). Skipped, saying so, without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib into a venv of your own)")
        return None
    cols = 4
    rows = -(-len(FIGURES) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
    for ax, (title, unit, get) in zip(axes.flat, FIGURES):
        for label, res in runs:
            pts = [(r["n"], get(r)) for r in res["sizes"]]
            pts = [(n, y) for n, y in pts if y is not None]
            if pts:
                ax.plot([n for n, _ in pts], [y for _, y in pts], marker="o", label=label)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("registered workers N", fontsize=8)
        ax.set_ylabel(unit, fontsize=8)
        ax.set_ylim(bottom=0)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if len(runs) > 1:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(FIGURES):]:
        ax.axis("off")
    meta = runs[-1][1]
    fig.suptitle(f"tokenmesh fleet scale, simulated: {meta['routers']} routers, "
                 f"{meta['worker_procs']} worker processes, real etcd", fontsize=11)
    fig.tight_layout()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "fleet_scale.png")
    fig.savefig(path, dpi=60)
    print(f"plot in {path}")
    return path


def labelled(path):
    with open(path) as f:
        res = json.load(f)
    return res.get("label") or os.path.basename(path), res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", default="target/release", help="folder of the release binaries")
    ap.add_argument("--sizes", default="100,500,1000", help="registered workers, ascending")
    ap.add_argument("--routers", type=int, default=4)
    ap.add_argument("--worker-procs", type=int, default=4, help="synthetic worker processes")
    ap.add_argument("--probes", type=int, default=10, help="join/leave probes per size")
    ap.add_argument("--rest-s", type=float, default=10.0, help="measurement window at rest")
    ap.add_argument("--load-s", type=float, default=10.0, help="measurement window under load (0: none)")
    ap.add_argument("--load-clients", type=int, default=4, help="streams kept going per router")
    ap.add_argument("--lease-ttl", type=int, default=10)
    ap.add_argument("--status-poll-budget", type=float, default=None,
                    help="the routers' --status-poll-budget (default: the router's own)")
    ap.add_argument("--label", default="", help="names this run in plots")
    ap.add_argument("--out", default="target/fleet_scale.json")
    ap.add_argument("--plot-dir", help="write fleet_scale.png here")
    ap.add_argument("--compare", action="append", default=[], metavar="JSON",
                    help="an earlier run's results, drawn beside this one")
    ap.add_argument("--plot-only", nargs="+", metavar="JSON", help="plot these results; run nothing")
    args = ap.parse_args()
    if args.plot_only:
        plot([labelled(p) for p in args.plot_only], args.plot_dir or ".")
        return
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    stub_dir, pb, pb_grpc = stubs(repo)
    mesh = Mesh(args, pb, pb_grpc)
    results = {"label": args.label, "routers": args.routers, "worker_procs": args.worker_procs,
               "status_interval_ms": 1000, "status_poll_budget": args.status_poll_budget,
               "cpus": os.cpu_count(), "loadavg_start": os.getloadavg(), "sizes": []}
    try:
        results["baseline"] = mesh.rest(args.rest_s)
        for n in [int(s) for s in args.sizes.split(",")]:
            converge, churn = mesh.grow(n)
            rest = mesh.rest(args.rest_s)
            loaded = mesh.rest(args.load_s, args.load_clients) if args.load_s > 0 else None
            first, gone, puts = [], [], []
            for k in range(args.probes):
                f, g, p = mesh.probe_join_leave(n, k)
                first += f
                gone += g
                puts.append(p)
            dead = mesh.probe_dead(n)
            if None in first or None in gone or None in dead:
                raise RuntimeError(f"a probe timed out at N={n}: {first} {gone} {dead}")
            row = {
                "n": n, "converge_s": round(converge, 2), **churn, **rest,
                "join_to_first_routed_ms": {"p50": round(1e3 * pct(first, .5), 1),
                                            "p99": round(1e3 * pct(first, .99), 1),
                                            "max": round(1e3 * max(first), 1),
                                            "samples": len(first)},
                "deregistered_to_unready_ms": {"p50": round(1e3 * pct(gone, .5), 1),
                                               "p99": round(1e3 * pct(gone, .99), 1),
                                               "samples": len(gone)},
                "killed_to_unready_ms": {"p50": round(1e3 * pct(dead, .5), 1),
                                         "max": round(1e3 * max(dead), 1),
                                         "samples": len(dead)},
                "etcd_put_ms_p50": round(1e3 * pct(puts, .5), 2),
                "loadavg": os.getloadavg(),
            }
            if loaded:
                row["loaded"] = loaded
            results["sizes"].append(row)
            print(json.dumps(row), flush=True)
    finally:
        mesh.close()
        shutil.rmtree(stub_dir, ignore_errors=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"logs in {mesh.tmp}; results in {args.out}")
    if args.plot_dir:
        plot([labelled(p) for p in args.compare] + [(args.label or "this run", results)], args.plot_dir)


if __name__ == "__main__":
    main()
