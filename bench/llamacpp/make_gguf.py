#!/usr/bin/env python3
"""Writes a random-weight GGUF of a Llama / Mixtral config.json's shapes, Q4_1, for llama.cpp.

The comparison model of bench/llamacpp/compare.sh: llama.cpp's own layout (a 'llama'
architecture, experts as 3-D tensors), every matrix Q4_1 (20 bytes a block of 32: fp16 scale and
minimum, 16 bytes of nibbles), norms float32 ones, routers float32 random. The nibbles repeat a
16 MiB random pattern (speed does not depend on them); the scale and minimum keep the weights in
[-0.03, 0.03]. The Mixtral-8x7B config gives 27.2 GiB, as the Q4_1 GGUF of issue 32. Standard
library only; written to a temporary file and renamed.

  python3 bench/llamacpp/make_gguf.py --config bench/models/configs/mixtral-8x7b-instruct-v0.1.json \\
      --out /work/bigmodels/gguf/mixtral-q4_1.gguf [--layers 8]
"""
import argparse
import json
import os
import random
import struct

ALIGN = 32  # general.alignment's default
Q4_1, F32 = 3, 0  # ggml types
U32, F32_VALUE, I32, STRING, ARRAY = 4, 6, 5, 8, 9  # GGUF value types


def gguf_string(text):
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def padding(n):
    return (ALIGN - n % ALIGN) % ALIGN


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="a HuggingFace config.json (Llama or Mixtral)")
    parser.add_argument("--out", required=True, help="the .gguf file to write")
    parser.add_argument("--layers", type=int, help="decoder layers (default: the config's)")
    args = parser.parse_args()

    try:
        with open(args.config) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"{args.config}: {e}")
    for key in ("num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size",
                "num_attention_heads"):
        if not isinstance(cfg.get(key), int) or cfg[key] <= 0:
            raise SystemExit(f"{args.config}: {key} is missing or not a positive integer")
    if cfg["vocab_size"] < 259:
        raise SystemExit(f"{args.config}: vocab_size {cfg['vocab_size']} is under 259 "
                         "(3 special and 256 byte tokens)")
    if cfg.get("num_local_experts") and not isinstance(cfg.get("num_experts_per_tok"), int):
        raise SystemExit(f"{args.config}: num_local_experts without num_experts_per_tok")
    layers = args.layers or cfg["num_hidden_layers"]
    hidden, ffn, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    experts = cfg.get("num_local_experts", 0)
    head_dim = hidden // heads
    for name, value in (("hidden_size", hidden), ("intermediate_size", ffn)):
        if value % 32:
            raise SystemExit(f"{args.config}: {name} {value} is not a multiple of Q4_1's block of 32")

    kvs = []

    def kv(key, kind, payload):
        kvs.append(gguf_string(key) + struct.pack("<I", kind) + payload)

    def u32(key, value):
        kv(key, U32, struct.pack("<I", value))

    kv("general.architecture", STRING, gguf_string("llama"))
    kv("general.name", STRING, gguf_string("accel-random-q4_1"))
    u32("general.file_type", 3)  # mostly Q4_1
    u32("llama.context_length", cfg.get("max_position_embeddings", 4096))
    u32("llama.embedding_length", hidden)
    u32("llama.block_count", layers)
    u32("llama.feed_forward_length", ffn)
    u32("llama.rope.dimension_count", head_dim)
    u32("llama.attention.head_count", heads)
    u32("llama.attention.head_count_kv", kv_heads)
    kv("llama.attention.layer_norm_rms_epsilon", F32_VALUE, struct.pack("<f", cfg.get("rms_norm_eps", 1e-5)))
    kv("llama.rope.freq_base", F32_VALUE, struct.pack("<f", cfg.get("rope_theta", 10000.0)))
    if experts:
        u32("llama.expert_count", experts)
        u32("llama.expert_used_count", cfg["num_experts_per_tok"])
    u32("llama.vocab_size", vocab)
    # A SentencePiece-style vocabulary: <unk>, <s>, </s>, the 256 byte tokens, then plain pieces.
    tokens, types = ["<unk>", "<s>", "</s>"], [2, 3, 3]
    tokens += ["<0x%02X>" % b for b in range(256)]
    types += [6] * 256
    tokens += ["\u2581t%d" % i for i in range(len(tokens), vocab)]
    types += [1] * (vocab - len(types))
    kv("tokenizer.ggml.model", STRING, gguf_string("llama"))
    kv("tokenizer.ggml.tokens", ARRAY, struct.pack("<IQ", STRING, vocab) + b"".join(map(gguf_string, tokens)))
    kv("tokenizer.ggml.scores", ARRAY,
       struct.pack("<IQ", F32_VALUE, vocab) + struct.pack("<%df" % vocab, *(-float(i) for i in range(vocab))))
    kv("tokenizer.ggml.token_type", ARRAY, struct.pack("<IQ", I32, vocab) + struct.pack("<%di" % vocab, *types))
    u32("tokenizer.ggml.bos_token_id", 1)
    u32("tokenizer.ggml.eos_token_id", 2)
    u32("tokenizer.ggml.unknown_token_id", 0)

    tensors = []  # (name, ggml dims (ne0 first), type, bytes, fill)

    def matrix(name, *dims):
        count = 1
        for d in dims:
            count *= d
        tensors.append((name, dims, Q4_1, count // 32 * 20, "q4_1"))

    def vector(name, *dims, fill="ones"):
        count = 1
        for d in dims:
            count *= d
        tensors.append((name, dims, F32, count * 4, fill))

    matrix("token_embd.weight", hidden, vocab)
    for layer in range(layers):
        p = "blk.%d." % layer
        vector(p + "attn_norm.weight", hidden)
        matrix(p + "attn_q.weight", hidden, heads * head_dim)
        matrix(p + "attn_k.weight", hidden, kv_heads * head_dim)
        matrix(p + "attn_v.weight", hidden, kv_heads * head_dim)
        matrix(p + "attn_output.weight", heads * head_dim, hidden)
        vector(p + "ffn_norm.weight", hidden)
        if experts:
            vector(p + "ffn_gate_inp.weight", hidden, experts, fill="random")
            matrix(p + "ffn_gate_exps.weight", hidden, ffn, experts)
            matrix(p + "ffn_down_exps.weight", ffn, hidden, experts)
            matrix(p + "ffn_up_exps.weight", hidden, ffn, experts)
        else:
            matrix(p + "ffn_gate.weight", hidden, ffn)
            matrix(p + "ffn_down.weight", ffn, hidden)
            matrix(p + "ffn_up.weight", hidden, ffn)
    vector("output_norm.weight", hidden)
    matrix("output.weight", hidden, vocab)

    infos, offset = [], 0
    for name, dims, kind, size, _ in tensors:
        infos.append(gguf_string(name) + struct.pack("<I", len(dims)) + struct.pack("<%dQ" % len(dims), *dims)
                     + struct.pack("<IQ", kind, offset))
        offset += size + padding(size)

    blocks = (16 << 20) // 20
    pattern = bytearray(blocks * 20)
    head = struct.pack("<ee", 0.004, -0.03)  # scale, minimum
    for i in range(4):
        pattern[i::20] = bytes([head[i]]) * blocks
    nibbles = os.urandom(16 * blocks)
    for i in range(16):
        pattern[4 + i::20] = nibbles[i * blocks:(i + 1) * blocks]
    pattern = bytes(pattern)
    rng = random.Random(0)

    tmp = args.out + ".tmp"
    with open(tmp, "wb") as f:
        header = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs)) + b"".join(kvs) + b"".join(infos)
        f.write(header + b"\0" * padding(len(header)))
        for _, _, _, size, fill in tensors:
            if fill == "q4_1":
                left = size
                while left > 0:  # sizes and the pattern are whole blocks
                    n = min(left, len(pattern))
                    f.write(pattern[:n])
                    left -= n
            elif fill == "ones":
                f.write(struct.pack("<%df" % (size // 4), *([1.0] * (size // 4))))
            else:
                f.write(struct.pack("<%df" % (size // 4), *(rng.gauss(0, 0.02) for _ in range(size // 4))))
            f.write(b"\0" * padding(size))
    os.replace(tmp, args.out)
    print("%s: %d layers, %.2f GiB" % (args.out, layers, os.path.getsize(args.out) / 2**30))


if __name__ == "__main__":
    main()
