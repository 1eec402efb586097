#!/usr/bin/env bash
# On the GPU machine (the device tool; ../shared/DESIGN.md): builds the core,
# the CUDA kernels, the GPU-relevant tests and the benchmarks against that
# machine's PyTorch, then runs the CUDA tests and the GPU benchmark rows.
# Everything it prints is also written to $OUT (build.log, check.log).
#
#   scripts/gpu_deps.sh            # here: the packages it lacks, into .deps/
#   (device) bash scripts/gpu_check.sh [build|test|generate|bench|all]...
#
# The machine has no gRPC development files, so the server is left out.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/accel-gpu-out}
mkdir -p "$OUT"
phases=("$@")
[[ ${#phases[@]} -eq 0 ]] && phases=(all)
want() { for p in "${phases[@]}"; do [[ $p == all || $p == "$1" ]] && return 0; done; return 1; }
log() { echo "=== $*" | tee -a "$OUT/check.log"; }

deps=/tmp/accel-deps
build=${ACCEL_GPU_BUILD:-build-gpu}
if [[ ! -d $deps/usr ]]; then
  mkdir -p "$deps"
  for f in .deps/*.deb; do dpkg -x "$f" "$deps"; done
fi
export LD_LIBRARY_PATH="$deps/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
torch_prefix=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')
torch_lib=$(python3 -c 'import torch,os;print(os.path.join(os.path.dirname(torch.__file__),"lib"))')
export LD_LIBRARY_PATH="$torch_lib:$LD_LIBRARY_PATH"

targets=(accel-make-model accel-generate accel-bench-offload accel-bench-moe accel-bench-quant-cuda
  quant_cuda_kernels_test quant_cuda_matmul_test dispatch_device_stager_test dispatch_dispatch_test
  models_load_model_test models_quantize_test)
[[ -n ${ACCEL_GPU_TARGETS:-} ]] && read -r -a targets <<<"$ACCEL_GPU_TARGETS"

if want build; then
  log "machine"
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc;
    python3 -c 'import torch;print("torch",torch.__version__,torch.version.cuda)'; nvcc --version | tail -1;
    g++ --version | head -1; cmake --version | head -1; } 2>&1 | tee -a "$OUT/check.log"
  log "configure"
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$torch_prefix;$deps/usr" -DCMAKE_DISABLE_FIND_PACKAGE_PkgConfig=ON \
    -DACCEL_WITH_SERVER=OFF -DACCEL_WERROR=OFF -DACCEL_USE_CCACHE=OFF \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DACCEL_WITH_CUDA=ON >"$OUT/configure.log" 2>&1
  rc=$?
  grep -E "accel:|Error|error" "$OUT/configure.log" | head -30 | tee -a "$OUT/check.log"
  [[ $rc -ne 0 ]] && { tail -40 "$OUT/configure.log"; exit 1; }
  log "build (${#targets[@]} targets)"
  start=$(date +%s)
  ninja -C "$build" -k 0 "${targets[@]}" >"$OUT/build.log" 2>&1
  rc=$?
  echo "build rc=$rc in $(( $(date +%s) - start )) s" | tee -a "$OUT/check.log"
  grep -E "error:|FAILED:" "$OUT/build.log" | head -40 | tee -a "$OUT/check.log"
  if [[ $rc -ne 0 ]]; then  # the headers, to compile against them elsewhere
    tar -C "$torch_prefix/../.." -cf - include | xz -T0 -3 >"$OUT/torch_include.tar.xz"
  fi
fi

bin=$build/bin
run() {  # label, timeout seconds, command...
  local label=$1 limit=$2; shift 2
  log "$label"
  timeout "$limit" "$@" 2>&1 | tee -a "$OUT/check.log" | tail -60
  echo "rc=${PIPESTATUS[0]}" | tee -a "$OUT/check.log"
}

if want test; then
  # libstdc++ must come before libtorch (CMakeLists.txt says why).
  [[ -x $bin/dispatch_dispatch_test ]] &&
    readelf -d "$bin/dispatch_dispatch_test" | grep NEEDED | head -3 | tee -a "$OUT/check.log"
  for t in quant_cuda_kernels_test quant_cuda_matmul_test dispatch_device_stager_test \
    dispatch_dispatch_test models_load_model_test models_quantize_test; do
    [[ -x $bin/$t ]] || { log "$t: not built"; continue; }
    run "$t" 120 "$bin/$t" --gtest_brief=1
  done
fi

if want generate && [[ -x $bin/accel-generate ]]; then
  # Greedy tokens of a small Mixtral and Llama: all on the cpu, against the GPU
  # as the execution device with layers / experts on cpu and disk.
  for fam in mixtral llama; do
    m=/tmp/accel-gpu-$fam
    "$bin/accel-make-model" "$m" --family $fam --hidden_size 256 --num_layers 4 --num_heads 4 \
      --vocab_size 1000 --seed 7 >/dev/null
    gen=("$bin/accel-generate" --model "$m" --input_ids 1,5,9,200,33,7 --max_new_tokens 24 \
      --ignore_eos --json --logprobs)
    cpu=$("${gen[@]}" --device_map cpu 2>&1)
    for variant in "--device_map 0" "--device_map auto --max_memory 0=2MB,cpu=6MB,disk=1GB" \
      "--device_map auto --max_memory 0=2MB,cpu=3MB,disk=1GB --offload_experts --expert_cache 1MB" \
      "--device_map cpu --execution_device cuda:0"; do
      [[ $fam == llama && $variant == *offload_experts* ]] && continue
      # shellcheck disable=SC2086
      gpu=$("${gen[@]}" $variant 2>&1)
      a=$(grep -o '"token_ids":\[[0-9,]*\]' <<<"$cpu" | head -1)
      b=$(grep -o '"token_ids":\[[0-9,]*\]' <<<"$gpu" | head -1)
      if [[ -n $a && $a == "$b" ]]; then r=SAME; else r=DIFFERENT; fi
      log "generate $fam [$variant]: $r"
      echo "cpu: $a" | tee -a "$OUT/check.log"; echo "gpu: $b" | tee -a "$OUT/check.log"
      [[ $r == SAME ]] || tail -15 <<<"$gpu" | tee -a "$OUT/check.log"
    done
  done
fi

if want bench; then
  [[ -x $bin/accel-bench-quant-cuda ]] && run "accel-bench-quant-cuda" 120 "$bin/accel-bench-quant-cuda"
  [[ -x $bin/accel-bench-offload ]] && run "accel-bench-offload" 200 "$bin/accel-bench-offload" --layers 8 --hidden 4096 --repeats 3
  if [[ -x $bin/accel-bench-moe ]]; then
    run "accel-bench-moe (GPU execution device)" 150 "$bin/accel-bench-moe" --gpu_budget 300MB --rounds 1 --tokens 16
  fi
fi
exit 0
