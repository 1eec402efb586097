# shellcheck shell=bash
# Sourced by the scripts that run Node.js packages pinned by a lock file
# (scripts/openai_client.sh, jinja_references.sh, tokenizer_references.sh,
# check_deploy.sh, bench/llamacpp/compare.sh).
#
#   npm_pinned NAME SRC_DIR NPM_DIR [NPM_CI_FLAG...]
#
# Checks that node and npm are installed, then installs SRC_DIR's
# package.json and package-lock.json into NPM_DIR with `npm ci` (the only
# step that uses the network), unless that lock file is installed there
# already. NAME prefixes its messages.

npm_pinned() {
  local name=$1 src=$2 npm_dir=$3
  shift 3
  local tool
  for tool in node npm; do
    if ! command -v "$tool" >/dev/null 2>&1; then
      echo "$name: '$tool' is missing; install Node.js and npm" \
           "(Debian: apt-get install nodejs npm; scripts/setup.sh does it)" >&2
      exit 1
    fi
  done
  if [ -d "$npm_dir/node_modules" ] && cmp -s "$src/package-lock.json" "$npm_dir/package-lock.json"; then
    return 0
  fi
  echo "$name: npm ci into $npm_dir" >&2
  rm -rf "$npm_dir"
  mkdir -p "$npm_dir"
  cp "$src/package.json" "$src/package-lock.json" "$npm_dir/"
  (cd "$npm_dir" && npm ci --no-audit --no-fund --loglevel=error "$@" >&2)
}
