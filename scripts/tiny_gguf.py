#!/usr/bin/env python3
"""Write a tiny random-weight GGUF model of one architecture, for comparing
the worker's forward pass with llama.cpp's (worker/tests/arch_oracle.rs).

The weights are seeded normal draws, scaled so that next-token distributions
are peaked (a wrong rotation, norm or bias moves the argmax, where flat
distributions would hide it in near-ties). The tokenizer metadata (every
``tokenizer.*`` key) is copied from a real model, so both engines load the
file as they load a downloaded one. All tensors are F32; quantize the file
with llama.cpp's ``llama-quantize`` for other types.

Needs numpy and gguf-py (``PYTHONPATH=$TOKENMESH_LLAMA_CPP/src/gguf-py``).

Usage:
    python scripts/tiny_gguf.py --arch ARCH --tokenizer-from MODEL.gguf --out OUT.gguf
        [--seed N] [--rope-freqs] [--layers 2]

ARCH: llama, qwen2, qwen3 or phi3.
"""

import argparse
import sys

import numpy as np

import gguf
from gguf import GGUFReader, GGUFValueType, GGUFWriter

ARCHS = ("llama", "qwen2", "qwen3", "phi3")


def field_value(field):
    """A reader field's value as plain Python (str, int, float, bool, list)."""
    kind = field.types[0]

    def scalar(part, t):
        if t == GGUFValueType.STRING:
            return bytes(part).decode("utf-8")
        v = part[0]
        return bool(v) if t == GGUFValueType.BOOL else v.item()

    if kind == GGUFValueType.ARRAY:
        sub = field.types[1]
        return [scalar(field.parts[i], sub) for i in field.data], sub
    return scalar(field.parts[field.data[0]], kind), None


def byte_decoder():
    """GPT-2's byte-level BPE alphabet: token character -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def copy_tokenizer(src, writer):
    """Every tokenizer.* key of `src`, with its stored type; the vocabulary
    size and which tokens are not whole UTF-8 text (byte fragments)."""
    tokens, model = None, None
    for field in GGUFReader(src).fields.values():
        if not field.name.startswith("tokenizer."):
            continue
        value, sub = field_value(field)
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub)
        if field.name == "tokenizer.ggml.tokens":
            tokens = value
        if field.name == "tokenizer.ggml.model":
            model = value
    if tokens is None:
        sys.exit(f"{src} has no tokenizer.ggml.tokens")
    fragments = np.zeros(len(tokens), dtype=bool)
    if model == "gpt2":
        dec = byte_decoder()
        for i, t in enumerate(tokens):
            try:
                bytes(dec[c] for c in t).decode("utf-8")
            except (KeyError, UnicodeDecodeError):
                fragments[i] = True
    return len(tokens), fragments


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", choices=ARCHS, required=True)
    ap.add_argument("--tokenizer-from", required=True, help="GGUF model whose tokenizer is copied")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument(
        "--rope-freqs",
        action="store_true",
        help="add a rope_freqs.weight tensor (Llama 3.1+ per-dimension frequency divisors)",
    )
    ap.add_argument("--tied", action="store_true", help="no output.weight: the embedding is reused")
    args = ap.parse_args()

    rng = np.random.default_rng(args.seed)
    arch = args.arch
    hidden, n_head, n_kv_head, ffn = 64, 4, 2, 128
    # qwen3 models set their head width apart from hidden / heads (Qwen3-0.6B:
    # 16 heads of 128 over 1024); 32 here makes the query width 2 x hidden.
    head_dim = 32 if arch == "qwen3" else hidden // n_head
    q_dim, kv_dim = n_head * head_dim, n_kv_head * head_dim
    # A small base makes every rotary frequency turn within the prompt, so
    # a rotation error (layout, frequencies) shows early.
    rope_base = 1000.0

    w = GGUFWriter(args.out, arch)
    vocab, fragments = copy_tokenizer(args.tokenizer_from, w)
    # Not the architecture's name: llama.cpp gives tokens of models named
    # "phi3" attributes that need tokens this vocabulary may lack.
    w.add_name("tiny random model")
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_context_length(args.context)
    w.add_embedding_length(hidden)
    w.add_block_count(args.layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv_head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(rope_base)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(vocab)
    if head_dim * n_head != hidden:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)

    def normal(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def norm_weight(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    # Embedding rows of unit scale; the output matrix (or the tied embedding)
    # against the normed state gives logits of standard deviation ~8, peaked
    # over a 49k vocabulary.
    #
    # Tokens that are byte fragments get output rows of zero, so a logit of 0
    # far below the top ones: they are never predicted, because llama-server
    # reports one merged entry for tokens that only together make UTF-8 text,
    # which would hide their probabilities.
    embd = normal(vocab, hidden)
    out = embd if args.tied else normal(vocab, hidden)
    out[fragments] = 0.0
    w.add_tensor("token_embd.weight", embd)
    w.add_tensor("output_norm.weight", norm_weight(hidden))
    if not args.tied:
        w.add_tensor("output.weight", out)
    if args.rope_freqs:
        # Divisors between 1 and 8 on every dimension, as Llama 3.1 sets them
        # on its low frequencies, but here where the positions reach them.
        factors = 1.0 + 7.0 * rng.random(head_dim // 2)
        w.add_tensor("rope_freqs.weight", factors.astype(np.float32))
    for i in range(args.layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", norm_weight(hidden))
        # Queries and keys of ~1.2 per dimension: attention scores of about a
        # unit: the softmax (and the rotation behind it) matters, without
        # making the model so sharp that rounding noise flips its choices.
        wq = normal(q_dim, hidden, scale=1.2 / np.sqrt(hidden))
        wk = normal(kv_dim, hidden, scale=1.2 / np.sqrt(hidden))
        wv = normal(kv_dim, hidden, scale=1.0 / np.sqrt(hidden))
        if arch == "phi3":
            w.add_tensor(p + "attn_qkv.weight", np.concatenate([wq, wk, wv]))
        else:
            w.add_tensor(p + "attn_q.weight", wq)
            w.add_tensor(p + "attn_k.weight", wk)
            w.add_tensor(p + "attn_v.weight", wv)
        if arch == "qwen2":
            w.add_tensor(p + "attn_q.bias", normal(q_dim, scale=0.5))
            w.add_tensor(p + "attn_k.bias", normal(kv_dim, scale=0.5))
            w.add_tensor(p + "attn_v.bias", normal(kv_dim, scale=0.5))
        if arch == "qwen3":
            w.add_tensor(p + "attn_q_norm.weight", norm_weight(head_dim) * 2.0)
            w.add_tensor(p + "attn_k_norm.weight", norm_weight(head_dim) * 2.0)
        # The blocks' outputs of about the embedding's scale, so attention
        # and the feed-forward block move the residual stream.
        w.add_tensor(p + "attn_output.weight", normal(hidden, q_dim, scale=1.5 / np.sqrt(q_dim)))
        w.add_tensor(p + "ffn_norm.weight", norm_weight(hidden))
        gate = normal(ffn, hidden, scale=1.5 / np.sqrt(hidden))
        up = normal(ffn, hidden, scale=1.5 / np.sqrt(hidden))
        if arch == "phi3":
            # One (2 ffn, hidden) matrix, the gate first.
            w.add_tensor(p + "ffn_up.weight", np.concatenate([gate, up]))
        else:
            w.add_tensor(p + "ffn_gate.weight", gate)
            w.add_tensor(p + "ffn_up.weight", up)
        w.add_tensor(p + "ffn_down.weight", normal(hidden, ffn, scale=1.0 / np.sqrt(ffn)))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
