#!/usr/bin/env bash
# Downloads, here, the Debian packages the GPU machine lacks (abseil, RE2,
# utf8proc, nlohmann-json, yaml-cpp, minizip and zlib, GoogleTest, Google Benchmark, and the
# server's gRPC, Protobuf, prometheus-cpp, OpenSSL and Boost) into .deps/, which
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
# The server's (accel-serve and accel-bench-serve, the serve rows of
# gpu_check.sh): gRPC and Protobuf with their compilers, prometheus-cpp (its
# config asks for civetweb and CURL: CURL's headers only, gpu_check.sh names
# the library for the config, since nothing links it, and a carried libcurl
# on LD_LIBRARY_PATH would stand in for the machine's own with dependencies
# it may lack), OpenSSL and Boost's headers; the runtime libraries with them,
# since the GPU machine has none of these (about 26 MB).
apt-get download libgrpc++-dev libgrpc++1.51 libgrpc-dev libgrpc29 libupb0 libc-ares-dev libc-ares2 \
  libprotobuf-dev libprotobuf32 libprotoc32 protobuf-compiler protobuf-compiler-grpc \
  prometheus-cpp-dev libprometheus-cpp-core1.0 libprometheus-cpp-pull1.0 libprometheus-cpp-push1.0 \
  civetweb libcivetweb-dev libcivetweb1 libcurl4-openssl-dev libssl-dev libssl3 libboost1.74-dev
ls -l
