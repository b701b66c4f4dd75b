#!/usr/bin/env bash
# Live check of the observability artifacts against a real local cluster (ctest obs_live,
# label e2e): every metric the Grafana dashboard and the alert rules read is exported.
#
#   deploy/checks/obs_live.sh [--build DIR] [--keep]
#
#   --build DIR  the CMake build directory with the binaries (default: <repo>/build)
#   --keep       keep the temporary directory (model, logs, scrapes) even when it passes
#
# Steps: make a tiny test model (dgserve-mkmodel); start a cluster with tools/cluster.sh
# (loopback, any free ports); send a few requests, one of which fails (unknown model: a
# NOT_FOUND status); scrape the three /metrics; then
#   1. every metric name in deploy/grafana/dashboard.json queries and deploy/prometheus/alerts.yml
#      expressions (histogram _bucket/_sum/_count matched to their family; `up` ignored) must be
#      exported; the missing ones are listed;
#   2. a Prometheus server on loopback, configured from deploy/prometheus/prometheus.yml (its
#      dgserve-local job fed by deploy/prometheus/local_targets.sh, scraping every second),
#      must see the three targets up, answer every dashboard query with series, list the
#      cluster in the job/instance variables and evaluate every alert rule without error.
# Always stops what it started (the cluster via tools/cluster.sh stop, Prometheus by PID);
# every wait is bounded (OBS_BUDGET_S, default 240 s, for the whole run).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD="$ROOT/build"
KEEP=0
while [ $# -gt 0 ]; do
  case "$1" in
    --build) BUILD=$2; shift 2 ;;
    --keep) KEEP=1; shift ;;
    -h|--help) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "obs_live: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$BUILD" in /*) ;; *) BUILD="$PWD/$BUILD" ;; esac
TOOL=(python3 "$ROOT/deploy/checks/obs_tool.py")

log() { echo "obs_live: $*"; }
die() { echo "obs_live: ERROR: $*" >&2; exit 1; }

for bin in gateway/dgserve-gateway prefill_worker/dgserve-prefill-worker \
           denoise_worker/dgserve-denoise-worker tools/dgserve-mkmodel; do
  [ -x "$BUILD/$bin" ] || die "missing $BUILD/$bin; build it: ninja -C $BUILD dgserve-gateway dgserve-prefill-worker dgserve-denoise-worker dgserve-mkmodel"
done
for tool in curl python3 prometheus promtool timeout; do
  command -v "$tool" >/dev/null 2>&1 || die "missing the command '$tool'; run tools/setup.sh"
done
python3 -c 'import yaml' 2>/dev/null || die "python3 lacks PyYAML (python3-yaml); run tools/setup.sh"

WORK=$(mktemp -d "${TMPDIR:-/tmp}/dgserve-obs-live.XXXXXX") || die "mktemp failed"
RUN_DIR="$WORK/cluster"
PROM_PID=""
RESULTS=()
FAILED=0
DEADLINE=$((SECONDS + ${OBS_BUDGET_S:-240}))
CHECKS_NAME=obs_live
# budget, stop_pid, run_check and the exit trap.
# shellcheck source=../../tests/lib/checks.sh
. "$ROOT/tests/lib/checks.sh"

# ---- the model and the cluster ----
MODEL="$WORK/obs-tiny-v512"
log "making the test model in $MODEL"
timeout "$(budget 60)" "$BUILD/tools/dgserve-mkmodel" --out "$MODEL" --seed 512 \
  --config "$ROOT/tests/testdata/golden/tiny-v512/config.json" \
  --tokenizer "$ROOT/tests/testdata/golden/tiny-v512/tokenizer.json" \
  --generation_config "$ROOT/tools/default_model/generation_config.json" \
  > "$WORK/mkmodel.log" 2>&1 || { cat "$WORK/mkmodel.log" >&2; die "dgserve-mkmodel failed"; }

log "starting the cluster (RUN_DIR=$RUN_DIR)"
RUN_DIR="$RUN_DIR" MODEL_DIR="$MODEL" BUILD_DIR="$BUILD" timeout "$(budget 120)" bash "$ROOT/tools/cluster.sh" start \
  > "$WORK/cluster-start.log" 2>&1 || { cat "$WORK/cluster-start.log" >&2; die "tools/cluster.sh start failed"; }
[ -f "$RUN_DIR/cluster.env" ] || die "tools/cluster.sh start wrote no $RUN_DIR/cluster.env"
# shellcheck disable=SC1091
. "$RUN_DIR/cluster.env"
for v in GATEWAY_HTTP GATEWAY_METRICS PREFILL0_METRICS DENOISE0_METRICS; do
  [ -n "${!v:-}" ] || die "$RUN_DIR/cluster.env has no $v"
done
log "cluster up: http=$GATEWAY_HTTP metrics=$GATEWAY_METRICS,$PREFILL0_METRICS,$DENOISE0_METRICS"

# ---- traffic ----
post() {  # post PATH BODY WANT_CODE
  local code
  code=$(curl -s -o "$WORK/response.json" -w '%{http_code}' --max-time "$(budget 60)" \
    -H 'Content-Type: application/json' -d "$2" "http://$GATEWAY_HTTP$1")
  if [ "$code" != "$3" ]; then
    echo "POST $1 -> HTTP $code (want $3): $(head -c 300 "$WORK/response.json")" >&2
    return 1
  fi
  echo "  ok   POST $1 -> $code"
}
traffic() {
  local chat='{"messages":[{"role":"user","content":"Tell me about block diffusion."}],"max_tokens":16,"max_denoising_steps":4}'
  # The same prompt three times: the later ones hit the prefill prefix cache.
  post /v1/chat/completions "$chat" 200 && post /v1/chat/completions "$chat" 200 &&
    post /v1/chat/completions "$chat" 200 &&
    post /v1/chat/completions '{"messages":[{"role":"user","content":"hi"}],"max_tokens":16,"max_denoising_steps":4,"stream":true}' 200 &&
    post /v1/completions '{"prompt":"Once upon a time","max_tokens":16,"max_denoising_steps":4}' 200 &&
    post /v1/chat/completions '{"model":"no-such-model","messages":[{"role":"user","content":"hi"}],"max_tokens":16}' 404
}
run_check "requests (5 that succeed, 1 unknown model)" traffic

scrape() {
  local name addr
  for name in GATEWAY PREFILL0 DENOISE0; do
    addr=${name}_METRICS
    curl -sf --max-time 10 "http://${!addr}/metrics" > "$WORK/metrics-$name.txt" ||
      { echo "GET http://${!addr}/metrics failed" >&2; return 1; }
    echo "  ok   $name: $(grep -c '^dgserve_' "$WORK/metrics-$name.txt") dgserve_ samples"
  done
  grep -q '^dgserve_gateway_requests_total{status="NOT_FOUND"} [1-9]' "$WORK/metrics-GATEWAY.txt" ||
    { echo "the failed request is not counted: no dgserve_gateway_requests_total{status=\"NOT_FOUND\"} > 0" >&2; return 1; }
  echo "  ok   the failed request is counted (status NOT_FOUND)"
}
run_check "scrape the three /metrics" scrape

run_check "every metric the dashboard and the alerts read is exported" \
  "${TOOL[@]}" metric-names --dashboard "$ROOT/deploy/grafana/dashboard.json" \
  --rules "$ROOT/deploy/prometheus/alerts.yml" \
  --metrics "$WORK/metrics-GATEWAY.txt" "$WORK/metrics-PREFILL0.txt" "$WORK/metrics-DENOISE0.txt"

# ---- a Prometheus server with deploy/prometheus/prometheus.yml ----
prometheus_eval() {
  local port ready=0 until
  bash "$ROOT/deploy/prometheus/local_targets.sh" --run-dir "$RUN_DIR" --out "$WORK/targets/local.json" || return 1
  "${TOOL[@]}" prom-config --mode live --targets "$WORK/targets/local.json" \
    "$ROOT/deploy/prometheus/prometheus.yml" "$WORK/prometheus.yml" || return 1
  promtool check config "$WORK/prometheus.yml" > "$WORK/promtool.log" 2>&1 || { cat "$WORK/promtool.log" >&2; return 1; }
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])') || return 1
  prometheus --config.file="$WORK/prometheus.yml" --web.listen-address="127.0.0.1:$port" \
    --storage.tsdb.path="$WORK/prometheus-data" --log.level=warn > "$WORK/prometheus.log" 2>&1 &
  PROM_PID=$!
  until=$((SECONDS + $(budget 30)))
  while [ $SECONDS -lt $until ]; do
    kill -0 "$PROM_PID" 2>/dev/null || break
    curl -sf --max-time 2 "http://127.0.0.1:$port/-/ready" >/dev/null 2>&1 && { ready=1; break; }
    sleep 0.2
  done
  [ $ready -eq 1 ] || { echo "prometheus on 127.0.0.1:$port did not become ready" >&2; return 1; }
  echo "  ok   prometheus ready on 127.0.0.1:$port (pid $PROM_PID)"
  timeout "$(budget 90)" "${TOOL[@]}" prom-eval --url "http://127.0.0.1:$port" \
    --dashboard "$ROOT/deploy/grafana/dashboard.json" --job dgserve-local --targets 3 --timeout "$(budget 60)"
}
run_check "prometheus (deploy/prometheus/prometheus.yml) answers every dashboard query and rule" prometheus_eval
if [ -n "$PROM_PID" ]; then stop_pid "$PROM_PID"; PROM_PID=""; fi

[ $FAILED -eq 0 ]
