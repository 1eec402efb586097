#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz/) with clang in build-fuzz/ and runs
# each for FUZZ_SECONDS (default 30) on a copy of its seed corpus. Exits
# non-zero when any target finds a crash, a leak, a sanitizer error or a
# timeout; the input that did it is kept in build-fuzz/fuzz-artifacts/<target>/.
#
#   scripts/fuzz.sh                          # every target, 30 s each
#   FUZZ_RUNS=150000 scripts/fuzz.sh         # repeatable: as the test command runs it
#   FUZZ_SECONDS=600 scripts/fuzz.sh config_fuzz
#   build-fuzz/bin/safetensors_header_fuzz build-fuzz/fuzz-artifacts/...  # replay
set -euo pipefail

cd "$(dirname "$0")/.."
FUZZ_SECONDS=${FUZZ_SECONDS:-30}
# FUZZ_RUNS=N: exactly N inputs per target from a fixed seed instead of a
# time budget, so a run is repeatable: the test command uses it, so CI never
# fails by chance on unchanged code. Time-bounded runs explore further.
FUZZ_RUNS=${FUZZ_RUNS:-}
if [ -n "$FUZZ_RUNS" ]; then
  budget=(-runs="$FUZZ_RUNS" -seed=1)
  budget_text="$FUZZ_RUNS runs from seed 1"
else
  budget=(-max_total_time="$FUZZ_SECONDS")
  budget_text="${FUZZ_SECONDS}s"
fi
BUILD_DIR=build-fuzz

# target -> seed corpus folder and dictionary under tests/fuzz/
declare -A CORPUS=([safetensors_header_fuzz]=safetensors [config_fuzz]=config
                   [tokenizer_json_fuzz]=tokenizer_json [tokenizer_encode_fuzz]=tokenizer_encode
                   [quant_json_fuzz]=quant_json [openai_request_fuzz]=openai_request
                   [jinja_template_fuzz]=jinja_template [http_request_fuzz]=http_request
                   [launch_config_fuzz]=launch_config [torch_bin_fuzz]=torch_bin
                   [grammar_fuzz]=grammar [tool_calls_fuzz]=tool_calls
                   [openai_routes_fuzz]=openai_routes)
declare -A DICT=([safetensors_header_fuzz]=safetensors.dict [config_fuzz]=config.dict
                 [tokenizer_json_fuzz]=tokenizer_json.dict
                 [tokenizer_encode_fuzz]=tokenizer_encode.dict [quant_json_fuzz]=quant_json.dict
                 [openai_request_fuzz]=openai_request.dict [jinja_template_fuzz]=jinja_template.dict
                 [http_request_fuzz]=http_request.dict [launch_config_fuzz]=launch_config.dict
                 [torch_bin_fuzz]=torch_bin.dict [grammar_fuzz]=grammar.dict
                 [tool_calls_fuzz]=tool_calls.dict [openai_routes_fuzz]=openai_routes.dict)

targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=(safetensors_header_fuzz config_fuzz tokenizer_json_fuzz tokenizer_encode_fuzz
           quant_json_fuzz openai_request_fuzz jinja_template_fuzz http_request_fuzz
           launch_config_fuzz torch_bin_fuzz grammar_fuzz tool_calls_fuzz openai_routes_fuzz)
fi
for t in "${targets[@]}"; do
  if [ -z "${CORPUS[$t]:-}" ]; then
    echo "fuzz.sh: unknown target '$t' (known: ${!CORPUS[*]})" >&2
    exit 2
  fi
done

CC=clang CXX=clang++ cmake -S . -B "$BUILD_DIR" -G Ninja \
  -DACCEL_BUILD_FUZZERS=ON -DACCEL_BUILD_TESTS=OFF -DACCEL_BUILD_BENCHMARKS=OFF \
  -DACCEL_WITH_SERVER=OFF -DACCEL_USE_PCH=OFF >/dev/null
ninja -C "$BUILD_DIR" "${targets[@]}"

work=$(mktemp -d "${TMPDIR:-/tmp}/accel-fuzz.XXXXXX")
trap 'rm -rf "$work"' EXIT

# Sanitizer reports with symbols; a UBSan error is fatal (also compiled so).
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0:symbolize=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

failed=()
for t in "${targets[@]}"; do
  corpus="$work/$t"
  cp -r "tests/fuzz/corpus/${CORPUS[$t]}" "$corpus"
  artifacts="$BUILD_DIR/fuzz-artifacts/$t"
  mkdir -p "$artifacts"
  echo "=== $t: $budget_text on $(ls "$corpus" | wc -l) seeds" >&2
  # libFuzzer's progress goes to a log; its end is shown on a crash.
  log="$artifacts/last-run.log"
  if "$BUILD_DIR/bin/$t" "$corpus" \
      "${budget[@]}" -max_len=65536 -timeout=10 -rss_limit_mb=2048 \
      -dict="tests/fuzz/${DICT[$t]}" -artifact_prefix="$artifacts/" -print_final_stats=1 \
      -print_funcs=0 >"$log" 2>&1; then
    echo "=== $t: no crash, $(grep -m1 -o 'number_of_executed_units: [0-9]*' "$log" | grep -o '[0-9]*$') runs" \
         "($(ls "$corpus" | wc -l) inputs in the corpus at the end)" >&2
  else
    tail -n 40 "$log" >&2
    echo "=== $t: FAILED; reproducer(s) in $artifacts/:" >&2
    ls -1 "$artifacts" >&2 || true
    failed+=("$t")
  fi
done

if [ ${#failed[@]} -ne 0 ]; then
  echo "fuzz.sh: crashes in: ${failed[*]}" >&2
  exit 1
fi
echo "fuzz.sh: ${#targets[@]} target(s), $budget_text each, no crash" >&2
