#!/usr/bin/env bash
# The format check of .ci/run: every C++/CUDA line changed since the commit named in
# tools/format_base must be as clang-format (Debian's clang-format 14, .clang-format) writes it.
# Lines nobody touched since then are not checked (most files predate the check; reformatting
# them whole would bury every later diff).
#
#   bash tools/check_format.sh          # exit 1 and the diff clang-format wants, when it wants one
#   git clang-format "$(cat tools/format_base)"   # applies it to the changed lines
set -euo pipefail
cd "$(dirname "$0")/.."
base_name=$(tr -d '[:space:]' < tools/format_base)
if ! base=$(git rev-parse --verify -q "${base_name}^{commit}"); then
  echo "check_format: base commit $base_name is not in this clone's history (shallow clone?)" >&2
  exit 1
fi
out=$(git clang-format --diff --extensions cc,h,cu,cuh "$base" -- . ':(exclude)third_party' 2>&1)
if grep -q '^diff --git' <<<"$out"; then
  echo "$out"
  echo "check_format: lines changed since ${base:0:12} are not clang-format's;" \
       "fix with: git clang-format ${base:0:12}"
  exit 1
fi
echo "check_format: lines changed since ${base:0:12} are formatted"
