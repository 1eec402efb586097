#!/usr/bin/env python3
"""Writes corpus/torch_bin/: seeds of torch_bin_fuzz (checked in; rerun after editing).

Whole .bin files as torch.save lays them out (written by tests/loader/torch_save.py from a
small safetensors file: a dict, an OrderedDict with _metadata, tied and strided views,
unaligned records) and the data.pkl of each alone (the fuzz target wraps a bare pickle in an
archive itself), plus a pickle that names a global that runs code.

    python3 tests/fuzz/make_torch_bin_corpus.py
"""
import json
import os
import struct
import subprocess
import sys
import tempfile
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
TORCH_SAVE = os.path.join(HERE, "..", "loader", "torch_save.py")


def safetensors(path):
    tensors = {"w": ("F32", [2, 3], bytes(range(24))), "t": ("F32", [3, 2], bytes(range(24))),
               "b": ("BF16", [4], bytes(8)), "n": ("I64", [2], bytes(16))}
    header, data = {}, b""
    for name, (dtype, shape, blob) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [len(data), len(data) + len(blob)]}
        data += blob
    raw = json.dumps(header).encode()
    raw += b" " * ((-len(raw)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)


def main():
    out = os.path.join(HERE, "corpus", "torch_bin")
    os.makedirs(out, exist_ok=True)
    variants = {"plain": [], "ordered": ["--ordered", "--tie", "t=w"],
                "strided": ["--transpose", "t"], "unaligned": ["--unaligned", "--same", "t=w"],
                "evil": ["--evil", "/tmp/never"]}
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "in.safetensors")
        safetensors(src)
        for name, args in variants.items():
            path = os.path.join(out, f"{name}.bin")
            subprocess.run([sys.executable, TORCH_SAVE, src, path] + args, check=True)
            with zipfile.ZipFile(path) as z:
                pkl = next(n for n in z.namelist() if n.endswith("/data.pkl"))
                with open(os.path.join(out, f"{name}.pkl"), "wb") as f:
                    f.write(z.read(pkl))
    print(f"{out}: {len(os.listdir(out))} files")


if __name__ == "__main__":
    main()
