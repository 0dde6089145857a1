#!/usr/bin/env python3
"""A grpcio client for scripts/cluster-test.sh: the checks against a compose
cluster that need more than `meshctl generate` (watching a stream while a
worker is killed, polling readiness, counting versions, the Control API).

Every subcommand prints one JSON line and exits non-zero with a message on
failure. Stubs come from proto/ (generated once into --gen-dir).
"""
import argparse
import importlib
import json
import os
import subprocess
import sys
import time

import grpc
from grpc_tools import protoc

MODEL = "smollm2-135m-instruct"


def load_stubs(proto_dir, gen_dir):
    marker = os.path.join(gen_dir, "tokenmesh", "v1", "control_pb2_grpc.py")
    if not os.path.exists(marker):
        os.makedirs(gen_dir, exist_ok=True)
        rc = protoc.main(["grpc_tools.protoc", f"-I{proto_dir}", f"--python_out={gen_dir}",
                          f"--grpc_python_out={gen_dir}",
                          "tokenmesh/v1/tokenmesh.proto", "tokenmesh/v1/control.proto"])
        if rc != 0:
            sys.exit(f"protoc failed with {rc}")
    sys.path.insert(0, gen_dir)
    mods = {}
    for name in ("tokenmesh_pb2", "tokenmesh_pb2_grpc", "control_pb2", "control_pb2_grpc"):
        mods[name] = importlib.import_module(f"tokenmesh.v1.{name}")
    return mods


def channel(args, role):
    def read(name):
        with open(os.path.join(args.tls_dir, name), "rb") as f:
            return f.read()
    creds = grpc.ssl_channel_credentials(root_certificates=read("ca.pem"),
                                         private_key=read(f"{role}.key"),
                                         certificate_chain=read(f"{role}.pem"))
    return grpc.secure_channel(args.target, creds)


def fail(msg, **extra):
    print(json.dumps({"ok": False, "error": msg, **extra}))
    sys.exit(1)


class Stream:
    """Reads one Generate stream and checks its shape: Accepted first, Deltas,
    exactly one Finished last, seq 0, 1, 2, ... with no gap."""

    def __init__(self, pb, stub, timeout, **req):
        req.setdefault("model", MODEL)
        req.setdefault("temperature", 0.0)
        req.setdefault("messages", [pb.ChatMessage(role="user", content="Tell me a long story about a dragon.")])
        self.start = time.monotonic()
        self.call = stub.Generate(pb.GenerateRequest(**req), timeout=timeout)
        self.seq = 0
        self.accepted = None
        self.finished = None
        self.text = []
        self.tokens = 0
        self.first_token_s = None

    def __iter__(self):
        for msg in self.call:
            if msg.seq != self.seq:
                fail(f"seq {msg.seq} where {self.seq} was due", worker=self.worker())
            self.seq += 1
            kind = msg.WhichOneof("event")
            if kind == "accepted":
                if self.seq != 1:
                    fail("Accepted is not the first message")
                self.accepted = msg.accepted
            elif kind == "delta":
                if self.accepted is None or self.finished is not None:
                    fail("Delta outside Accepted..Finished")
                if self.first_token_s is None:
                    self.first_token_s = time.monotonic() - self.start
                self.tokens += len(msg.delta.token_ids)
                self.text.append(msg.delta.text)
            elif kind == "finished":
                if self.finished is not None:
                    fail("two Finished messages")
                self.finished = msg.finished
            yield kind
        if self.finished is None:
            fail("the stream ended without Finished")

    def worker(self):
        return self.accepted.worker_id if self.accepted else None

    def summary(self):
        f = self.finished
        return {"ok": True, "version": self.accepted.version, "worker": self.accepted.worker_id,
                "finished_worker": f.worker_id, "failovers": f.failovers, "tokens": self.tokens,
                "finish_reason": f.finish_reason, "first_token_s": round(self.first_token_s or 0, 3),
                "total_s": round(time.monotonic() - self.start, 3), "text": "".join(self.text)[:80]}


def cmd_generate(args, m):
    stub = m["tokenmesh_pb2_grpc"].InferenceStub(channel(args, "client"))
    req = {"max_tokens": args.max_tokens}
    if args.version:
        req["version"] = args.version
    s = Stream(m["tokenmesh_pb2"], stub, args.timeout, **req)
    for _ in s:
        pass
    print(json.dumps(s.summary()))


