#!/usr/bin/env python3
"""Closed-loop load generator for llama-server's streaming /completion API,
reporting what `meshctl bench` reports, by the same definitions, so the two
can be put side by side (BENCHMARKS.md, "Engine vs llama-server, side by
side"). Standard library only.

What it does, mirroring meshctl/src/bench/{workload,load,report}.rs:

- Load: `--concurrency N` streams, each sending its next request when the
  last ends (closed loop), for `--warmup` seconds and then `--duration`
  seconds of measurement; no request is issued after the window, and those in
  flight may finish within `--drain-timeout`.
- Prompts: `--prompt-words` words drawn from meshctl bench's 32-word list, one
  generator shared by all streams in issue order, seeded with `--seed`
  (Python's `random`, not Rust's StdRng, so the words differ from meshctl's
  for the same seed; the length in words and the vocabulary are the same).
  Raw prompts, no chat template; `max_tokens` is `--max-tokens`.
- Throughput: tokens that arrive inside the window, per second of window.
  Requests that start during the warm-up are left out of the latencies.
- TTFT: from sending the request to the first streamed event that carries a
  token; inter-token latency: the gap between consecutive token-carrying
  events of one stream (an event with n tokens spreads its gap over them);
  E2E: request to the final event. Percentiles by nearest rank.
- Tokens are counted from each event's `tokens` list (`return_tokens: true`),
  so a token held back by the server (an incomplete UTF-8 sequence) is
  counted when it arrives.

Also reported, beyond meshctl's fields: completion and prompt tokens per
request (llama-server's `tokens_predicted` / `tokens_evaluated`), the share of
requests that ran to max_tokens, and llama-server's own prompt and decode
speeds (`timings`), means over measured requests.

EOS: our worker stops at EOS and its API has no way to ignore it, so by
default this client lets llama-server stop at EOS too (`--ignore-eos` makes it
ignore EOS) and reports `full_length_share`, to check that both ran the full
max_tokens.

Used by scripts/engine-vs-llamacpp.sh as

    python3 scripts/llama_server_bench.py --url http://127.0.0.1:PORT \
        --concurrency N --duration 20 --warmup 5 --max-tokens 64 \
        --prompt-words 32 --temperature 0 --label engine=llama-server

against `llama-server -m SmolLM2-135M-Instruct.Q4_1.gguf -t 2 -tb 2 -np N
-c N*256`, printing one JSON line per run (`--repeat`).
"""
import argparse
import asyncio
import json
import math
import random
import sys
import time
from urllib.parse import urlparse

# meshctl bench's word list (meshctl/src/bench/workload.rs).
WORDS = [
    "the", "river", "carries", "light", "over", "stones", "while", "small", "birds", "sing",
    "about", "morning", "bread", "and", "quiet", "streets", "a", "train", "leaves", "town",
    "under", "grey", "clouds", "people", "read", "letters", "from", "old", "friends", "near",
    "warm", "windows",
]
NORMALISATION_BOUND_MS = 100.0


def spread(s):
    if ".." in s:
        a, b = s.split("..", 1)
        lo, hi = int(a), int(b.lstrip("="))
    else:
        lo = hi = int(s)
    if lo < 1 or lo > hi:
        raise argparse.ArgumentTypeError(f"{s!r}: need 1 <= min <= max")
    return lo, hi


class Workload:
    def __init__(self, seed, prompt_words, max_tokens):
        self.rng = random.Random(seed)
        self.prompt_words = prompt_words
        self.max_tokens = max_tokens

    def next_shape(self):
        n = self.rng.randint(*self.prompt_words)
        words = [WORDS[self.rng.randrange(len(WORDS))] for _ in range(n)]
        return " ".join(words), self.rng.randint(*self.max_tokens)


class Sample:
    __slots__ = ("start", "end", "tokens", "error", "predicted", "evaluated",
                 "stop_type", "prompt_per_s", "decode_per_s")

    def __init__(self, start):
        self.start = start
        self.end = start
        self.tokens = []  # (arrival seconds since t0, n tokens)
        self.error = None
        self.predicted = self.evaluated = None
        self.stop_type = None
        self.prompt_per_s = self.decode_per_s = None


