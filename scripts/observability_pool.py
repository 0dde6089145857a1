#!/usr/bin/env python3
"""Pools the pairs of several `ONLY=observability scripts/benchmarks.sh` runs (BENCHMARKS.md,
"Telemetry's exporter"): per repetition, router-on against router-off of the same run, and the
median and quartiles over every pair of every run given.

Usage: scripts/observability_pool.py LABEL RUN [RUN...], where each RUN is a path prefix P with
P.jsonl (observability.jsonl) and P-cpu.txt (observability-cpu.txt) beside it."""
import json
import re
import statistics as st
import sys


def pairs(prefix):
    rows = {}
    for line in open(prefix + ".jsonl"):
        r = json.loads(line)
        rows[(r["labels"]["path"], r["labels"]["rep"])] = r
    cpu = {}
    for line in open(prefix + "-cpu.txt"):
        m = re.match(r"(\S+) rep (\d+): router CPU ([\d.]+) s", line)
        if m:
            w = re.search(r"worker CPU ([\d.]+) s", line)
            cpu[(m[1], m[2])] = (float(m[3]), float(w[1]) if w else None)
    for rep in sorted({k[1] for k in rows}):
        on, off = rows[("router-on", rep)], rows[("router-off", rep)]
        tokens = 100 * on["output_tokens_per_sec"] / off["output_tokens_per_sec"]
        ttft = on["ttft_ms"]["p50"] - off["ttft_ms"]["p50"]
        # CPU seconds (warm-up and window) per streamed token/s, on over off: the router's,
        # and router plus worker where the run recorded the worker's (later runs).
        (r_on, w_on), (r_off, w_off) = cpu[("router-on", rep)], cpu[("router-off", rep)]
        t_on, t_off = on["output_tokens_per_sec"], off["output_tokens_per_sec"]
        router = (r_on / t_on) / (r_off / t_off)
        mesh = None if w_on is None else ((r_on + w_on) / t_on) / ((r_off + w_off) / t_off)
        yield tokens, ttft, router, mesh


def spread(v):
    q1, _, q3 = st.quantiles(v, n=4)
    return st.median(v), q1, q3


label, runs = sys.argv[1], sys.argv[2:]
got = [p for run in runs for p in pairs(run)]
tok, ttft, cpu = (spread([p[i] for p in got]) for i in range(3))
line = (
    f"{label}: {len(got)} pairs; tokens/s on as % of off {tok[0]:.2f} % (quartiles {tok[1]:.2f}-{tok[2]:.2f}); "
    f"added TTFT p50 {ttft[0]:+.2f} ms ({ttft[1]:+.2f} to {ttft[2]:+.2f}); "
    f"router CPU per token on/off {cpu[0]:.3f} ({cpu[1]:.3f}-{cpu[2]:.3f})"
)
meshes = [p[3] for p in got if p[3] is not None]
if meshes:
    m = spread(meshes)
    line += f"; router + worker CPU per token on/off {m[0]:.3f} ({m[1]:.3f}-{m[2]:.3f}, {len(meshes)} pairs)"
print(line)