def cmd_kill_mid_stream(args, m):
    """Streams, and after --after-tokens tokens runs --kill-cmd with {worker}
    replaced by the serving worker; the stream must still finish, with a
    failover counted and no seq gap."""
    stub = m["tokenmesh_pb2_grpc"].InferenceStub(channel(args, "client"))
    s = Stream(m["tokenmesh_pb2"], stub, args.timeout, max_tokens=args.max_tokens,
               stop=[], repetition_penalty=1.0)
    killed = None
    last = stall = 0.0
    for kind in s:
        if kind != "delta":
            continue
        t = time.monotonic()
        if killed is not None:
            stall = max(stall, t - last)
        last = t
        if killed is None and s.tokens >= args.after_tokens:
            killed = s.worker()
            subprocess.run(args.kill_cmd.format(worker=killed), shell=True, check=True,
                           stdout=subprocess.DEVNULL)
            last = time.monotonic()
    out = s.summary()
    out["killed"] = killed
    # the longest wait for a token after the kill: how long the failover took
    out["stall_s"] = round(stall, 2)
    if killed is None:
        fail("the stream finished before the kill", **out)
    if out["failovers"] < 1 or out["finished_worker"] == killed:
        fail("the stream did not fail over", **out)
    print(json.dumps(out))


def ready_counts(stub, pb):
    resp = stub.ListModels(pb.ListModelsRequest(), timeout=5)
    counts, weights, stable = {}, {}, ""
    for model in resp.models:
        if model.name == MODEL:
            stable = model.stable_version
            for v in model.versions:
                counts[v.version] = v.ready_workers
                weights[v.version] = v.weight
    return counts, weights, stable


def poll(timeout, interval, attempt, failure):
    """Calls attempt() every interval s until it returns (True, value), for up
    to timeout s; an RPC error counts as a failed attempt. Returns the seconds
    waited and the value; fails with `failure` and the last value or error if
    timeout s pass first."""
    start = time.monotonic()
    last = None
    while time.monotonic() - start < timeout:
        try:
            done, last = attempt()
            if done:
                return round(time.monotonic() - start, 2), last
        except grpc.RpcError as e:
            last = f"{e.code().name}: {e.details()}"
        time.sleep(interval)
    fail(failure, last=last)


def cmd_wait_ready(args, m):
    """Polls ListModels until each version has the wanted number of ready
    workers (exactly, with --exact; at least, otherwise)."""
    want = dict((kv.split("=")[0], int(kv.split("=")[1])) for kv in args.want.split(","))
    stub = m["tokenmesh_pb2_grpc"].InferenceStub(channel(args, "client"))

    def ready():
        counts, _, _ = ready_counts(stub, m["tokenmesh_pb2"])
        done = all((counts.get(v, 0) == n) if args.exact else (counts.get(v, 0) >= n)
                   for v, n in want.items())
        return done, counts

    waited, counts = poll(args.timeout, 0.25, ready,
                          f"ready workers never became {want} within {args.timeout} s")
    print(json.dumps({"ok": True, "ready": counts, "waited_s": waited}))


def cmd_reconnect(args, m):
    """One channel: a generate, then --restart-cmd, then generates on the same
    channel until one succeeds (the channel reconnects by itself)."""
    stub = m["tokenmesh_pb2_grpc"].InferenceStub(channel(args, "client"))
    pb = m["tokenmesh_pb2"]
    for _ in Stream(pb, stub, args.timeout, max_tokens=4):
        pass
    subprocess.run(args.restart_cmd, shell=True, check=True, stdout=subprocess.DEVNULL)
    attempts = 0

    def generate():
        nonlocal attempts
        attempts += 1
        for _ in Stream(pb, stub, 10, max_tokens=4):
            pass
        return True, None

    waited, _ = poll(args.timeout, 0.2, generate,
                     f"no successful generate within {args.timeout} s of the restart")
    print(json.dumps({"ok": True, "attempts": attempts, "reconnected_after_s": waited}))


def router_stubs(args, m):
    stubs = []
    for target in args.routers.split(","):
        a = argparse.Namespace(**vars(args))
        a.target = target
        stubs.append((target, m["tokenmesh_pb2_grpc"].InferenceStub(channel(a, "client"))))
    return stubs


