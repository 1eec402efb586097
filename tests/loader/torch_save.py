#!/usr/bin/env python3
"""Writes a safetensors file's tensors again as torch.save would: pytorch_model.bin.

The tests' independent writer of .bin checkpoints (tests/loader/torch_bin_test.cc).
No torch is installed here, so this is torch.save's format rebuilt from Python's own
pickle and zipfile modules: the pickle is written by Python's pickler, protocol 2, with
the persistent ids, reduce tuples and globals torch.save writes (torch/serialization.py
_save, torch/_tensor.py _reduce_ex_internal), so OrderedDict state dicts, memoization,
SETITEM batching and the rest come out as Python writes them, not as accel expects them.
Records are stored uncompressed and their data aligned to 64 bytes, as PyTorch's zip
writer does (an extra field of id 'FB' pads each local header).

  torch_save.py IN.safetensors OUT [options]

OUT is a file (one .bin) or, with --shards N, a folder that gets
pytorch_model-0000i-of-0000N.bin and pytorch_model.bin.index.json.
  --ordered        a state dict as module.state_dict() returns it: an OrderedDict
                   with a _metadata attribute (Python pickles it with BUILD)
  --tie A=B        tensor A is saved as a view of B's storage (tied weights)
  --same A=B       tensor A is the same tensor object as B (a pickle memo reference)
  --fuse A,B,...   these tensors are views at offsets of one storage
  --transpose A    A's storage holds A transposed; A is a strided view of it
  --unaligned      no padding: data at whatever offset the header leaves
  --location L     the storages' device ('cpu', 'cuda:0', ...)
  --evil PATH      adds an entry that, unpickled by Python, runs `touch PATH`
                   (os.system: what a hostile checkpoint does)
"""
import argparse
import collections
import json
import os
import pickle
import struct
import sys
import types
import zipfile

# Stand-ins under torch's names, so that the pickler writes torch's globals.
torch = types.ModuleType("torch")
torch_utils = types.ModuleType("torch._utils")
torch._utils = torch_utils
sys.modules["torch"] = torch
sys.modules["torch._utils"] = torch_utils


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, backward_hooks):
    raise RuntimeError("never called: this script only writes")


_rebuild_tensor_v2.__module__ = "torch._utils"
torch_utils._rebuild_tensor_v2 = _rebuild_tensor_v2

STORAGE_TYPES = {}
ELEMENT_SIZE = {"F32": 4, "F64": 8, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2,
                "I8": 1, "U8": 1, "BOOL": 1}
for dtype, name in [("F32", "FloatStorage"), ("F64", "DoubleStorage"), ("F16", "HalfStorage"),
                    ("BF16", "BFloat16Storage"), ("I64", "LongStorage"), ("I32", "IntStorage"),
                    ("I16", "ShortStorage"), ("I8", "CharStorage"), ("U8", "ByteStorage"),
                    ("BOOL", "BoolStorage")]:
    cls = type(name, (), {"__module__": "torch"})
    setattr(torch, name, cls)
    STORAGE_TYPES[dtype] = cls


class Storage:
    def __init__(self, key, dtype, data, location):
        self.key, self.dtype, self.data, self.location = key, dtype, data, location


class Tensor:
    def __init__(self, storage, offset, size, stride):
        self.storage, self.offset, self.size, self.stride = storage, offset, size, stride

    def __reduce_ex__(self, protocol):
        # torch/_tensor.py: (storage, storage_offset, tuple(size), stride, requires_grad,
        # backward_hooks), backward_hooks an empty OrderedDict.
        return (_rebuild_tensor_v2, (self.storage, self.offset, tuple(self.size),
                                     tuple(self.stride), False, collections.OrderedDict()))


def contiguous_strides(shape):
    strides, n = [], 1
    for d in reversed(shape):
        strides.insert(0, n)
        n *= d
    return strides


def read_safetensors(path):
    with open(path, "rb") as f:
        blob = f.read()
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8:8 + n])
    header.pop("__metadata__", None)
    out = {}
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        begin, end = info["data_offsets"]
        out[name] = (info["dtype"], info["shape"], blob[8 + n + begin:8 + n + end])
    return out


def transposed_bytes(data, shape, size):
    rows, cols = shape
    return b"".join(data[(r * cols + c) * size:(r * cols + c + 1) * size]
                    for c in range(cols) for r in range(rows))


