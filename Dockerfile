# syntax=docker/dockerfile:1
# Needs BuildKit (the default builder since Docker 23): it builds only the
# stages the selected VARIANT uses.
# accel-serve's image: a Debian bookworm build stage that runs the project's own
# set-up script and CMake preset, then a slim runtime stage with only the
# runtime libraries, the binaries and the embedded default model.
#
#   docker build -t accel-serve:0.1.0 .                                # CPU (default)
#   docker build --build-arg VARIANT=cuda -t accel-serve:0.1.0-cuda .  # NVIDIA GPUs
#   docker run --rm -p 50051:50051 -p 8002:8002 accel-serve:0.1.0 [accel-serve flags]
#
# VARIANT selects the build: cpu (Debian's libtorch 1.13, the `default`
# preset) or cuda (the libtorch of PyTorch 2.x built for CUDA 11.8, from
# LIBTORCH_URL, with Debian's CUDA 11.8 toolkit; the `cuda` preset with the
# server turned on). docs/DEPLOY.md describes both. scripts/check_deploy.sh
# checks this file against the build: the ports, the health service, the
# runtime packages (from the binaries' NEEDED entries) and the paths.
ARG VARIANT=cpu

# --- build: cpu --------------------------------------------------------------
FROM debian:bookworm AS build-cpu
WORKDIR /src
COPY . .
RUN bash scripts/setup.sh \
 && cmake --preset default -DACCEL_BUILD_TESTS=OFF -DACCEL_BUILD_BENCHMARKS=OFF -DACCEL_USE_CCACHE=OFF \
 && cmake --build --preset default --target accel-serve accel-client accel-default-model

# --- build: cuda -------------------------------------------------------------
FROM debian:bookworm AS build-cuda
ARG LIBTORCH_URL=https://download.pytorch.org/libtorch/cu118/libtorch-cxx11-abi-shared-with-deps-2.1.2%2Bcu118.zip
WORKDIR /src
RUN sed -i 's/^Components: main$/Components: main contrib non-free non-free-firmware/' \
      /etc/apt/sources.list.d/debian.sources \
 && apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      ca-certificates curl unzip nvidia-cuda-toolkit \
 && curl -fsSL "$LIBTORCH_URL" -o /tmp/libtorch.zip \
 && unzip -q /tmp/libtorch.zip -d /opt \
 && rm /tmp/libtorch.zip
COPY . .
ENV ACCEL_TORCH_PREFIX=/opt/libtorch
RUN bash scripts/setup.sh \
 && cmake --preset cuda -B build -DACCEL_WITH_SERVER=ON -DACCEL_BUILD_TESTS=OFF \
      -DACCEL_BUILD_BENCHMARKS=OFF -DACCEL_USE_CCACHE=OFF \
 && cmake --build build --target accel-serve accel-client accel-default-model

FROM build-${VARIANT} AS build

# --- runtime -----------------------------------------------------------------
FROM debian:bookworm-slim AS runtime-base
# The packages of the libraries accel-serve and accel-client link directly
# (libc6, libgcc-s1 and libstdc++6 are in the base image; libssl3: accel-serve checks
# --tls_cert / --tls_key with OpenSSL, and the HTTP API's TLS is Boost.Asio's over it;
# Boost.Beast and Asio are header-only, nothing to install for them;
# libprometheus-cpp-core1.0 / -pull1.0: the metrics and the metrics port, which
# runs on civetweb: libcivetweb1, which holds the C++ library too; libminizip1:
# pytorch_model.bin checkpoints).
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      libabsl20220623 libcivetweb1 libgomp1 libgrpc++1.51 libgrpc29 \
      libprometheus-cpp-core1.0 libprometheus-cpp-pull1.0 libprotobuf32 libre2-9 \
      libminizip1 libssl3 libutf8proc2 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 accel \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /tmp accel

FROM runtime-base AS runtime-cpu
# libopenblas0-openmp: libtorch's float32 products go through libblas.so.3,
# and OpenBLAS serves them about 30x faster than the reference BLAS
# (scripts/setup.sh installs the same).
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      libtorch1.13 libopenblas0-openmp \
 && rm -rf /var/lib/apt/lists/*

FROM runtime-base AS runtime-cuda
# libtorch's "with-deps" archive carries the CUDA runtime, cuBLAS and cuDNN;
# the driver comes from the NVIDIA container runtime.
COPY --from=build /opt/libtorch/lib /opt/libtorch/lib
ENV LD_LIBRARY_PATH=/opt/libtorch/lib \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

FROM runtime-${VARIANT} AS runtime
# bin/ and share/accel/ side by side: accel-serve finds its embedded default
# model at ../share/accel/default-model, where the build (server/CMakeLists.txt)
# made it.
COPY --from=build /src/build/bin/accel-serve /src/build/bin/accel-client /opt/accel/bin/
COPY --from=build /src/build/share/accel /opt/accel/share/accel
ENV PATH=/opt/accel/bin:$PATH
# The offload folder (--offload_folder) and /tmp are the only places written;
# Kubernetes mounts emptyDirs there (readOnlyRootFilesystem).
RUN mkdir -p /var/lib/accel/offload && chown 10001:10001 /var/lib/accel/offload
USER 10001:10001
WORKDIR /tmp
# gRPC (accel.v1.Generation, KServe v2, grpc.health.v1, reflection), metrics.
EXPOSE 50051 8002
# Healthy once the model serves (accel.ready); a big model may take minutes.
HEALTHCHECK --interval=30s --timeout=10s --start-period=10m --retries=3 \
  CMD ["accel-client", "health", "--address=localhost:50051", "--service=accel.ready", "--timeout=5s"]
# SIGTERM drains (--shutdown_timeout, 30 s by default): give docker stop -t 45.
STOPSIGNAL SIGTERM
ENTRYPOINT ["accel-serve"]
