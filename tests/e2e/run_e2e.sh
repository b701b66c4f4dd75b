#!/usr/bin/env bash
# End-to-end test of a local dgserve cluster with real third-party clients (ctest label e2e):
# the `openai` npm client, @grpc/grpc-js, `buf curl` over server reflection, promtool and a
# real Prometheus server scraping the three services.
#
#   tests/e2e/run_e2e.sh [--build DIR] [--model DIR] [--keep]
#
#   --build DIR  the CMake build directory with the binaries (default: <repo>/build)
#   --model DIR  serve this checkpoint (default: a tiny random one made with dgserve-mkmodel)
#   --keep       keep the temporary directory (logs, model) even when everything passes
#
# Needs: node + the packages of third_party/npm (tools/setup.sh installs them), curl,
# prometheus and promtool (Debian package prometheus). Everything listens on 127.0.0.1; the
# script stops exactly the processes it started (the cluster via tools/cluster.sh stop, and
# Prometheus by PID). On failure the temporary directory with all logs is kept and named.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
BUILD="$ROOT/build"
MODEL=""
KEEP=0
while [ $# -gt 0 ]; do
  case "$1" in
    --build) BUILD=$2; shift 2 ;;
    --model) MODEL=$2; shift 2 ;;
    --keep) KEEP=1; shift ;;
    -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "run_e2e.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
