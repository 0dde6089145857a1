#!/usr/bin/env python3
"""Compares paths of interleaved `meshctl bench --output json` runs tagged with
labels `path` and `rep` (scripts/benchmarks.sh adds them): for every path other
than the baseline and every repetition, the added TTFT p50/p99 (path minus the
baseline of the same repetition, in microseconds) and tokens/s as a ratio of
the baseline's; then the median and range (min-max) over the repetitions.

Usage: python3 scripts/bench_compare.py FILE.jsonl [--baseline direct]
"""

import json
import statistics
import sys


def fmt(values, f):
    if not values:
        return "n/a"
    med = f.format(statistics.median(values))
    if len(values) > 1:
        med += " (" + f.format(min(values)) + " to " + f.format(max(values)) + ")"
    return med


def main():
    args = sys.argv[1:]
    baseline = "direct"
    if "--baseline" in args:
        i = args.index("--baseline")
        baseline = args[i + 1]
        del args[i:i + 2]
    runs = {}
    for path in args:
        with open(path) as f:
            for line in f:
                if line.strip():
                    r = json.loads(line)
                    runs[(r["labels"]["path"], r["labels"]["rep"])] = r
    paths = sorted({p for p, _ in runs} - {baseline})
    reps = sorted({rep for _, rep in runs})
    print(f"| path | vs {baseline}: added TTFT p50 µs | added TTFT p99 µs | tokens/s ratio | errors |")
    print("| --- | ---: | ---: | ---: | --- |")
    for p in paths:
        d50, d99, ratio, errors = [], [], [], {}
        for rep in reps:
            base, r = runs.get((baseline, rep)), runs.get((p, rep))
            if base is None or r is None:
                continue
            # A run without a whole request in its window has no TTFT.
            if r["requests"] > 0 and base["requests"] > 0:
                d50.append(1000 * (r["ttft_ms"]["p50"] - base["ttft_ms"]["p50"]))
                d99.append(1000 * (r["ttft_ms"]["p99"] - base["ttft_ms"]["p99"]))
            if base["output_tokens_per_sec"] > 0:
                ratio.append(100 * r["output_tokens_per_sec"] / base["output_tokens_per_sec"])
            for code, n in r["errors"].items():
                errors[code] = errors.get(code, 0) + n
        err = " ".join(f"{k}={v}" for k, v in errors.items()) or "none"
        print(f"| {p} | {fmt(d50, '{:+.0f}')} | {fmt(d99, '{:+.0f}')} | "
              f"{fmt(ratio, '{:.1f}')} % | {err} |")
    # The baseline's own errors, so that a path is not read as failing alone.
    errors = {}
    for (p, _), r in runs.items():
        if p == baseline:
            for code, n in r["errors"].items():
                errors[code] = errors.get(code, 0) + n
    err = " ".join(f"{k}={v}" for k, v in errors.items()) or "none"
    print(f"| {baseline} (baseline) | | | | {err} |")
    # What each path's first error of a code said (meshctl's error_examples).
    said = {}
    for (p, rep), r in sorted(runs.items()):
        for code, text in r.get("error_examples", {}).items():
            said.setdefault((p, code), (rep, text))
    for (p, code), (rep, text) in sorted(said.items()):
        print(f"first {code} on {p} (rep {rep}): {text}")


if __name__ == "__main__":
    main()
