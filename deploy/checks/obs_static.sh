#!/usr/bin/env bash
# Static checks of the observability artifacts (ctest obs_static, label unit); no cluster.
#
#   deploy/checks/obs_static.sh
#
#   1. tsc --noEmit -p deploy/grafana: dashboard.ts type-checks against @grafana/schema
#   2. dashboard.json is what deploy/grafana/build.mjs makes from dashboard.ts (not stale)
#   3. dashboard lint: grid, ids, variables, ${datasource}, job/instance filters, required panels
#   4. every dashboard query parses as PromQL (promtool check rules on them as recording rules)
#   5. promtool check config deploy/prometheus/prometheus.yml (a promtool built without
#      kubernetes_sd, as Debian's, checks it with that block replaced by a static target)
#   6. promtool check rules deploy/prometheus/alerts.yml
#   7. promtool test rules deploy/prometheus/alerts_test.yml
#   8. deploy/prometheus/local_targets.sh writes valid file_sd JSON from a cluster.env
#   9. yamllint of the Prometheus files
#
# Needs node, python3 with PyYAML, promtool, yamllint (tools/setup.sh) and typescript +
# @grafana/schema in third_party/npm. Runs every step, then fails if any failed.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT" || exit 1
NPM="$ROOT/third_party/npm/node_modules"
TOOL=(python3 "$ROOT/deploy/checks/obs_tool.py")

die() { echo "obs_static: ERROR: $*" >&2; exit 1; }
for tool in node python3 promtool yamllint diff; do
  command -v "$tool" >/dev/null 2>&1 || die "missing the command '$tool'; run tools/setup.sh"
done
python3 -c 'import yaml' 2>/dev/null || die "python3 lacks PyYAML (python3-yaml); run tools/setup.sh"
[ -x "$NPM/.bin/tsc" ] || die "missing $NPM/.bin/tsc; run tools/setup.sh (npm ci in third_party/npm)"
[ -f "$NPM/@grafana/schema/package.json" ] || die "missing @grafana/schema in third_party/npm; run tools/setup.sh"

WORK=$(mktemp -d "${TMPDIR:-/tmp}/dgserve-obs-static.XXXXXX") || die "mktemp failed"
trap 'rm -rf "$WORK"' EXIT
RESULTS=()
FAILED=0
step() {  # step NAME COMMAND...: runs it, records ok/FAIL, never aborts
  local name=$1; shift
  echo "obs_static: ---- $name"
  if "$@"; then RESULTS+=("ok    $name"); else RESULTS+=("FAIL  $name"); FAILED=$((FAILED + 1)); fi
}

tsc_check() { "$NPM/.bin/tsc" --noEmit -p deploy/grafana && echo "  tsc: no errors"; }
fresh_json() {
  node deploy/grafana/build.mjs --out "$WORK/dashboard.json" >/dev/null || return 1
  if ! diff -u deploy/grafana/dashboard.json "$WORK/dashboard.json" > "$WORK/dashboard.diff"; then
    head -n 60 "$WORK/dashboard.diff"
    echo "deploy/grafana/dashboard.json is stale: regenerate it with: node deploy/grafana/build.mjs" >&2
    return 1
  fi
  echo "  dashboard.json matches dashboard.ts"
}
promql_parse() {
  "${TOOL[@]}" promql-rules deploy/grafana/dashboard.json "$WORK/dashboard_queries.yml" &&
    promtool check rules "$WORK/dashboard_queries.yml"
}
check_config() {
  printf 'scrape_configs:\n  - job_name: probe\n    kubernetes_sd_configs:\n      - role: pod\n' > "$WORK/k8s_probe.yml"
  if promtool check config "$WORK/k8s_probe.yml" >/dev/null 2>&1; then
    promtool check config deploy/prometheus/prometheus.yml
  else
    echo "  NOTE: this promtool ($(promtool --version 2>&1 | head -n 1)) is built without kubernetes_sd;"
    echo "        checking prometheus.yml with the kubernetes_sd block replaced by a static target"
    "${TOOL[@]}" prom-config --mode check deploy/prometheus/prometheus.yml "$WORK/prometheus.check.yml" &&
      promtool check config "$WORK/prometheus.check.yml"
  fi
}
local_targets() {
  mkdir -p "$WORK/run"
  printf '%s\n' GATEWAY_HTTP=127.0.0.1:1 GATEWAY_GRPC=127.0.0.1:2 GATEWAY_METRICS=127.0.0.1:3 \
    DENOISE0_GRPC=127.0.0.1:4 DENOISE0_METRICS=127.0.0.1:5 PREFILL0_GRPC=127.0.0.1:6 \
    PREFILL0_METRICS=127.0.0.1:7 DENOISE1_METRICS=127.0.0.1:8 > "$WORK/run/cluster.env"
  bash deploy/prometheus/local_targets.sh --run-dir "$WORK/run" --out "$WORK/targets/local.json" || return 1
  # shellcheck disable=SC2016  # JavaScript, not shell
  node -e '
    const t = JSON.parse(require("fs").readFileSync(process.argv[1], "utf8"));
    const got = t.map((e) => `${e.targets.join(",")}=${e.labels.component}`).sort().join(" ");
    const want = "127.0.0.1:3=gateway 127.0.0.1:5=denoise 127.0.0.1:7=prefill 127.0.0.1:8=denoise";
    if (got !== want) { console.error(`file_sd targets: got ${got}, want ${want}`); process.exit(1); }
    console.log(`  file_sd JSON ok: ${got}`);' "$WORK/targets/local.json"
}
yaml_lint() {
  yamllint -s -d '{extends: default, rules: {line-length: {max: 130}, document-start: disable}}' \
    deploy/prometheus/prometheus.yml deploy/prometheus/alerts.yml deploy/prometheus/alerts_test.yml &&
    echo "  yamllint clean"
}

step "tsc --noEmit -p deploy/grafana" tsc_check
step "dashboard.json is up to date (deploy/grafana/build.mjs)" fresh_json
step "dashboard lint" "${TOOL[@]}" lint-dashboard deploy/grafana/dashboard.json
step "dashboard queries parse (promtool)" promql_parse
step "promtool check config deploy/prometheus/prometheus.yml" check_config
step "promtool check rules deploy/prometheus/alerts.yml" promtool check rules deploy/prometheus/alerts.yml
step "promtool test rules deploy/prometheus/alerts_test.yml" promtool test rules deploy/prometheus/alerts_test.yml
step "deploy/prometheus/local_targets.sh" local_targets
step "yamllint deploy/prometheus" yaml_lint

echo "obs_static: summary"
printf '  %s\n' "${RESULTS[@]}"
if [ $FAILED -ne 0 ]; then
  echo "obs_static: FAILED ($FAILED step(s))" >&2
  exit 1
fi
echo "obs_static: PASSED"