abspath() { case "$1" in /*) echo "$1" ;; *) echo "$PWD/$1" ;; esac; }
BUILD=$(abspath "$BUILD")
[ -n "$MODEL" ] && MODEL=$(abspath "$MODEL")

NPM_MODULES="$ROOT/third_party/npm/node_modules"
BUF="$NPM_MODULES/.bin/buf"

log() { echo "e2e: $*"; }
die() { echo "e2e: ERROR: $*" >&2; exit 1; }

# ---- preflight: everything the checks need, with what to do when it is missing ----
for bin in gateway/dgserve-gateway prefill_worker/dgserve-prefill-worker \
           denoise_worker/dgserve-denoise-worker tools/dgserve-mkmodel; do
  [ -x "$BUILD/$bin" ] || die "missing $BUILD/$bin; build it: ninja -C $BUILD dgserve-gateway dgserve-prefill-worker dgserve-denoise-worker dgserve-mkmodel"
done
for tool in node curl prometheus promtool timeout; do
  command -v "$tool" >/dev/null 2>&1 || die "missing the command '$tool'; run tools/setup.sh"
done
for pkg in openai @grpc/grpc-js @grpc/proto-loader @bufbuild/buf; do
  [ -f "$NPM_MODULES/$pkg/package.json" ] || die "missing the npm package $pkg in third_party/npm; run tools/setup.sh"
done
[ -x "$BUF" ] || die "missing $BUF; run tools/setup.sh"

WORK=$(mktemp -d "${TMPDIR:-/tmp}/dgserve-e2e.XXXXXX") || die "mktemp failed"
RUN_DIR="$WORK/cluster"
PROM_PID=""
RESULTS=()
FAILED=0
export BUF_CACHE_DIR="$WORK/buf-cache"
# The whole run is bounded: every command's timeout is capped by what is left of this budget.
DEADLINE=$((SECONDS + ${E2E_BUDGET_S:-270}))
CHECKS_NAME=e2e
# budget, stop_pid, run_check and the exit trap.
# shellcheck source=../../tests/lib/checks.sh
. "$ROOT/tests/lib/checks.sh"

# ---- the model ----
if [ -z "$MODEL" ]; then
  MODEL="$WORK/e2e-tiny-v512"
  log "making the test model in $MODEL"
  timeout "$(budget 60)" "$BUILD/tools/dgserve-mkmodel" --out "$MODEL" --seed 512 \
    --config "$ROOT/tests/testdata/golden/tiny-v512/config.json" \
    --tokenizer "$ROOT/tests/testdata/golden/tiny-v512/tokenizer.json" \
    --generation_config "$ROOT/tools/default_model/generation_config.json" \
    > "$WORK/mkmodel.log" 2>&1 || { cat "$WORK/mkmodel.log" >&2; die "dgserve-mkmodel failed"; }
fi
[ -f "$MODEL/config.json" ] || die "no config.json in the model directory $MODEL"
export MODEL_ID
MODEL_ID=$(basename "$MODEL")

# ---- the cluster ----
log "starting the cluster (RUN_DIR=$RUN_DIR)"
# Token mode (not the default mutual TLS): buf curl and the Node client reach the workers'
# reflection with the token header, and their health service in plaintext.
RUN_DIR="$RUN_DIR" MODEL_DIR="$MODEL" BUILD_DIR="$BUILD" timeout "$(budget 150)" bash "$ROOT/tools/cluster.sh" start --auth token \
  > "$WORK/cluster-start.log" 2>&1 || { cat "$WORK/cluster-start.log" >&2; die "tools/cluster.sh start failed"; }
[ -f "$RUN_DIR/cluster.env" ] || die "tools/cluster.sh start wrote no $RUN_DIR/cluster.env"
set -a
# shellcheck disable=SC1091
. "$RUN_DIR/cluster.env"
set +a
for v in GATEWAY_HTTP GATEWAY_GRPC GATEWAY_METRICS PREFILL0_GRPC PREFILL0_METRICS DENOISE0_GRPC DENOISE0_METRICS; do
  [ -n "${!v:-}" ] || die "$RUN_DIR/cluster.env has no $v"
done
log "cluster up: http=$GATEWAY_HTTP grpc=$GATEWAY_GRPC model=$MODEL_ID"

# ---- checks ----
http_health() {
  local p code
  for p in /health /ready; do
    code=$(curl -s -o "$WORK/http$(tr / _ <<<"$p").txt" -w '%{http_code}' --max-time 10 "http://$GATEWAY_HTTP$p")
    [ "$code" = 200 ] || { echo "GET $p -> HTTP $code: $(cat "$WORK/http$(tr / _ <<<"$p").txt")" >&2; return 1; }
    echo "  ok   GET $p -> 200"
  done
}
run_check "gateway /health and /ready" http_health
run_check "openai client (tests/e2e/openai_chat.mjs)" timeout "$(budget 120)" node "$HERE/openai_chat.mjs"
run_check "grpc-js client (tests/e2e/grpc_stream.mjs)" timeout "$(budget 120)" node "$HERE/grpc_stream.mjs"

# buf curl against server reflection.
buf_curl() { timeout "$(budget 30)" "$BUF" curl --protocol grpc --http2-prior-knowledge --connect-timeout 10 "$@"; }
buf_list_models() {
  local out
  out=$(buf_curl -d '{}' "http://$GATEWAY_GRPC/dgserve.v1.GenerationService/ListModels" 2>&1) ||
    { echo "buf curl ListModels failed: $out" >&2; return 1; }
  echo "$out" | node -e '
    let s = ""; process.stdin.on("data", (d) => (s += d)).on("end", () => {
      let ids;
      try { ids = JSON.parse(s).models.map((m) => m.id); }
      catch (e) { console.error(`ListModels output is not {models: [...]} JSON: ${e}\n${s}`); process.exit(1); }
      if (!ids.includes(process.env.MODEL_ID)) {
        console.error(`ListModels has no ${process.env.MODEL_ID}: ${s}`); process.exit(1);
      }
      console.log(`  ok   buf curl ListModels: ${JSON.stringify(ids)}`);
    });'
}
# buf_lists FLAG ADDR WANT...: `buf curl FLAG http://ADDR` prints each WANT as a line (with the
# cluster's internal token: the workers' reflection is behind it; the gateway ignores it).
buf_lists() {
  local flag=$1 addr=$2 out w; shift 2
  out=$(buf_curl --reflect-header "authorization: Bearer $(cat "$INTERNAL_CERT_DIR/token")" "$flag" "http://$addr" 2>&1) || { echo "buf curl $flag http://$addr failed: $out" >&2; return 1; }
  for w in "$@"; do
    grep -qxF "$w" <<<"$out" || { echo "buf curl $flag http://$addr does not list $w; it printed:" >&2; echo "$out" >&2; return 1; }
  done
  echo "  ok   buf curl $flag http://$addr lists: $*"
}
run_check "buf curl ListModels (reflection)" buf_list_models
run_check "buf curl --list-services (gateway)" buf_lists --list-services "$GATEWAY_GRPC" \
  dgserve.v1.GenerationService grpc.health.v1.Health
run_check "buf curl --list-methods (gateway)" buf_lists --list-methods "$GATEWAY_GRPC" \
  dgserve.v1.GenerationService/Generate dgserve.v1.GenerationService/GenerateStream \
  dgserve.v1.GenerationService/ListModels
run_check "buf curl --list-services (denoise worker)" buf_lists --list-services "$DENOISE0_GRPC" \
  dgserve.v1.DenoiseService grpc.health.v1.Health
run_check "buf curl --list-services (prefill worker)" buf_lists --list-services "$PREFILL0_GRPC" \
  dgserve.v1.PrefillService grpc.health.v1.Health

# promtool check metrics on each /metrics: exit 1 (parse error) and 3 (lint problems) both fail.
promtool_metrics() {
  local name=$1 addr=$2 file="$WORK/metrics-$1.txt" out rc
  curl -sf --max-time 10 "http://$addr/metrics" > "$file" || { echo "GET http://$addr/metrics failed" >&2; return 1; }
  out=$(promtool check metrics < "$file" 2>&1); rc=$?
  if [ $rc -ne 0 ]; then
    echo "promtool check metrics of $name (http://$addr/metrics) exited $rc:" >&2
    echo "$out" >&2
    return 1
  fi
  grep -q '^dgserve_' "$file" || { echo "no dgserve_ metric in http://$addr/metrics" >&2; return 1; }
  echo "  ok   $name: promtool clean, $(grep -c '^dgserve_' "$file") dgserve_ samples"
}
run_check "promtool check metrics (gateway)" promtool_metrics gateway "$GATEWAY_METRICS"
run_check "promtool check metrics (prefill worker)" promtool_metrics prefill0 "$PREFILL0_METRICS"
run_check "promtool check metrics (denoise worker)" promtool_metrics denoise0 "$DENOISE0_METRICS"

# A real Prometheus server scraping the three services.
prometheus_scrape() {
  local port
  port=$(node -e 'const s = require("net").createServer();
    s.listen(0, "127.0.0.1", () => { console.log(s.address().port); s.close(); });') || return 1
  cat > "$WORK/prometheus.yml" <<YAML
global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: dgserve
    static_configs:
      - targets: ["$GATEWAY_METRICS"]
        labels: {service: gateway}
      - targets: ["$PREFILL0_METRICS"]
        labels: {service: prefill}
      - targets: ["$DENOISE0_METRICS"]
        labels: {service: denoise}
YAML
  promtool check config "$WORK/prometheus.yml" >/dev/null || { echo "bad prometheus.yml" >&2; return 1; }
  prometheus --config.file="$WORK/prometheus.yml" --web.listen-address="127.0.0.1:$port" \
    --storage.tsdb.path="$WORK/prometheus-data" --log.level=warn > "$WORK/prometheus.log" 2>&1 &
  PROM_PID=$!
  local ready=0
  local until=$((SECONDS + $(budget 30)))
  while [ $SECONDS -lt $until ]; do
    kill -0 "$PROM_PID" 2>/dev/null || break
    curl -sf --max-time 2 "http://127.0.0.1:$port/-/ready" >/dev/null 2>&1 && { ready=1; break; }
    sleep 0.1
  done
  if [ $ready -ne 1 ]; then
    echo "prometheus on 127.0.0.1:$port did not become ready; its log:" >&2
    tail -n 20 "$WORK/prometheus.log" >&2
    return 1
  fi
  echo "  ok   prometheus ready on 127.0.0.1:$port (pid $PROM_PID)"
  PROM_URL="http://127.0.0.1:$port" EXPECT_TARGETS=3 timeout "$(budget 150)" node "$HERE/prometheus_check.mjs"
}
run_check "prometheus server scrapes the cluster" prometheus_scrape
if [ -n "$PROM_PID" ]; then stop_pid "$PROM_PID"; PROM_PID=""; fi

[ $FAILED -eq 0 ]
