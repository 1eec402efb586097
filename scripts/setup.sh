#!/usr/bin/env bash
# Installs every system dependency of accel from Debian packages.
# libopenblas0-openmp takes over libblas.so.3 (Debian's alternatives), which
# libtorch's float32 matrix products call: the reference BLAS that comes by
# default is about 30x slower for training (docs/BENCHMARKS.md). The OpenMP
# build shares libtorch's thread pool (libgomp) instead of starting its own.
# prometheus brings promtool (the tests lint /metrics with it); openssl makes
# the TLS test's certificate. prometheus-cpp-dev: the server's metrics
# (core) and its metrics port (pull, on civetweb); libboost-dev: Boost.Beast
# and Boost.Asio (header-only) under the OpenAI HTTP API. libminizip-dev reads
# the zip directory of pytorch_model.bin files.
# Idempotent and quiet: when everything is present it only checks, in about a second.
set -euo pipefail

packages=(
  build-essential cmake ninja-build ccache pkg-config git lld python3
  clang clang-format clang-tidy libclang-rt-14-dev
  libtorch-dev libopenblas0-openmp
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libabsl-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  nlohmann-json3-dev libcivetweb-dev prometheus-cpp-dev libboost-dev libre2-dev libgloo-dev
  libgoogle-glog-dev
  libutf8proc-dev libssl-dev libyaml-cpp-dev libminizip-dev
  prometheus openssl
  yamllint
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$p")
  fi
done

# Node.js runs HuggingFace tokenizers for the tokenizer references
# (scripts/tokenizer_references.sh). Checked by command: a nodejs from
# elsewhere (NodeSource) already brings npm, and Debian's npm would conflict.
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  missing+=(nodejs npm)
fi

# kubectl renders deploy/ (kubectl kustomize; scripts/check_deploy.sh). Checked
# by command: a kubectl from elsewhere (Google's or Kubernetes' apt
# repository) conflicts with Debian's kubernetes-client.
if ! command -v kubectl >/dev/null 2>&1; then
  missing+=(kubernetes-client)
fi

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

echo "setup: installing ${#missing[@]} package(s): ${missing[*]}" >&2
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq >/dev/null
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "setup: done" >&2
