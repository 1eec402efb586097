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
# shellcheck source=scripts/npm_pinned.sh
source scripts/npm_pinned.sh
npm_pinned compare.sh "$src" "$npm_dir" --ignore-scripts
cp "$src/bench.mjs" "$npm_dir/bench.mjs"
shift
exec node "$npm_dir/bench.mjs" "$@"
