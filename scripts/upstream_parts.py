#!/usr/bin/env python3
"""The parts of an upstream worker's time to first token, per request, from
its JSON log at debug level for `tokenmesh_worker::upstream::forward` (one
"upstream first token" line per request: prepare_us, completion_us and
worker_us, the worker's own part; see worker/src/upstream/forward.rs).

  upstream_parts.py run LABEL... < LOG_SEGMENT   one JSON line: each part's
      p50/p99 over the segment's requests, with the labels (key=value)
  upstream_parts.py summary FILE.jsonl            per `path` and `streams`
      label: the median (range) over the runs of each part's p50, as a
      Markdown table
"""

import json
import statistics
import sys

PARTS = ("worker_us", "prepare_us", "completion_us")


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run(labels):
    got = {p: [] for p in PARTS}
    for line in sys.stdin:
        try:
            r = json.loads(line)
        except ValueError:
            continue
        fields = r.get("fields", {})
        if fields.get("message") != "upstream first token":
            continue
        for p in PARTS:
            got[p].append(int(fields[p]))
    out = dict(kv.split("=", 1) for kv in labels)
    out["requests"] = len(got["worker_us"])
    for p in PARTS:
        if got[p]:
            out[p] = {"p50": pct(got[p], 0.5), "p99": pct(got[p], 0.99)}
    print(json.dumps(out))


def fmt(values):
    med = f"{statistics.median(values):.0f}"
    if len(values) > 1:
        med += f" ({min(values):.0f} to {max(values):.0f})"
    return med


def summary(path):
    by = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                if r["requests"]:
                    key = (r.get("path", "router"), int(r["streams"]))
                    by.setdefault(key, []).append(r)
    print("| path | streams | runs | worker's own µs p50 | worker's own µs p99 "
          "| engine prepare (template/tokenize) µs p50 | engine completion to first token µs p50 |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for (path, streams), rs in sorted(by.items()):
        print(f"| {path} | {streams} | {len(rs)} | {fmt([r['worker_us']['p50'] for r in rs])} "
              f"| {fmt([r['worker_us']['p99'] for r in rs])} "
              f"| {fmt([r['prepare_us']['p50'] for r in rs])} "
              f"| {fmt([r['completion_us']['p50'] for r in rs])} |")


def main():
    if len(sys.argv) >= 2 and sys.argv[1] == "run":
        run(sys.argv[2:])
    elif len(sys.argv) == 3 and sys.argv[1] == "summary":
        summary(sys.argv[2])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
