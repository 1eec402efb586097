#!/usr/bin/env bash
# Test set-up for tests/server/openai_http_test.cc: installs the official
# `openai` npm client pinned by tests/server/openai_client/package-lock.json
# into BUILD_DIR/npm-openai with `npm ci` (the only step that uses the
# network; skipped when that lock file is already installed). The tests run
# tests/server/openai_client/*.js against it and never download.
#
#   scripts/openai_client.sh build
set -euo pipefail
cd "$(dirname "$0")/.."

if [ $# -ne 1 ]; then
  echo "usage: scripts/openai_client.sh BUILD_DIR" >&2
  exit 2
fi
build=$(cd "$1" && pwd)
src=tests/server/openai_client
npm_dir="$build/npm-openai"

# shellcheck source=scripts/npm_pinned.sh
source scripts/npm_pinned.sh
npm_pinned openai_client.sh "$src" "$npm_dir"
echo "openai_client.sh: openai $(node -p "require('$npm_dir/node_modules/openai/package.json').version") in $npm_dir" >&2
