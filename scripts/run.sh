#!/usr/bin/env bash
# Builds accel and starts accel-serve on its embedded default model, in the
# foreground: gRPC on port 50051 (accel.v1.Generation, KServe v2, health,
# reflection), Prometheus metrics on http://localhost:8002/metrics. Ctrl-C
# drains and exits. Extra arguments go to accel-serve (e.g. --model DIR).
#
# The OpenAI-compatible HTTP API listens on port 8000 (--http_port=0 turns it
# off; a later --http_port overrides this one).
#
# From another shell (docs/API.md has more):
#   grpcurl -plaintext -d '{"prompt": "Once upon a time", "max_new_tokens": 24}' \
#     localhost:50051 accel.v1.Generation/Generate
#   curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \
#     -d '{"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32}'
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
bash scripts/setup.sh
cmake --preset default >/dev/null
cmake --build --preset default --target accel-serve accel-client accel-generate accel-default-model
exec build/bin/accel-serve --http_port=8000 "$@"