def cmd_split(args, m):
    """Waits until every --routers router serves the policy --stable with
    --canary at --weight %, then sends --n requests round-robin over them and
    checks which versions served: both arms when 0 < weight < 100, else only
    the one that takes all traffic."""
    pb = m["tokenmesh_pb2"]
    stubs = router_stubs(args, m)
    start = time.monotonic()
    for target, stub in stubs:
        while True:
            _, weights, stable = ready_counts(stub, pb)
            want = {args.canary: args.weight} if args.canary else {}
            if stable == args.stable and all(weights.get(v) == w for v, w in want.items()):
                break
            if time.monotonic() - start > args.timeout:
                fail(f"{target} never saw stable {args.stable}, canary {args.canary} at {args.weight} %",
                     stable=stable, weights=weights)
            time.sleep(0.25)
    seen_after_s = round(time.monotonic() - start, 2)
    served = {}
    for i in range(args.n):
        s = Stream(pb, stubs[i % len(stubs)][1], 30, max_tokens=2)
        for _ in s:
            pass
        served[s.accepted.version] = served.get(s.accepted.version, 0) + 1
    expect = {args.stable}
    if args.canary and args.weight >= 100:
        expect = {args.canary}
    elif args.canary and args.weight > 0:
        expect = {args.stable, args.canary}
    if set(served) != expect:
        fail(f"versions served {sorted(served)}, expected {sorted(expect)}", served=served)
    print(json.dumps({"ok": True, "policy_seen_after_s": seen_after_s, "served": served}))


def cmd_rollout_wait(args, m):
    """Polls GetRollout (operator identity) for up to --timeout s, sending a
    request through --routers between polls (the traffic the analysis
    judges), until the rollout ends; prints the state, the steps reached and
    the last decisions either way (the caller decides what a rollout still
    running means)."""
    cpb = m["control_pb2"]
    control = m["control_pb2_grpc"].ControlStub(channel(args, "operator"))
    stubs = router_stubs(args, m)
    start = time.monotonic()
    i = 0
    while True:
        r = control.GetRollout(cpb.RolloutRequest(model=MODEL), timeout=5)
        if r.state != cpb.ROLLOUT_STATE_RUNNING or time.monotonic() - start > args.timeout:
            break
        s = Stream(m["tokenmesh_pb2"], stubs[i % len(stubs)][1], 30, max_tokens=2)
        i += 1
        for _ in s:
            pass
    print(json.dumps({"ok": True, "state": cpb.RolloutState.Name(r.state), "step": r.step,
                      "waited_s": round(time.monotonic() - start, 1),
                      "steps": list(r.steps), "requests_sent": i,
                      "decisions": [f"step {d.step} at {d.weight} %: {cpb.Verdict.Name(d.verdict)}: {d.reason}"
                                    for d in r.decisions][-3:]}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--proto-dir", required=True)
    ap.add_argument("--gen-dir", required=True)
    ap.add_argument("--tls-dir", required=True, help="ca.pem, client.*, operator.*")
    ap.add_argument("--target", help="host:port")
    ap.add_argument("--timeout", type=float, default=60)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate")
    g.add_argument("--max-tokens", type=int, default=16)
    g.add_argument("--version")
    k = sub.add_parser("kill-mid-stream")
    k.add_argument("--kill-cmd", required=True)
    k.add_argument("--after-tokens", type=int, default=4)
    k.add_argument("--max-tokens", type=int, default=96)
    w = sub.add_parser("wait-ready")
    w.add_argument("--want", required=True, help="v1=2,v2=1")
    w.add_argument("--exact", action="store_true")
    r = sub.add_parser("reconnect")
    r.add_argument("--restart-cmd", required=True)
    c = sub.add_parser("split")
    c.add_argument("--routers", required=True, help="host:port,host:port")
    c.add_argument("--stable", required=True)
    c.add_argument("--canary")
    c.add_argument("--weight", type=int, default=0)
    c.add_argument("--n", type=int, default=16)
    rw = sub.add_parser("rollout-wait")
    rw.add_argument("--routers", required=True, help="host:port,host:port")
    args = ap.parse_args()
    m = load_stubs(args.proto_dir, args.gen_dir)
    try:
        {"generate": cmd_generate, "kill-mid-stream": cmd_kill_mid_stream,
         "wait-ready": cmd_wait_ready, "reconnect": cmd_reconnect, "split": cmd_split,
         "rollout-wait": cmd_rollout_wait}[args.cmd](args, m)
    except grpc.RpcError as e:
        fail(f"{e.code().name}: {e.details()}")


if __name__ == "__main__":
    main()
