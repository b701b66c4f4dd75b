#!/usr/bin/env bash
# Writes the file_sd targets of a local dgserve cluster for the dgserve-local job of
# deploy/prometheus/prometheus.yml, from the cluster.env that tools/cluster.sh start wrote.
#
#   deploy/prometheus/local_targets.sh [--run-dir DIR] [--out FILE]
#
#   --run-dir DIR  the cluster's RUN_DIR (default: $RUN_DIR, else run/cluster as tools/cluster.sh)
#   --out FILE     default: deploy/prometheus/targets/local.json (Prometheus re-reads it within
#                  30 s; run this again after every cluster start, the ports change)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
RUN_DIR=${RUN_DIR:-$ROOT/run/cluster}
OUT="$ROOT/deploy/prometheus/targets/local.json"
while [ $# -gt 0 ]; do
  case "$1" in
    --run-dir) RUN_DIR=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "local_targets.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
ENV_FILE="$RUN_DIR/cluster.env"
[ -f "$ENV_FILE" ] || { echo "local_targets.sh: no $ENV_FILE; start a cluster: RUN_DIR=$RUN_DIR tools/cluster.sh start" >&2; exit 1; }

entries=()
while IFS='=' read -r key value; do
  case "$key" in
    GATEWAY_METRICS) component=gateway ;;
    PREFILL*_METRICS) component=prefill ;;
    DENOISE*_METRICS) component=denoise ;;
    *) continue ;;
  esac
  name=$(echo "${key%_METRICS}" | tr '[:upper:]' '[:lower:]')
  entries+=("  {\"targets\": [\"$value\"], \"labels\": {\"component\": \"$component\", \"process\": \"$name\"}}")
done < "$ENV_FILE"
[ ${#entries[@]} -gt 0 ] || { echo "local_targets.sh: no *_METRICS address in $ENV_FILE" >&2; exit 1; }

mkdir -p "$(dirname "$OUT")"
tmp="$OUT.tmp.$$"
{
  echo "["
  for i in "${!entries[@]}"; do
    if [ "$i" -lt $((${#entries[@]} - 1)) ]; then echo "${entries[$i]},"; else echo "${entries[$i]}"; fi
  done
  echo "]"
} > "$tmp"
mv "$tmp" "$OUT"  # atomic: Prometheus never reads a half-written file
echo "local_targets.sh: wrote ${#entries[@]} targets to $OUT"