def build_state_dict(tensors, names, args, keys):
    ties = dict(t.split("=") for t in args.tie)
    same = dict(t.split("=") for t in args.same)
    fused = {}
    for group in args.fuse:
        members = group.split(",")
        for m in members:
            fused[m] = members
    made = {}
    storages = {}

    def storage_for(key_name, dtype, data):
        if key_name not in storages:
            storages[key_name] = Storage(str(next(keys)), dtype, data, args.location)
        return storages[key_name]

    state = collections.OrderedDict() if args.ordered else {}
    for name in names:
        dtype, shape, data = tensors[name]
        size = ELEMENT_SIZE[dtype]
        if name in same:
            state[name] = made[same[name]]
            continue
        if name in ties:
            other = made[ties[name]]
            t = Tensor(other.storage, other.offset, shape, contiguous_strides(shape))
        elif name in fused:
            members = fused[name]
            blob = b"".join(tensors[m][2] for m in members)
            offset = 0
            for m in members[:members.index(name)]:
                offset += len(tensors[m][2]) // size
            t = Tensor(storage_for("fused:" + members[0], dtype, blob), offset, shape,
                       contiguous_strides(shape))
        elif name in args.transpose:
            rows, cols = shape
            t = Tensor(storage_for(name, dtype, transposed_bytes(data, shape, size)), 0, shape,
                       [1, rows])
        else:
            t = Tensor(storage_for(name, dtype, data), 0, shape, contiguous_strides(shape))
        made[name] = t
        state[name] = t
    if args.evil:
        class Evil:
            def __reduce__(self):
                return (os.system, ("touch " + args.evil,))
        state["evil"] = Evil()
    if args.ordered:
        # module.state_dict() sets this; Python pickles it as the OrderedDict's state.
        state._metadata = collections.OrderedDict([("", {"version": 1}),
                                                   ("model", {"version": 1})])
    return state, storages


def write_bin(path, state, storages, args):
    written = []

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            if isinstance(obj, Storage):
                if obj.key not in [s.key for s in written]:
                    written.append(obj)
                numel = len(obj.data) // ELEMENT_SIZE[obj.dtype]
                return ("storage", STORAGE_TYPES[obj.dtype], obj.key, obj.location, numel)
            return None

    import io
    buf = io.BytesIO()
    Pickler(buf, protocol=2).dump(state)
    archive = os.path.splitext(os.path.basename(path))[0]
    with open(path, "wb") as raw:
        with zipfile.ZipFile(raw, "w", zipfile.ZIP_STORED) as zf:
            def record(name, data):
                info = zipfile.ZipInfo(f"{archive}/{name}", date_time=(1980, 1, 1, 0, 0, 0))
                info.compress_type = zipfile.ZIP_STORED
                if not args.unaligned:
                    start = raw.tell() + 30 + len(info.filename.encode()) + 4
                    pad = (-start) % 64
                    info.extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
                zf.writestr(info, data)
            record("data.pkl", buf.getvalue())
            record("byteorder", b"little")
            for s in written:
                record(f"data/{s.key}", s.data)
            record("version", b"3\n")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("input")
    p.add_argument("output")
    p.add_argument("--ordered", action="store_true")
    p.add_argument("--tie", action="append", default=[])
    p.add_argument("--same", action="append", default=[])
    p.add_argument("--fuse", action="append", default=[])
    p.add_argument("--transpose", action="append", default=[])
    p.add_argument("--unaligned", action="store_true")
    p.add_argument("--location", default="cpu")
    p.add_argument("--shards", type=int, default=0)
    p.add_argument("--evil")
    args = p.parse_args()
    tensors = read_safetensors(args.input)
    names = list(tensors)
    keys = iter(range(1 << 30))
    if args.shards == 0:
        state, storages = build_state_dict(tensors, names, args, keys)
        write_bin(args.output, state, storages, args)
        return
    os.makedirs(args.output, exist_ok=True)
    n = args.shards
    weight_map = {}
    for i in range(n):
        part = names[i::n]
        shard = f"pytorch_model-{i + 1:05d}-of-{n:05d}.bin"
        state, storages = build_state_dict(tensors, part, args, iter(range(1 << 30)))
        write_bin(os.path.join(args.output, shard), state, storages, args)
        for name in part:
            weight_map[name] = shard
    total = sum(len(t[2]) for t in tensors.values())
    with open(os.path.join(args.output, "pytorch_model.bin.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


if __name__ == "__main__":
    main()
