#!/usr/bin/env bash
# Compiles every accel source (syntax only) against another libtorch's headers,
# so that a build against PyTorch 2.x (the GPU machine's pip wheel, or a
# user's CUDA libtorch) does not first fail on a device: the device run of
# 2026-11-29 lost three of its five calls to dist/process_group.cc.
#
#   bash scripts/torch2_syntax_check.sh HEADERS.tar.xz|DIR [FILTER]
#
# FILTER: a regular expression; only the sources whose path matches it
# (the files a change touched: seconds instead of minutes).
# HEADERS: the `include` folder of that libtorch, or the tarball of it that
# scripts/gpu_check.sh writes to OUT/torch_include.tar.xz when its build fails
# (kept here in .deps/, which git ignores). Uses build/compile_commands.json
# (after scripts/setup.sh and a configure), each file's own flags, with that
# libtorch's include folders ahead of Debian's and the precompiled header's
# includes given explicitly (the build force-includes them). Prints each file
# that fails and the first errors; exits 1 if any did. About 23 minutes on
# this machine's 2 cores.
#
# Against PyTorch 2.11.0+cu130's headers (2026-11-29) every file compiles but
# server/'s: a pip wheel bundles protobuf headers in its include folder, which
# then shadow the system protobuf that the generated .pb.h files need (a
# build of accel-serve against a pip libtorch needs that libtorch's include
# folder after the system's; not solved).
set -uo pipefail
cd "$(dirname "$0")/.."
src=${1:?usage: torch2_syntax_check.sh HEADERS.tar.xz|DIR [FILTER]}
filter=${2:-}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [[ -d $src ]]; then
  inc=$(cd "$src" && pwd)
else
  tar -C "$work" -xJf "$src" && inc=$work/include
fi
python3 - "$inc" "$work" "$filter" <<'PY'
import json, re, shlex, sys
inc, work, wanted = sys.argv[1], sys.argv[2], sys.argv[3]
db = json.load(open("build/compile_commands.json"))
seen, cmds = set(), []
for e in db:
    f = e["file"]
    if f in seen or not f.endswith(".cc") or "/build/" in f or (wanted and not re.search(wanted, f)):
        continue
    seen.add(f)
    args = shlex.split(e["command"])
    out, skip = [], False
    for i, a in enumerate(args):
        if skip:
            skip = False
            continue
        if a in ("-o", "-MF", "-MT", "-include"):
            skip = True
            continue
        if a in ("-MD", "-Winvalid-pch", "-Werror") or a == "/usr/include/torch/csrc/api/include":
            if a == "/usr/include/torch/csrc/api/include" and out and out[-1] == "-isystem":
                out.pop()
            continue
        out.append(a)
    # The precompiled header's includes (core/CMakeLists.txt), then syntax only.
    pre = ["-isystem", inc, "-isystem", f"{inc}/torch/csrc/api/include", "-include",
           "ATen/core/Tensor.h", "-include", "ATen/Functions.h", "-include", "ATen/TensorOperators.h",
           "-fsyntax-only"]
    out = [out[0]] + pre + out[1:]
    cmds.append({"dir": e["directory"], "args": out, "file": f})
json.dump(cmds, open(f"{work}/cmds.json", "w"))
PY
python3 - "$work" <<'PY'
import json, subprocess, sys, concurrent.futures, os
work = sys.argv[1]
cmds = json.load(open(f"{work}/cmds.json"))
def run(c):
    r = subprocess.run(c["args"], cwd=c["dir"], capture_output=True, text=True)
    return c["file"], r.returncode, r.stderr
failed = 0
with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 2) as pool:
    for f, rc, err in pool.map(run, cmds):
        if rc != 0:
            failed += 1
            errors = [l for l in err.splitlines() if "error" in l][:3]
            print(f"FAIL {f}\n  " + "\n  ".join(errors))
print(f"torch2_syntax_check: {len(cmds) - failed} of {len(cmds)} files compile")
sys.exit(1 if failed else 0)
PY
