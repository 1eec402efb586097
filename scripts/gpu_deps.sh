#!/usr/bin/env bash
# Downloads, here, the Debian packages the GPU machine lacks (abseil, RE2,
# utf8proc, nlohmann-json, yaml-cpp, minizip and zlib, GoogleTest, Google Benchmark) into .deps/, which
# the device tool carries; scripts/gpu_check.sh unpacks them there under a
# prefix of their own. The GPU machine has PyTorch (its libtorch), nvcc, CMake
# and ninja but no package registry (../shared/DESIGN.md).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .deps
cd .deps
apt-get download libabsl-dev libabsl20220623 nlohmann-json3-dev libre2-dev libre2-9 \
  libutf8proc-dev libutf8proc2 libgtest-dev libgmock-dev libbenchmark-dev libbenchmark1debian \
  libyaml-cpp-dev libyaml-cpp0.7 libminizip-dev libminizip1 zlib1g-dev
ls -l
