#!/usr/bin/env python3
"""Tests of bench/llamacpp/: make_gguf.py's GGUF read back field by field, and bad input to it and bench.mjs."""
import json
import os
import struct
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "bench", "llamacpp", "make_gguf.py")
# vocab_size 301: token_embd is 602 blocks of 32, 12040 bytes, padded to 12064.
SMALL = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 96, "vocab_size": 301,
         "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
         "num_experts_per_tok": 2, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
         "max_position_embeddings": 128}


def read_gguf(path):
    """(key -> value for scalars and strings, [(name, dims, type, offset)], data start, size)."""
    with open(path, "rb") as f:
        data = f.read()
    pos = 0

    def take(fmt):
        nonlocal pos
        values = struct.unpack_from("<" + fmt, data, pos)
        pos += struct.calcsize("<" + fmt)
        return values

    def string():
        nonlocal pos
        (n,) = take("Q")
        pos += n
        return data[pos - n:pos].decode()

    def value(kind):
        scalar = {4: "I", 5: "i", 6: "f"}
        if kind in scalar:
            return take(scalar[kind])[0]
        if kind == 8:
            return string()
        if kind == 9:
            elem, count = take("IQ")
            return [value(elem) for _ in range(count)]
        raise AssertionError(f"value type {kind}")

    assert data[:4] == b"GGUF"
    pos = 4
    version, tensors, kvs = take("IQQ")
    assert version == 3
    meta = {}
    for _ in range(kvs):
        key = string()
        meta[key] = value(take("I")[0])
    infos = []
    for _ in range(tensors):
        name = string()
        (dims,) = take("I")
        shape = take("%dQ" % dims)
        kind, offset = take("IQ")
        infos.append((name, shape, kind, offset))
    start = pos + (32 - pos % 32) % 32
    return meta, infos, start, len(data)


class MakeGgufTest(unittest.TestCase):
    def run_tool(self, config, *extra):
        with tempfile.TemporaryDirectory() as tmp:
            cfg = os.path.join(tmp, "config.json")
            with open(cfg, "w") as f:
                f.write(config if isinstance(config, str) else json.dumps(config))
            out = os.path.join(tmp, "m.gguf")
            run = subprocess.run([sys.executable, TOOL, "--config", cfg, "--out", out, *extra],
                                 capture_output=True, text=True)
            written = read_gguf(out) if os.path.exists(out) else None
            leftovers = sorted(set(os.listdir(tmp)) - {"config.json", "m.gguf"})
            return run, written, leftovers, cfg

    def test_small_mixtral_reads_back(self):
        run, written, leftovers, _ = self.run_tool(SMALL)
        self.assertEqual(run.returncode, 0, run.stderr)
        self.assertEqual(leftovers, [])
        meta, infos, start, size = written
        self.assertEqual(meta["general.architecture"], "llama")
        self.assertEqual(meta["llama.block_count"], 2)
        self.assertEqual(meta["llama.expert_count"], 4)
        self.assertEqual(meta["llama.expert_used_count"], 2)
        self.assertEqual(meta["llama.attention.head_count_kv"], 2)
        self.assertEqual(len(meta["tokenizer.ggml.tokens"]), 301)
        self.assertEqual(meta["tokenizer.ggml.tokens"][3 + 0x0A], "<0x0A>")
        by_name = {name: (shape, kind, offset) for name, shape, kind, offset in infos}
        self.assertEqual(len(infos), 1 + 2 * 10 + 2)  # embedding, 10 a layer, norm and head
        self.assertEqual(by_name["blk.1.ffn_down_exps.weight"][:2], ((96, 64, 4), 3))
        self.assertEqual(by_name["blk.0.attn_k.weight"][0], (64, 32))
        self.assertEqual(by_name["blk.0.ffn_gate_inp.weight"][:2], ((64, 4), 0))
        # Offsets: each tensor's bytes (Q4_1: 20 a block of 32; float32: 4 an
        # element), aligned to 32, back to back, and the file ends with the last.
        end = 0
        for name, shape, kind, offset in infos:
            count = 1
            for d in shape:
                count *= d
            self.assertEqual(offset, end, name)
            nbytes = count // 32 * 20 if kind == 3 else count * 4
            end = offset + nbytes + (32 - nbytes % 32) % 32
        self.assertEqual(start + end, size)

    def test_bad_configs_name_the_file_and_field(self):
        cases = [
            ({**SMALL, "hidden_size": None}, "hidden_size is missing"),
            ({k: v for k, v in SMALL.items() if k != "vocab_size"}, "vocab_size is missing"),
            ({**SMALL, "intermediate_size": 100}, "intermediate_size 100 is not a multiple"),
            ({**SMALL, "vocab_size": 100}, "vocab_size 100 is under 259"),
            ({k: v for k, v in SMALL.items() if k != "num_experts_per_tok"},
             "num_local_experts without num_experts_per_tok"),
            ("{not json", "config.json: "),
        ]
        for config, message in cases:
            with self.subTest(message=message):
                run, written, leftovers, cfg = self.run_tool(config)
                self.assertNotEqual(run.returncode, 0)
                self.assertIn(message, run.stderr)
                self.assertIn(cfg, run.stderr)
                self.assertIsNone(written)
                self.assertEqual(leftovers, [])


class BenchArgumentsTest(unittest.TestCase):
    """bench.mjs checks its arguments before it loads node-llama-cpp (not installed here)."""

    def run_bench(self, *args):
        return subprocess.run(["node", os.path.join(ROOT, "bench", "llamacpp", "bench.mjs"), *args],
                              capture_output=True, text=True)

    def test_bad_arguments_are_named(self):
        with tempfile.NamedTemporaryFile(suffix=".gguf") as model:
            cases = [
                ((), 2, "usage: node bench.mjs"),
                ((model.name, "beam"), 2, "usage: node bench.mjs"),
                (("/nonexistent/m.gguf", "greedy"), 1, "/nonexistent/m.gguf: no such file"),
                ((model.name, "greedy", "0"), 2, "TOKENS must be a whole number above 0"),
                ((model.name, "sampled", "4", "1", "2", "2.5"), 2, "PROMPT must be a whole number"),
            ]
            for args, code, message in cases:
                with self.subTest(args=args):
                    run = self.run_bench(*args)
                    self.assertEqual(run.returncode, code, run.stderr)
                    self.assertIn(message, run.stderr)


if __name__ == "__main__":
    unittest.main()
