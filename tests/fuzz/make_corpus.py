#!/usr/bin/env python3
"""Writes the fuzzers' seed corpora (checked in; rerun after editing).

corpus/safetensors/: tiny .safetensors files, valid and invalid, written byte
by byte (8-byte little-endian header length, JSON header, data section).
corpus/config/: inputs of config_fuzz: one byte choosing the parser ('0':
config.json, '1': generation_config.json), then the JSON text.

    python3 tests/fuzz/make_corpus.py
"""
import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def st_file(header, data=b"", pad=True, length=None):
    """A safetensors file; `header` is a dict (dumped compactly) or raw text."""
    text = header if isinstance(header, (str, bytes)) else json.dumps(header, separators=(",", ":"))
    raw = text.encode() if isinstance(text, str) else text
    if pad:
        raw += b" " * ((8 - len(raw) % 8) % 8)
    n = len(raw) if length is None else length
    return struct.pack("<Q", n) + raw + data


def t(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


SAFETENSORS = {
    # Valid.
    "valid_empty.safetensors": st_file({}),
    "valid_one_f32.safetensors": st_file({"w": t("F32", [2, 2], 0, 16)}, bytes(range(16))),
    "valid_metadata_two.safetensors": st_file(
        {"__metadata__": {"format": "pt"}, "a": t("BF16", [3], 0, 6), "b": t("I64", [], 6, 14)},
        bytes(14)),
    "valid_every_dtype.safetensors": st_file(
        {name: t(name, [1], i, i + size) for name, size, i in [
            ("BOOL", 1, 0), ("U8", 1, 1), ("I8", 1, 2), ("F8_E5M2", 1, 3), ("F8_E4M3", 1, 4),
            ("I16", 2, 5), ("U16", 2, 7), ("F16", 2, 9), ("BF16", 2, 11), ("I32", 4, 13),
            ("U32", 4, 17), ("F32", 4, 21), ("F64", 8, 25), ("I64", 8, 33), ("U64", 8, 41)]},
        bytes(49)),
    "valid_zero_sized.safetensors": st_file(
        {"e": t("F16", [0, 4], 0, 0), "f": t("U8", [4, 0, 9], 0, 0), "g": t("U8", [2], 0, 2)},
        b"xy"),
    "valid_unpadded.safetensors": st_file({"w": t("U8", [1], 0, 1)}, b"z", pad=False),
    "valid_unicode_names.safetensors": st_file(
        {"__metadata__": {"k\u00e9y": "v\u2603"}, "w\u00e9\\\"\u0001": t("U8", [1], 0, 1)}, b"z"),
    # Invalid.
    "bad_short.safetensors": b"\x05\x00\x00",
    "bad_length_past_end.safetensors": st_file("{}", pad=False, length=1000),
    "bad_length_huge.safetensors": st_file("{}", pad=False, length=2**64 - 1),
    "bad_not_object.safetensors": st_file("[1,2]"),
    "bad_json.safetensors": st_file('{"a": {"dtype": '),
    "bad_dtype.safetensors": st_file({"w": t("F128", [1], 0, 16)}, bytes(16)),
    "bad_negative_dim.safetensors": st_file({"w": t("U8", [-1], 0, 0)}),
    "bad_overflow.safetensors": st_file({"w": t("F32", [4611686018427387904, 4], 0, 0)}),
    # 2^62 * 2 overflows int64 before the 0 (a bug the fuzzer's UBSan check caught).
    "bad_partial_product_overflow.safetensors": st_file(
        {"w": t("U8", [4611686018427387904, 2, 0], 0, 0)}),
    "bad_nbytes.safetensors": st_file({"w": t("F32", [3], 0, 10)}, bytes(10)),
    "bad_overlap.safetensors": st_file(
        {"a": t("U8", [4], 0, 4), "b": t("U8", [4], 2, 6)}, bytes(6)),
    "bad_gap.safetensors": st_file({"a": t("U8", [2], 0, 2), "b": t("U8", [2], 4, 6)}, bytes(6)),
    "bad_truncated.safetensors": st_file({"w": t("F32", [4], 0, 16)}, bytes(9)),
    "bad_trailing.safetensors": st_file({"w": t("U8", [2], 0, 2)}, b"xxxx"),
    "bad_duplicate.safetensors": st_file(
        '{"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},'
        '"w":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}}', b"xxxx"),
    "bad_metadata.safetensors": st_file({"__metadata__": {"n": 3}}),
    "bad_deep.safetensors": st_file('{"a":' + "[" * 40 + "]" * 40 + "}"),
}

CONFIGS = {
    "llama.json": b"0" + json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu",
        "attention_bias": False, "sliding_window": None, "use_cache": True}).encode(),
    "gpt2.json": b"0" + json.dumps({
        "model_type": "gpt2", "vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12,
        "n_positions": 1024, "n_inner": None, "layer_norm_epsilon": 1e-05,
        "activation_function": "gelu_new", "bos_token_id": 50256, "eos_token_id": 50256}).encode(),
    "bad_type.json": b'0{"hidden_size": "x", "rope_scaling": {"type": "linear", "factor": "2"}}',
    "generation.json": b"1" + json.dumps({
        "bos_token_id": 1, "eos_token_id": [2, 32000], "do_sample": True, "temperature": 0.6,
        "top_p": 0.9, "top_k": 50, "max_new_tokens": 256, "transformers_version": "4.45.0"}).encode(),
    "generation_bad.json": b'1{"eos_token_id": [1, -2], "do_sample": "yes"}',
}


def write(folder, files):
    path = os.path.join(HERE, "corpus", folder)
    os.makedirs(path, exist_ok=True)
    for name, data in files.items():
        assert len(data) < 1024, name
        with open(os.path.join(path, name), "wb") as f:
            f.write(data)
    print(f"{path}: {len(files)} files")


if __name__ == "__main__":
    write("safetensors", SAFETENSORS)
    write("config", CONFIGS)
