#!/usr/bin/env python3
"""Summarises repeated `meshctl bench --output json` reports: groups the JSON
lines by their labels (without `rep`) and prints a Markdown table with the
median and the range (min-max) of each figure over the repetitions.

Usage: python3 scripts/bench_summary.py FILE.jsonl [FILE.jsonl ...]
"""

import json
import statistics
import sys

FIGURES = [
    ("tok/s", lambda r: r["output_tokens_per_sec"], "{:.1f}"),
    ("req/s", lambda r: r["requests_per_sec"], "{:.2f}"),
    ("TTFT p50 ms", lambda r: r["ttft_ms"]["p50"], "{:.2f}"),
    ("TTFT p99 ms", lambda r: r["ttft_ms"]["p99"], "{:.2f}"),
    ("ITL p50 ms", lambda r: r["itl_ms"]["p50"], "{:.2f}"),
    ("ITL p99 ms", lambda r: r["itl_ms"]["p99"], "{:.2f}"),
    ("E2E p99 ms", lambda r: r["e2e_ms"]["p99"], "{:.1f}"),
    ("norm. tok/s", lambda r: r["normalised_tokens_per_sec"], "{:.1f}"),
]


def main():
    groups = {}
    for path in sys.argv[1:]:
        with open(path) as f:
            for line in f:
                if not line.strip():
                    continue
                r = json.loads(line)
                labels = {k: v for k, v in r["labels"].items() if k not in ("rep", "target")}
                key = " ".join(f"{k}={v}" for k, v in sorted(labels.items()))
                groups.setdefault(key, []).append(r)
    print("| run | n | " + " | ".join(name for name, _, _ in FIGURES) + " | errors |")
    print("| --- | ---: | " + " | ".join("---:" for _ in FIGURES) + " | --- |")
    for key, reports in groups.items():
        cells = []
        for _, get, fmt in FIGURES:
            values = [get(r) for r in reports]
            med = fmt.format(statistics.median(values))
            if len(values) > 1:
                med += " (" + fmt.format(min(values)) + "–" + fmt.format(max(values)) + ")"
            cells.append(med)
        errors = {}
        for r in reports:
            for code, n in r["errors"].items():
                errors[code] = errors.get(code, 0) + n
        err = " ".join(f"{k}={v}" for k, v in errors.items()) or "none"
        print(f"| {key} | {len(reports)} | " + " | ".join(cells) + f" | {err} |")


if __name__ == "__main__":
    main()
