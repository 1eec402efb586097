# accel: build stage on Debian bookworm with the project's own set-up script,
# then a slim runtime stage with only the runtime libraries.
#
# For now the image carries the tools (accel-make-model, accel-inspect);
# accel-serve becomes the entrypoint when the server lands (issue 5), and
# the deployment issue (9) adds the CUDA variant, health check and non-root
# hardening described in docs/ARCHITECTURE.md.
FROM debian:bookworm AS build
WORKDIR /src
COPY . .
RUN bash scripts/setup.sh \
 && cmake --preset default -DACCEL_BUILD_TESTS=OFF -DACCEL_BUILD_BENCHMARKS=OFF -DACCEL_USE_CCACHE=OFF \
 && cmake --build --preset default --target accel-make-model accel-inspect

FROM debian:bookworm-slim AS runtime
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      libtorch1.13 libabsl20220623 libgoogle-glog0v6 libgflags2.2 \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --no-create-home accel
COPY --from=build /src/build/bin/accel-make-model /src/build/bin/accel-inspect /usr/local/bin/
USER 10001
ENTRYPOINT ["accel-inspect"]
