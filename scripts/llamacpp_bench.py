#!/usr/bin/env python3
"""Single-stream decode speed of llama.cpp (through llama-cpp-python) on the
same GGUF file and thread count as a tokenmesh worker, for BENCHMARKS.md.

For each repetition: one greedy completion of --max-tokens tokens of a fixed
prompt (EOS is suppressed with a logit bias so every run generates the same
number of tokens), streamed; it prints time to first token, decode tokens/s
(tokens after the first, over the time after the first) and end-to-end
tokens/s, then the median and range over the repetitions, and one JSON line.

Usage:
    python scripts/llamacpp_bench.py --model PATH [--threads 1] [--max-tokens 64] [--reps 3]
"""

import argparse
import json
import statistics
import time

from llama_cpp import Llama

PROMPT = (
    "the river carries light over stones while small birds sing about morning "
    "bread and quiet streets a train leaves town under grey clouds people read "
    "letters from old friends near warm windows"
)


def one(llm, max_tokens, rep):
    # A different first word each time: llama-cpp-python reuses the KV cache
    # of a matching prompt prefix, which would hide the prompt's cost.
    prompt = f"{rep} {PROMPT}"
    start = time.perf_counter()
    stamps = []
    for chunk in llm.create_completion(
        prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        logit_bias={llm.token_eos(): -1e9},
    ):
        # The stream ends with a chunk that only carries the finish reason.
        if chunk["choices"][0]["finish_reason"] is None or chunk["choices"][0]["text"]:
            stamps.append(time.perf_counter())
    end = time.perf_counter()
    n = len(stamps)
    ttft = stamps[0] - start
    decode = (n - 1) / (stamps[-1] - stamps[0]) if n > 1 else float("nan")
    return {"tokens": n, "ttft_ms": ttft * 1000, "decode_tok_s": decode, "e2e_tok_s": n / (end - start)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    llm = Llama(
        model_path=args.model,
        n_threads=args.threads,
        n_threads_batch=args.threads,  # the default is every core
        n_ctx=2048,
        verbose=False,
    )
    one(llm, 8, "warm")  # warm-up: first-call allocations and page faults
    runs = []
    for i in range(args.reps):
        r = one(llm, args.max_tokens, i)
        runs.append(r)
        print(
            f"rep {i + 1}: {r['tokens']} tokens, first token {r['ttft_ms']:.1f} ms, "
            f"decode {r['decode_tok_s']:.1f} tok/s, end-to-end {r['e2e_tok_s']:.1f} tok/s"
        )
    summary = {"engine": "llama.cpp", "threads": args.threads, "max_tokens": args.max_tokens}
    for key in ("ttft_ms", "decode_tok_s", "e2e_tok_s"):
        values = [r[key] for r in runs]
        summary[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
        print(f"{key}: median {statistics.median(values):.1f} (range {min(values):.1f} .. {max(values):.1f})")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
