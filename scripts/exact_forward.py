#!/usr/bin/env python3
"""The judge between two engines: a float64 forward pass of a GGUF model's
weights, dequantized exactly as stored (gguf-py's dequantizers), with none
of an engine's roundings (no 8-bit activations, no f16 KV cache, no fused
kernels). Where the worker and llama.cpp pick different tokens, this says
which one the weights really favour (worker/tests/arch_oracle.rs).

Architectures as llama.cpp builds them (src/models/*.cpp): llama (rotation
of adjacent pairs, `rope_freqs.weight` dividing the frequencies), qwen2 (q,
k, v biases), qwen3 (per-head RMS norms of q and k) and phi3 (fused qkv and
gate-up matrices), the last three rotating halves; grouped-query attention,
SwiGLU feed-forward, tied or untied output.

Input (--in, JSON): {"sequences": [{"tokens": [ids...], "from": N}, ...]}.
Output (--out): for each sequence in order, the next-token probabilities
after each of the positions N-1 .. len-2 (so len - N rows: the distributions
the tokens from index N were chosen from), each row the vocabulary's
probabilities as little-endian float32, rows and sequences back to back.

Needs numpy and gguf-py (``PYTHONPATH=$TOKENMESH_LLAMA_CPP/src/gguf-py``).

Usage:
    python scripts/exact_forward.py --model MODEL.gguf --in REQ.json --out PROBS.bin
"""

import argparse
import json
import sys

import numpy as np

import gguf
from gguf import GGUFReader, GGUFValueType
from tiny_gguf import field_value

# llama.cpp's rotation layout per architecture (llama_model_rope_type).
ROPE_NEOX = {"qwen2": True, "qwen3": True, "phi3": True, "llama": False}


def metadata(reader):
    """Scalar metadata as plain Python values."""
    return {
        f.name: field_value(f)[0]
        for f in reader.fields.values()
        if f.types and f.types[0] != GGUFValueType.ARRAY
    }


def tensors(reader):
    """Every tensor dequantized to float64, in numpy's (rows, columns) order."""
    out = {}
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        out[t.name] = np.asarray(data, dtype=np.float64).reshape(shape)
    return out


def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rotate(x, n_rot, base, neox, factors):
    """RoPE over the first `n_rot` dimensions of each head of x (T, heads,
    head_dim), at positions 0..T-1."""
    t = x.shape[0]
    half = n_rot // 2
    inv = base ** (-np.arange(half, dtype=np.float64) * 2.0 / n_rot)
    if factors is not None:
        inv = inv / factors
    angle = np.arange(t, dtype=np.float64)[:, None] * inv[None, :]
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    out = x.copy()
    if neox:
        a, b = x[..., :half], x[..., half:n_rot]
        out[..., :half] = a * cos - b * sin
        out[..., half:n_rot] = a * sin + b * cos
    else:
        a, b = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
        out[..., 0:n_rot:2] = a * cos - b * sin
        out[..., 1:n_rot:2] = a * sin + b * cos
    return out


class Model:
    def __init__(self, path):
        reader = GGUFReader(path)
        meta = metadata(reader)
        self.arch = arch = meta["general.architecture"]
        if arch not in ROPE_NEOX:
            sys.exit(f"exact_forward.py: architecture {arch!r} is not one of {sorted(ROPE_NEOX)}")
        key = lambda k, default=None: meta.get(f"{arch}.{k}", default)  # noqa: E731
        self.w = tensors(reader)
        self.hidden = key("embedding_length")
        self.n_layer = key("block_count")
        self.n_head = key("attention.head_count")
        self.n_kv = key("attention.head_count_kv", self.n_head)
        self.head_dim = key("attention.key_length", self.hidden // self.n_head)
        self.n_rot = key("rope.dimension_count", self.head_dim)
        self.base = key("rope.freq_base", 10000.0)
        self.eps = key("attention.layer_norm_rms_epsilon", 1e-5)
        self.neox = ROPE_NEOX[arch]
        self.factors = self.w.get("rope_freqs.weight")
        self.output = self.w.get("output.weight", self.w["token_embd.weight"])

    def layer(self, i, x):
        w = lambda name: self.w.get(f"blk.{i}.{name}")  # noqa: E731
        t = x.shape[0]
        q_dim, kv_dim = self.n_head * self.head_dim, self.n_kv * self.head_dim
        h = rms_norm(x, w("attn_norm.weight"), self.eps)
        if w("attn_qkv.weight") is not None:
            qkv = h @ w("attn_qkv.weight").T
            q, k, v = qkv[:, :q_dim], qkv[:, q_dim : q_dim + kv_dim], qkv[:, q_dim + kv_dim :]
        else:
            q, k, v = h @ w("attn_q.weight").T, h @ w("attn_k.weight").T, h @ w("attn_v.weight").T
        for name, m in (("attn_q.bias", q), ("attn_k.bias", k), ("attn_v.bias", v)):
            if w(name) is not None:
                m += w(name)
        q = q.reshape(t, self.n_head, self.head_dim)
        k = k.reshape(t, self.n_kv, self.head_dim)
        v = v.reshape(t, self.n_kv, self.head_dim)
        if w("attn_q_norm.weight") is not None:
            q = rms_norm(q, w("attn_q_norm.weight"), self.eps)
            k = rms_norm(k, w("attn_k_norm.weight"), self.eps)
        q = rotate(q, self.n_rot, self.base, self.neox, self.factors)
        k = rotate(k, self.n_rot, self.base, self.neox, self.factors)
        group = self.n_head // self.n_kv
        k = np.repeat(k, group, axis=1)
        v = np.repeat(v, group, axis=1)
        scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(self.head_dim)
        scores += np.triu(np.full((t, t), -np.inf), k=1)
        scores -= scores.max(axis=-1, keepdims=True)
        p = np.exp(scores)
        p /= p.sum(axis=-1, keepdims=True)
        attn = np.einsum("hts,shd->thd", p, v).reshape(t, q_dim)
        x = x + attn @ w("attn_output.weight").T
        h = rms_norm(x, w("ffn_norm.weight"), self.eps)
        if w("ffn_gate.weight") is not None:
            gate, up = h @ w("ffn_gate.weight").T, h @ w("ffn_up.weight").T
        else:
            both = h @ w("ffn_up.weight").T
            gate, up = np.split(both, 2, axis=-1)
        act = gate / (1.0 + np.exp(-gate)) * up
        return x + act @ w("ffn_down.weight").T

    def probs(self, tokens, first):
        """Next-token probabilities after positions first-1 .. len-2."""
        x = self.w["token_embd.weight"][np.asarray(tokens)]
        for i in range(self.n_layer):
            x = self.layer(i, x)
        x = rms_norm(x[first - 1 : len(tokens) - 1], self.w["output_norm.weight"], self.eps)
        logits = x @ self.output.T
        logits -= logits.max(axis=-1, keepdims=True)
        p = np.exp(logits)
        return p / p.sum(axis=-1, keepdims=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--in", dest="inp", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    model = Model(args.model)
    with open(args.inp) as f:
        sequences = json.load(f)["sequences"]
    with open(args.out, "wb") as out:
        for s in sequences:
            tokens, first = s["tokens"], s["from"]
            if not 1 <= first <= len(tokens):
                sys.exit(f"exact_forward.py: 'from' {first} is outside 1..{len(tokens)}")
            out.write(model.probs(tokens, first).astype("<f4").tobytes())


if __name__ == "__main__":
    main()
