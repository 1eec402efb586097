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

for tool in node npm; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "openai_client.sh: '$tool' is missing; install Node.js and npm" \
         "(Debian: apt-get install nodejs npm; scripts/setup.sh does it)" >&2
    exit 1
  fi
done

if [ -d "$npm_dir/node_modules/openai" ] && cmp -s "$src/package-lock.json" "$npm_dir/package-lock.json"; then
  echo "openai_client.sh: $npm_dir is up to date" >&2
  exit 0
fi
echo "openai_client.sh: npm ci into $npm_dir" >&2
rm -rf "$npm_dir"
mkdir -p "$npm_dir"
cp "$src/package.json" "$src/package-lock.json" "$npm_dir/"
(cd "$npm_dir" && npm ci --no-audit --no-fund --loglevel=error >&2)
echo "openai_client.sh: openai $(node -p "require('$npm_dir/node_modules/openai/package.json').version") in $npm_dir" >&2