async def read_body(reader, chunked):
    """Yields the response body in pieces as they arrive."""
    if not chunked:
        while True:
            data = await reader.read(65536)
            if not data:
                return
            yield data
    while True:
        line = await reader.readline()
        if not line:
            return
        size = int(line.split(b";")[0].strip() or b"0", 16)
        if size == 0:
            return
        data = await reader.readexactly(size)
        await reader.readexactly(2)  # CRLF
        yield data


async def one(args, host, port, path, prompt, max_tokens, t0, sample):
    body = {
        "prompt": prompt,
        "n_predict": max_tokens,
        "stream": True,
        "return_tokens": True,
        "ignore_eos": args.ignore_eos,
    }
    for key in ("temperature", "top_k", "top_p", "min_p"):
        if getattr(args, key) is not None:
            body[key] = getattr(args, key)
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
        "Content-Type: application/json\r\nAccept: text/event-stream\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    ).encode()
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(head + payload)
        await writer.drain()
        status = await reader.readline()
        code = int(status.split()[1])
        chunked = False
        while True:
            line = await reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            k, _, v = line.decode("latin-1").partition(":")
            if k.strip().lower() == "transfer-encoding" and "chunked" in v.lower():
                chunked = True
        if code != 200:
            sample.error = f"HTTP_{code}"
            return
        buf = b""
        async for piece in read_body(reader, chunked):
            now = time.perf_counter() - t0
            buf += piece
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                for line in event.split(b"\n"):
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        continue
                    msg = json.loads(data)
                    if "error" in msg:
                        sample.error = "SERVER_ERROR"
                        return
                    n = len(msg.get("tokens") or [])
                    if n == 0 and msg.get("content") and not msg.get("stop"):
                        n = 1  # a server that does not return token ids
                    if n:
                        sample.tokens.append((now, n))
                    if msg.get("stop"):
                        sample.predicted = msg.get("tokens_predicted")
                        sample.evaluated = msg.get("tokens_evaluated")
                        sample.stop_type = msg.get("stop_type")
                        t = msg.get("timings") or {}
                        sample.prompt_per_s = t.get("prompt_per_second")
                        sample.decode_per_s = t.get("predicted_per_second")
                        return
        sample.error = "INCOMPLETE"
    finally:
        writer.close()


def percentiles(values):
    """values: list of (value_ms, weight)."""
    if not values:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "mean": 0.0}
    values = sorted(values)
    total = sum(w for _, w in values)
    out = {}
    for name, q in (("p50", 0.50), ("p90", 0.90), ("p99", 0.99)):
        rank = max(1, math.ceil(q * total))
        acc = 0
        for v, w in values:
            acc += w
            if acc >= rank:
                out[name] = v
                break
    out["mean"] = sum(v * w for v, w in values) / total
    return out


def mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


