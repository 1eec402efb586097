#!/usr/bin/env bash
# Builds everything and runs every check: clang-format in check mode, the
# include layering, the tokenizer references (HF tokenizers through node, one
# of the two steps after setup that may use the network: npm ci, once per lock
# file), the deployment files (scripts/check_deploy.sh; the other npm ci),
# the unit and integration tests (ctest), the core, loader
# and dispatch tests again under ASan+UBSan, and a short bounded fuzz run of
# the parsers of untrusted bytes.
# Works on a fresh machine: scripts/setup.sh installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
bash scripts/setup.sh

step_start=$(date +%s)
step() {
  local now
  now=$(date +%s)
  [ -n "${step_name:-}" ] && printf '=== %s took %d s\n' "$step_name" "$((now - step_start))"
  step_name="$*"
  step_start=$now
  printf '\n=== %s\n' "$*"
}
start=$(date +%s)
passed=0
failed=0
log=$(mktemp)
trap 'rm -f "$log"' EXIT

# Runs ctest with the given arguments and adds its counts to the totals.
run_ctest() {
  local rc=0
  ctest "$@" 2>&1 | tee "$log" || rc=$?
  local line
  line=$(grep -E '[0-9]+% tests passed, [0-9]+ tests? failed out of [0-9]+' "$log" | tail -1 || true)
  if [ -n "$line" ]; then
    local total bad
    total=$(sed -E 's/.* out of ([0-9]+).*/\1/' <<<"$line")
    bad=$(sed -E 's/.* ([0-9]+) tests? failed.*/\1/' <<<"$line")
    passed=$((passed + total - bad))
    failed=$((failed + bad))
  fi
  if [ "$rc" -ne 0 ]; then
    echo "accel: $passed passed, $failed failed"
    exit "$rc"
  fi
}

step "format: clang-format --dry-run -Werror"
git ls-files -z '*.h' '*.cc' | xargs -0 -r clang-format --dry-run -Werror

step "layering: includes follow the component graph (tools/check_layering.py)"
python3 tools/check_layering.py

step "build (build/, RelWithDebInfo)"
cmake --preset default >/dev/null
cmake --build --preset default

step "tokenizer references: HF tokenizers through node (scripts/tokenizer_references.sh)"
bash scripts/tokenizer_references.sh build
bash scripts/jinja_references.sh build
step "openai client: the pinned openai npm package for the HTTP API tests (scripts/openai_client.sh)"
bash scripts/openai_client.sh build

step "deploy: yamllint, kustomize, schemas, Dockerfile and manifests against accel-serve (scripts/check_deploy.sh)"
bash scripts/check_deploy.sh build

step "tests"
run_ctest --preset default

step "ASan + UBSan build and the core, loader, quant, dispatch, tokenizer, GEMV and metrics tests (build-asan/)"
cmake --preset asan >/dev/null
cmake --build --preset asan --target accel-sanitized-tests
ln -sfn "$PWD/build/tokenizer-refs" build-asan/tokenizer-refs  # the same references
ln -sfn "$PWD/build/jinja-refs" build-asan/jinja-refs
# libtorch's own static initialisers allocate once and never free.
ASAN_OPTIONS="detect_leaks=1:abort_on_error=1" \
  LSAN_OPTIONS="suppressions=$PWD/tests/lsan.supp" UBSAN_OPTIONS="print_stacktrace=1" \
  run_ctest --preset asan

step "fuzz (bounded and repeatable: ${FUZZ_RUNS:=150000} runs per target from a fixed seed)"
FUZZ_RUNS="$FUZZ_RUNS" bash scripts/fuzz.sh

step "done"
echo "all checks passed in $(( $(date +%s) - start )) s"
echo "accel: $passed passed, $failed failed"
