#!/usr/bin/env bash
# llama.cpp on the same machine and shape as an accel benchmark (issue 32's
# comparison, measured rather than quoted). Installs node-llama-cpp 3.21.1
# (package-lock.json: its prebuilt CPU build, the only network step) into
# BUILD/llamacpp-npm, then runs bench.mjs on a GGUF that make_gguf.py wrote:
#   bench/llamacpp/compare.sh build MODEL.gguf greedy|sampled [TOKENS] [SEED] [THREADS] [PROMPT]
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ $# -lt 3 ]; then
  echo "usage: $0 BUILD_DIR MODEL.gguf greedy|sampled [TOKENS] [SEED] [THREADS] [PROMPT]" >&2
  exit 2
fi
build=$(cd "$1" && pwd)
src=bench/llamacpp
npm_dir="$build/llamacpp-npm"
for tool in node npm; do
  command -v "$tool" >/dev/null 2>&1 || { echo "compare.sh: '$tool' is missing (scripts/setup.sh installs it)" >&2; exit 1; }
done
if [ ! -d "$npm_dir/node_modules" ] || ! cmp -s "$src/package-lock.json" "$npm_dir/package-lock.json"; then
  echo "compare.sh: npm ci into $npm_dir" >&2
  rm -rf "$npm_dir"
  mkdir -p "$npm_dir"
  cp "$src/package.json" "$src/package-lock.json" "$npm_dir/"
  (cd "$npm_dir" && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error >&2)
fi
cp "$src/bench.mjs" "$npm_dir/bench.mjs"
shift
exec node "$npm_dir/bench.mjs" "$@"
