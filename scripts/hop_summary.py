#!/usr/bin/env python3
"""Summarises scripts/benchmarks.sh's hop-cpu.txt (ONLY=hop): the median
(range) proxy CPU per streamed token for each path and stream count, and each
path's ratio to nginx's median: issue 20's target is a router ratio of at most
1.00. Usage: python3 scripts/hop_summary.py OUT/hop-cpu.txt
"""

import re
import statistics
import sys
from collections import defaultdict

LINE = re.compile(r"c=(\d+) (\S+) rep \d+: .*CPU per streamed token ([0-9.]+) us")


def main():
    runs = defaultdict(list)
    for line in open(sys.argv[1]):
        m = LINE.search(line)
        if m:
            runs[(int(m[1]), m[2])].append(float(m[3]))
    print("| streams | path | CPU per streamed token, median (range) | vs nginx |")
    print("| ---: | --- | ---: | ---: |")
    for c in sorted({c for c, _ in runs}):
        nginx = runs.get((c, "nginx"))
        base = statistics.median(nginx) if nginx else None
        for (cc, path), v in sorted(runs.items()):
            if cc != c:
                continue
            med = statistics.median(v)
            ratio = f"{med / base:.2f}x" if base else "n/a"
            print(f"| {c} | {path} | {med:.2f} us ({min(v):.2f}-{max(v):.2f}, {len(v)} runs) | {ratio} |")


if __name__ == "__main__":
    main()