async def run(args, seed):
    u = urlparse(args.url)
    host, port = u.hostname, u.port or 80
    workload = Workload(seed, args.prompt_words, args.max_tokens)
    samples = []
    t0 = time.perf_counter()
    warm = args.warmup
    issue_end = args.warmup + args.duration
    hard_end = issue_end + args.drain_timeout
    measured = 0

    def may_issue():
        nonlocal measured
        now = time.perf_counter() - t0
        if now >= issue_end:
            return False
        if now >= warm:
            measured += 1
            return args.requests is None or measured <= args.requests
        return True

    async def stream():
        while may_issue():
            prompt, max_tokens = workload.next_shape()
            s = Sample(time.perf_counter() - t0)
            try:
                await asyncio.wait_for(
                    one(args, host, port, u.path or "/completion", prompt, max_tokens, t0, s),
                    timeout=max(0.001, hard_end - s.start),
                )
            except asyncio.TimeoutError:
                s.error = "CLIENT_TIMEOUT"
            except (OSError, ValueError, asyncio.IncompleteReadError) as e:
                s.error = f"CONNECTION({type(e).__name__})"
            s.end = time.perf_counter() - t0
            samples.append(s)

    await asyncio.gather(*(stream() for _ in range(args.concurrency)))

    count_bound = args.requests is not None and measured >= args.requests
    window_end = issue_end
    if count_bound:
        ends = [s.end for s in samples if s.start >= warm]
        window_end = max(warm + 0.001, min(issue_end, max(ends) if ends else issue_end))
    window = window_end - warm

    ttft, itl, e2e, errors = [], [], [], {}
    tokens_in_window = ended_in_window = requests = 0
    for s in samples:
        tokens_in_window += sum(n for t, n in s.tokens if warm <= t <= window_end)
        if s.error is None and warm <= s.end <= window_end:
            ended_in_window += 1
        if s.start < warm:
            continue
        if s.error is not None:
            errors[s.error] = errors.get(s.error, 0) + 1
            continue
        requests += 1
        e2e.append(((s.end - s.start) * 1000, 1))
        if s.tokens:
            ttft.append(((s.tokens[0][0] - s.start) * 1000, 1))
        for (prev, _), (at, n) in zip(s.tokens, s.tokens[1:]):
            itl.append(((at - prev) * 1000 / max(n, 1), n))
    tps = tokens_in_window / window
    itl_p = percentiles(itl)
    factor = min(1.0, NORMALISATION_BOUND_MS / itl_p["p99"]) if itl_p["p99"] > 0 else 1.0
    ok = [s for s in samples if s.start >= warm and s.error is None]
    labels = {
        "api": "llama-server /completion",
        "concurrency": str(args.concurrency),
        "max_tokens": f"{args.max_tokens[0]}" if args.max_tokens[0] == args.max_tokens[1]
        else f"{args.max_tokens[0]}..{args.max_tokens[1]}",
        "prompt_words": f"{args.prompt_words[0]}" if args.prompt_words[0] == args.prompt_words[1]
        else f"{args.prompt_words[0]}..{args.prompt_words[1]}",
        "target": args.url,
        "seed": str(seed),
        "ignore_eos": str(args.ignore_eos).lower(),
    }
    for kv in args.label:
        k, _, v = kv.partition("=")
        labels[k] = v
    return {
        "labels": labels,
        "window_s": window,
        "requests": requests,
        "errors": errors,
        "requests_per_sec": ended_in_window / window,
        "output_tokens_per_sec": tps,
        "ttft_ms": percentiles(ttft),
        "itl_ms": itl_p,
        "e2e_ms": percentiles(e2e),
        "normalised_tokens_per_sec": tps * factor,
        "llama_server": {
            "completion_tokens_mean": mean([s.predicted for s in ok]),
            "prompt_tokens_mean": mean([s.evaluated for s in ok]),
            "full_length_share": (sum(1 for s in ok if s.stop_type == "limit") / len(ok)) if ok else None,
            "stop_types": {t: sum(1 for s in ok if s.stop_type == t) for t in {s.stop_type for s in ok}},
            "server_prompt_tokens_per_sec_mean": mean([s.prompt_per_s for s in ok]),
            "server_decode_tokens_per_sec_mean": mean([s.decode_per_s for s in ok]),
        },
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8080/completion",
                   help="llama-server's /completion URL (a bare host:port URL means /completion)")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--requests", type=int, default=None, help="also stop after this many measured requests")
    p.add_argument("--drain-timeout", type=float, default=30.0)
    p.add_argument("--prompt-words", type=spread, default=(32, 32))
    p.add_argument("--max-tokens", type=spread, default=(64, 64))
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None, help="0 = the whole vocabulary")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--ignore-eos", action="store_true", help="ask llama-server to ignore EOS")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--repeat", type=int, default=1, help="runs, seeds seed..seed+repeat-1")
    p.add_argument("--label", action="append", default=[], help="KEY=VALUE added to labels")
    args = p.parse_args()
    if urlparse(args.url).path in ("", "/"):
        args.url = args.url.rstrip("/") + "/completion"
    for i in range(args.repeat):
        print(json.dumps(asyncio.run(run(args, args.seed + i))), flush=True)


if __name__ == "__main__":
    sys.exit(main())
