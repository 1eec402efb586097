#!/usr/bin/env bash
# Compiles every line of accel's CUDA code on a machine without a GPU (and
# with Debian's CPU-only libtorch 1.13), so a device run is never the first
# compile:
#   - the kernels (quant/cuda/, models/cuda/: nvcc, sm_80 and sm_90, warnings
#     as errors) and their tests and benchmark, through the default build;
#   - the at::Tensor wrappers that only a CUDA libtorch compiles
#     (quant/cuda_matmul.cc, models/internal/paged_attention_cuda.cc and fused_ops.cc, the
#     engine's device-memory probe and decode CUDA graphs:
#     engine/internal/cuda_memory_probe.cc, decode_graph_runner.cc, and the
#     count of its waits for the device, cuda_sync_counter.cc), syntax
#     only, with their CUDA define on, against Debian's c10/cuda and ATen/cuda
#     headers (their one generated header, cuda_cmake_macros.h, stubbed);
#   - models/internal/sdpa.cc against PyTorch 2.x's declaration of
#     at::scaled_dot_product_attention (written out below from its schema:
#     query, key, value, attn_mask, dropout_p, is_causal, *, scale,
#     enable_gqa), with ACCEL_TORCH_HAS_SDPA forced on, syntax only.
# Usage: bash scripts/cuda_compile_check.sh   (after scripts/setup.sh; uses build/)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
command -v nvcc >/dev/null || export PATH="/usr/local/cuda/bin:$PATH"
command -v nvcc >/dev/null || { echo "cuda_compile_check: no nvcc" >&2; exit 1; }

cmake --preset default >/dev/null
cmake --build --preset default --target accel_quant_cuda accel_models_cuda \
  quant_cuda_kernels_test models_cuda_attention_kernels_test accel-bench-quant-cuda

stubs=$(mktemp -d)
trap 'rm -rf "$stubs"' EXIT
mkdir -p "$stubs/cuda/c10/cuda/impl" "$stubs/torch2/ATen/ops"
printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' \
  >"$stubs/cuda/c10/cuda/impl/cuda_cmake_macros.h"
cat >"$stubs/torch2/ATen/ops/scaled_dot_product_attention.h" <<'H'
#pragma once
#include <optional>
#include <ATen/core/Tensor.h>
namespace at {
at::Tensor scaled_dot_product_attention(const at::Tensor& query, const at::Tensor& key,
                                        const at::Tensor& value,
                                        const std::optional<at::Tensor>& attn_mask = {},
                                        double dropout_p = 0.0, bool is_causal = false,
                                        std::optional<double> scale = std::nullopt,
                                        bool enable_gqa = false);
}
H

flags=(-std=c++17 -fsyntax-only -Wall -Wextra -Werror -Wno-unused-parameter -pthread
  -D_GLIBCXX_USE_CXX11_ABI=1 -DUSE_C10D_GLOO -DUSE_DISTRIBUTED -I. -isystem
  /usr/include/torch/csrc/api/include)
cuda_include=$(dirname "$(dirname "$(command -v nvcc)")")/include
echo "syntax: quant/cuda_matmul.cc (ACCEL_WITH_QUANT_CUDA)"
g++ "${flags[@]}" -I"$stubs/cuda" -I"$cuda_include" -DACCEL_WITH_QUANT_CUDA quant/cuda_matmul.cc
for f in models/internal/paged_attention_cuda.cc models/internal/fused_ops.cc; do
  echo "syntax: $f (ACCEL_WITH_MODELS_CUDA)"
  g++ "${flags[@]}" -I"$stubs/cuda" -I"$cuda_include" -DACCEL_WITH_MODELS_CUDA "$f"
done
for f in engine/internal/cuda_memory_probe.cc engine/internal/decode_graph_runner.cc \
  engine/internal/cuda_sync_counter.cc; do
  echo "syntax: $f (ACCEL_WITH_ENGINE_CUDA)"
  g++ "${flags[@]}" -I"$stubs/cuda" -I"$cuda_include" -DACCEL_WITH_ENGINE_CUDA "$f"
done
echo "syntax: models/internal/sdpa.cc (libtorch 2.x's scaled_dot_product_attention)"
g++ "${flags[@]}" -I"$stubs/torch2" -DACCEL_TORCH_HAS_SDPA=1 models/internal/sdpa.cc
echo "cuda_compile_check: all CUDA code compiles"
