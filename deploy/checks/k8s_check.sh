#!/usr/bin/env bash
# Checks deploy/k8s: builds the base and both overlays with `kubectl kustomize`, runs yamllint
# (deploy/k8s/.yamllint, --strict) over every source file and every build, converts the builds to
# JSON (python3-yaml, a dependency of yamllint) and validates them with k8s_validate.mjs (schemas
# from the npm kubernetes-models packages, then the cross-references).
#
#   bash deploy/checks/k8s_check.sh [--build-dir DIR]
#
# --build-dir: a CMake build tree; when it holds the service binaries, every --flag the manifests
# pass is checked against the binary's --help. KUBECTL picks the kubectl (default: kubectl on
# PATH); K8S_CHECK_COMPAT_KUBECTL="KUBECTL ..." builds everything again with each of those (e.g.
# Debian's kubectl 1.20, whose kustomize is v2.0.3) and requires the same objects.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
K8S=$ROOT/deploy/k8s
KUBECTL=${KUBECTL:-kubectl}
BUILD_DIR=""
while [ $# -gt 0 ]; do
  case "$1" in
    --build-dir) BUILD_DIR=$2; shift 2 ;;
    *) echo "k8s_check: unknown argument $1" >&2; exit 2 ;;
  esac
done

for tool in "$KUBECTL" yamllint python3 node; do
  command -v "$tool" >/dev/null 2>&1 || { echo "k8s_check: $tool not found (bash tools/setup.sh installs it)" >&2; exit 1; }
done
python3 -c 'import yaml' 2>/dev/null || { echo "k8s_check: python3-yaml missing (it comes with yamllint)" >&2; exit 1; }
[ -f "$ROOT/third_party/npm/node_modules/kubernetes-models/package.json" ] ||
  { echo "k8s_check: third_party/npm/node_modules lacks kubernetes-models (bash tools/setup.sh)" >&2; exit 1; }

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
status=0

# 1. kustomize builds (stderr kept for failures only: kustomize v5 warns about `bases` and
#    `patchesStrategicMerge`, which we keep for kustomize v2.0.3)
build() {  # kubectl target out
  if ! "$1" kustomize "$K8S/$2" > "$3" 2> "$3.err"; then
    echo "FAIL kustomize $2 ($1):" >&2
    cat "$3.err" >&2
    return 1
  fi
}
targets=(base overlays/cpu overlays/gpu)
for t in "${targets[@]}"; do
  n=$(basename "$t")
  if build "$KUBECTL" "$t" "$TMP/$n.yaml"; then
    echo "k8s_check: $KUBECTL kustomize deploy/k8s/$t: $(grep -c '^kind:' "$TMP/$n.yaml") objects"
  else
    status=1
  fi
done
[ $status -eq 0 ] || exit 1

# 2. yamllint: sources and builds
mapfile -t sources < <(find "$K8S" -type f \( -name '*.yaml' -o -name '*.yml' \) | sort)
if yamllint --strict -c "$K8S/.yamllint" -f parsable "${sources[@]}" "$TMP"/base.yaml "$TMP"/cpu.yaml "$TMP"/gpu.yaml; then
  echo "k8s_check: yamllint: ${#sources[@]} source files and 3 builds clean"
else
  echo "FAIL yamllint (above)" >&2
  status=1
fi

# 3. schemas and cross-references
args=()
for n in base cpu gpu; do
  python3 "$ROOT/deploy/checks/k8s_yaml_to_json.py" "$TMP/$n.yaml" "$TMP/$n.json"
  args+=("$n=$TMP/$n.json")
done
[ -n "$BUILD_DIR" ] && args=(--build-dir "$BUILD_DIR" "${args[@]}")
node "$ROOT/deploy/checks/k8s_validate.mjs" "${args[@]}" || status=1

# 4. other kubectl versions must build the same objects
for other in ${K8S_CHECK_COMPAT_KUBECTL:-}; do
  for t in "${targets[@]}"; do
    n=$(basename "$t")
    if build "$other" "$t" "$TMP/$n.compat.yaml"; then
      if python3 "$ROOT/deploy/checks/k8s_yaml_to_json.py" --compare "$TMP/$n.yaml" "$TMP/$n.compat.yaml"; then
        echo "k8s_check: $other kustomize deploy/k8s/$t: same objects"
      else
        echo "FAIL $other kustomize deploy/k8s/$t differs from $KUBECTL's (above)" >&2
        status=1
      fi
    else
      status=1
    fi
  done
done

if [ $status -eq 0 ]; then echo "k8s_check: ok"; else echo "k8s_check: FAILED" >&2; fi
exit $status
