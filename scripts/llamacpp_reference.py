#!/usr/bin/env python3
"""Produce a reference fixture of llama.cpp greedy continuations.

For each case in a fixed list, the prompt is rendered (chat cases through the
model's own chat template from the GGUF metadata, via jinja2), tokenized by
llama.cpp with special tokens parsed, and then continued greedily (argmax over
llama.cpp's raw logits: no temperature, no repetition penalty, no sampler
chain). At every step the top-5 tokens with their probabilities (softmax over
the full-vocabulary logits) and the chosen token are recorded.

A BOS token is prepended only if the GGUF metadata key
``tokenizer.ggml.add_bos_token`` is true.

Requires llama-cpp-python, jinja2 and numpy. See tests/fixtures/README.md.

Usage:
    python scripts/llamacpp_reference.py --model PATH --out PATH [--steps 24] [--threads 2]
"""

import argparse
import ctypes
import hashlib
import json
import os
import shlex
import sys

import jinja2
import jinja2.sandbox
import numpy as np

import llama_cpp
from llama_cpp import Llama

CASES = [
    {
        "name": "france_system",
        "kind": "chat",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France?"},
        ],
    },
    {
        "name": "france_nosystem",
        "kind": "chat",
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
    },
    {
        "name": "haiku",
        "kind": "chat",
        "messages": [{"role": "user", "content": "Write a haiku about the sea."}],
    },
    {"name": "count", "kind": "prompt", "prompt": "1, 2, 3, 4, 5,"},
    {"name": "story", "kind": "prompt", "prompt": "Once upon a time, there was a little"},
    {"name": "unicode", "kind": "prompt", "prompt": "The French word for 'thank you' is"},
]

TOP_K = 5


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def meta_bool(value):
    if isinstance(value, bool):
        return value
    return str(value).strip().lower() in ("true", "1")


def render_chat(template_src, messages, bos_token, eos_token):
    # Same environment settings as HF transformers' apply_chat_template.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined
    )
    tmpl = env.from_string(template_src)
    return tmpl.render(
        messages=messages,
        add_generation_prompt=True,
        bos_token=bos_token,
        eos_token=eos_token,
    )


def softmax64(logits):
    x = logits.astype(np.float64)
    x = x - x.max()
    e = np.exp(x)
    return e / e.sum()


def last_logits(llm):
    """Logits for the last evaluated position, straight from llama.cpp."""
    n_vocab = llm.n_vocab()
    ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
    direct = np.ctypeslib.as_array(ptr, shape=(n_vocab,)).copy()
    # Cross-check against the Python wrapper's stored scores (logits_all=True).
    stored = np.asarray(llm.scores[llm.n_tokens - 1, :], dtype=np.float32)
    if not np.array_equal(direct, stored):
        raise RuntimeError("llama_get_logits_ith(-1) disagrees with Llama.scores")
    return direct


def piece(llm, token_id):
    """Raw bytes of one token's piece, special tokens rendered as text.

    Calls llama_token_to_piece directly (lstrip=0, special=True) so no
    wrapper-side space stripping is applied.
    """
    vocab = llm._model.vocab
    size = 64
    while True:
        buf = (ctypes.c_char * size)()
        n = llama_cpp.llama_token_to_piece(vocab, llama_cpp.llama_token(token_id), buf, size, 0, True)
        if n < 0:
            size = -n
            continue
        return bytes(buf[:n])


def run_case(llm, case, add_bos, eog_ids, steps, template_src, bos_text, eos_text):
    out = {"name": case["name"], "kind": case["kind"]}
    if case["kind"] == "chat":
        out["messages"] = case["messages"]
        rendered = render_chat(template_src, case["messages"], bos_text, eos_text)
    else:
        out["prompt"] = case["prompt"]
        rendered = case["prompt"]
    out["rendered_prompt"] = rendered

    prompt_ids = llm.tokenize(rendered.encode("utf-8"), add_bos=add_bos, special=True)
    out["prompt_token_ids"] = [int(t) for t in prompt_ids]

    llm.reset()  # n_tokens = 0; eval() clears the KV cache from n_tokens on
    llm.eval(prompt_ids)

    step_records = []
    gen_bytes = b""
    stopped_at_eog = False
    for _ in range(steps):
        logits = last_logits(llm)
        probs = softmax64(logits)
        # argmax over the raw logits; ties -> lowest id (same as llama.cpp's greedy sampler)
        chosen = int(np.argmax(logits))
        # top-k by logit, ties broken by lowest id
        order = np.lexsort((np.arange(logits.shape[0]), -logits.astype(np.float64)))[:TOP_K]
        top = [[int(i), round(float(probs[i]), 6)] for i in order]
        assert top[0][0] == chosen
        pb = piece(llm, chosen)
        rec = {
            "token_id": chosen,
            "token_text": pb.decode("utf-8", errors="replace"),
            "top5": top,
        }
        step_records.append(rec)
        if chosen in eog_ids:
            stopped_at_eog = True
            break
        gen_bytes += pb
        llm.eval([chosen])

    out["steps"] = step_records
    out["stopped_at_eos"] = stopped_at_eog
    out["text"] = gen_bytes.decode("utf-8", errors="replace")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    llm = Llama(
        model_path=args.model,
        n_ctx=512,
        n_batch=512,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        logits_all=True,
        seed=0,
        verbose=False,
    )
    md = llm.metadata

    # BOS policy: only what the GGUF metadata says.
    add_bos_raw = md.get("tokenizer.ggml.add_bos_token")
    add_bos = meta_bool(add_bos_raw) if add_bos_raw is not None else False

    template_src = md["tokenizer.chat_template"]

    eos_id = llm.token_eos()
    bos_id = llm.token_bos()
    im_end = llm.tokenize(b"<|im_end|>", add_bos=False, special=True)
    if len(im_end) != 1:
        raise RuntimeError("<|im_end|> is not a single special token: %r" % (im_end,))
    eog_ids = {int(eos_id), int(im_end[0])}
    bos_text = piece(llm, bos_id).decode("utf-8", errors="replace") if bos_id >= 0 else ""
    eos_text = piece(llm, eos_id).decode("utf-8", errors="replace")

    command = shlex.join([sys.executable] + sys.argv)

    cases = [
        run_case(llm, c, add_bos, eog_ids, args.steps, template_src, bos_text, eos_text)
        for c in CASES
    ]

    result = {
        "model_file": os.path.basename(args.model),
        "model_sha256": sha256_file(args.model),
        "llama_cpp_python_version": llama_cpp.__version__,
        "command": command,
        "add_bos": add_bos,
        "add_bos_note": (
            "tokenizer.ggml.add_bos_token=%r in GGUF metadata; BOS %s prepended"
            % (add_bos_raw, "was" if add_bos else "was not")
        ),
        "tokenize": "llama.cpp tokenizer, special=True (special tokens parsed)",
        "decoding": "greedy argmax over raw llama.cpp logits; probs = softmax(full-vocab logits), rounded to 6 decimals",
        "threads": args.threads,
        "max_steps": args.steps,
        "eos_token_ids": sorted(eog_ids),
        "chat_template": template_src,
        "cases": cases,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1, ensure_ascii=False)
        f.write("\n")

    for c in cases:
        print("%-16s %r" % (c["name"], c["text"]))


if __name__ == "__main__":
    main()
