#!/usr/bin/env bash
# Checks the deployment files (Dockerfile, deploy/) against each other, the
# Kubernetes schemas and the built accel-serve:
#
#   scripts/check_deploy.sh BUILD_DIR      # BUILD_DIR has bin/accel-serve, bin/accel-client
#
#  1. yamllint on deploy/ (deploy/.yamllint.yaml);
#  2. kustomize renders the base and each overlay (`kubectl kustomize`: the
#     manifests keep to what kustomize v2, in Debian's kubectl 1.20, and v5 both
#     render);
#  3. deploy/check/check_deploy.mjs validates every rendered object against the
#     Kubernetes OpenAPI schemas (kubernetes-models, prometheus-operator models:
#     ajv), and checks ports, flags, health service names, metric names,
#     drain timing, memory, security context and the Dockerfile's packages and
#     paths against the real binaries (it starts accel-serve on 127.0.0.1).
# The npm packages pinned by deploy/check/package-lock.json are installed into
# BUILD_DIR/deploy-npm with `npm ci` (the only step that uses the network,
# skipped when that lock file is installed already). Exits 1 on any problem.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ $# -ne 1 ]; then
  echo "usage: scripts/check_deploy.sh BUILD_DIR" >&2
  exit 2
fi
build=$(cd "$1" && pwd)
src=deploy/check
npm_dir="$build/deploy-npm"
out="$build/deploy-rendered"

for tool in yamllint kubectl; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "check_deploy.sh: '$tool' is missing (scripts/setup.sh installs it)" >&2
    exit 1
  fi
done

yamllint --strict -c deploy/.yamllint.yaml deploy/
echo "check_deploy.sh: yamllint: deploy/ is clean" >&2

# shellcheck source=scripts/npm_pinned.sh
source scripts/npm_pinned.sh
npm_pinned check_deploy.sh "$src" "$npm_dir"

rm -rf "$out"
mkdir -p "$out"
renders=()
for dir in deploy/base deploy/overlays/*/; do
  name=$(basename "$dir")
  # kustomize v5 warns that v2's field names (bases, patchesStrategicMerge,
  # commonLabels) are deprecated; those lines are expected, anything else fails.
  if ! kubectl kustomize "$dir" >"$out/$name.yaml" 2>"$out/$name.err"; then
    cat "$out/$name.err" >&2
    echo "check_deploy.sh: kustomize cannot render $dir" >&2
    exit 1
  fi
  if grep -v -E "^# Warning: '(bases|patchesStrategicMerge|commonLabels)' is deprecated" "$out/$name.err" >&2; then
    echo "check_deploy.sh: kustomize warned on $dir" >&2
    exit 1
  fi
  renders+=("$name=$out/$name.yaml")
done
echo "check_deploy.sh: rendered ${renders[*]}" >&2

node "$src/check_deploy.mjs" --npm="$npm_dir" --build="$build" --dockerfile=Dockerfile \
  --presets=CMakePresets.json "${renders[@]}"
