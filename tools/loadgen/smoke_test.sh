#!/usr/bin/env bash
# End-to-end smoke test of dgserve-loadgen (ctest: loadgen_smoke, label e2e).
#
#   tools/loadgen/smoke_test.sh --build DIR [--loadgen BIN] [--seconds S]
#
# Makes the tiny-v512 test model, starts a local cluster with tools/cluster.sh in a temporary
# RUN_DIR (stopped on exit, whatever happens), then runs dgserve-loadgen twice with
# --fail_on_error --json: a closed loop over gRPC (concurrency 4) and an open loop over the
# OpenAI HTTP API (Poisson, 2 requests/s), S seconds each (default 12). Passes when both exit 0
# and report zero errors and at least one completed request. The reports are printed.
set -euo pipefail
SRC=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=""
LOADGEN=""
SECONDS_EACH=12
while [ $# -gt 0 ]; do
  case "$1" in
    --build) BUILD=$2; shift 2 ;;
    --loadgen) LOADGEN=$2; shift 2 ;;
    --seconds) SECONDS_EACH=$2; shift 2 ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) echo "smoke_test.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
[ -n "$BUILD" ] || { echo "smoke_test.sh: --build DIR is required" >&2; exit 2; }
BUILD=$(cd "$BUILD" && pwd)
LOADGEN=${LOADGEN:-$BUILD/tools/loadgen/dgserve-loadgen}
for bin in "$LOADGEN" "$BUILD/tools/dgserve-mkmodel" "$BUILD/gateway/dgserve-gateway" \
    "$BUILD/prefill_worker/dgserve-prefill-worker" "$BUILD/denoise_worker/dgserve-denoise-worker"; do
  [ -x "$bin" ] || { echo "smoke_test.sh: $bin is not built" >&2; exit 1; }
done

WORK=$(mktemp -d "${TMPDIR:-/tmp}/loadgen-smoke.XXXXXX")
RUN_DIR=$WORK/run
status=1
cleanup() {
  RUN_DIR=$RUN_DIR bash "$SRC/tools/cluster.sh" stop >/dev/null 2>&1 || true
  if [ $status -ne 0 ] && [ -f "$RUN_DIR/gateway.log" ]; then
    echo "--- gateway log (last 20 lines)" >&2
    tail -20 "$RUN_DIR/gateway.log" >&2 || true
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT

GOLDEN=$SRC/tests/testdata/golden/tiny-v512
"$BUILD/tools/dgserve-mkmodel" --out "$WORK/model" --seed 512 --config "$GOLDEN/config.json" \
  --tokenizer "$GOLDEN/tokenizer.json" \
  --generation_config "$SRC/tools/default_model/generation_config.json" >/dev/null
RUN_DIR=$RUN_DIR BUILD_DIR=$BUILD MODEL_DIR=$WORK/model bash "$SRC/tools/cluster.sh" start
# shellcheck disable=SC1091
source "$RUN_DIR/cluster.env"
echo "cluster: gRPC $GATEWAY_GRPC, HTTP $GATEWAY_HTTP"

# Prints the value of the numeric top-level field $2 of the one-line JSON report $1.
json_field() {
  if command -v node >/dev/null 2>&1; then
    node -e 'const r = JSON.parse(process.argv[1]); console.log(r[process.argv[2]]);' "$1" "$2"
  else  # the report is one line of JSON with unique "name":number pairs at the top level
    printf '%s\n' "$1" | sed -nE "s/.*\"$2\":([0-9.eE+-]+).*/\\1/p"
  fi
}

# run_case NAME ARGS...: runs dgserve-loadgen, prints its report and checks it.
run_case() {
  local name=$1; shift
  local out rc=0
  echo "=== $name: dgserve-loadgen $*"
  out=$("$LOADGEN" "$@" --fail_on_error --json --progress=false) || rc=$?
  echo "$out"
  if [ $rc -ne 0 ]; then echo "FAIL $name: dgserve-loadgen exited $rc" >&2; return 1; fi
  local errors completed unfinished
  errors=$(json_field "$out" errors)
  completed=$(json_field "$out" completed)
  unfinished=$(json_field "$out" unfinished)
  if [ "$errors" != 0 ]; then echo "FAIL $name: $errors errors" >&2; return 1; fi
  if ! [ "${completed:-0}" -gt 0 ] 2>/dev/null; then
    echo "FAIL $name: no completed requests ($completed)" >&2
    return 1
  fi
  echo "ok $name: $completed completed, 0 errors, $unfinished unfinished"
}

run_case grpc_closed --target "$GATEWAY_GRPC" --mode closed --concurrency 4 \
  --duration_s "$SECONDS_EACH" --drain_s 60 --max_tokens_mean 32 --max_tokens_std 16 --seed 1
run_case http_open --http "$GATEWAY_HTTP" --endpoint chat --mode open --rate 2 \
  --duration_s "$SECONDS_EACH" --drain_s 60 --max_tokens_mean 32 --max_tokens_std 16 --seed 2
status=0
echo "loadgen smoke test passed"
